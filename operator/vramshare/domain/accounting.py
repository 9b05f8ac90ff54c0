"""How memory is counted: the settings the webhook and the controller must agree on.

The webhook decides with them and the controller publishes headroom and overuse with them; if the two
disagreed, `kubectl get gpudevices` would show a headroom the webhook does not use. Both components read
this one type from the same VRAMSHARE_* variables, which the chart sets from one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class StaleGpuMode(StrEnum):
    """What to do with a GPU whose latest sample is older than the maximum age."""

    REFUSE = "refuse"
    """Exclude it until fresh metrics arrive."""
    LEDGER_ONLY = "ledger-only"
    """Judge it by reservations alone against its last known total."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Accounting:
    safety_margin_mib: int = 512
    """Kept free on every GPU for CUDA contexts and usage the ledger cannot see."""
    settle_s: float = 60.0
    """How long a pod must have been running before its memory use is trusted to show in a sample."""
    max_sample_age_s: float = 120.0
    """A GPU whose latest sample is older than this is stale."""
    stale_mode: StaleGpuMode = StaleGpuMode.REFUSE
    """What a GPU whose latest sample is stale gets: refuse (no new bookings) or ledger-only (booked by
    the ledger alone, as if nothing else used it)."""

    def problems(self) -> list[tuple[str, object, str]]:
        """Each invalid field as (name, value, what is accepted)."""
        found: list[tuple[str, object, str]] = []
        if self.safety_margin_mib < 0:
            found.append(("safety_margin_mib", self.safety_margin_mib, "0 or more MiB"))
        if self.settle_s < 0:
            found.append(("settle_s", self.settle_s, "0 or more seconds"))
        if self.max_sample_age_s <= 0:
            found.append(("max_sample_age_s", self.max_sample_age_s, "a positive number of seconds"))
        return found
