"""When the controller last saw each grant renewed (`vramshare.domain.grants`).

A grant lapses once it has gone unchanged for its `lasts_s` and the margin, by the controller's own
clock: any change of its resourceVersion counts as a renewal (client-go's rule for Leases; the
controller's own status write only makes it wait longer, never shorter). No timestamp written by
another machine is compared with this clock. A new leader starts counting from its first sight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from vramshare.domain.grants import MARGIN_S
from vramshare.kube.objects import GpuReservation


class GrantRenewals:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[str, tuple[str, float]] = {}
        """Grant key -> (the resourceVersion last seen, when it was first seen)."""

    def unrenewed_s(self, grant: GpuReservation) -> float:
        """How long `grant` has been seen at this version (0 for a version not seen before)."""
        now = self.clock()
        seen = self._seen.get(grant.key)
        if seen is None or seen[0] != grant.meta.resource_version:
            self._seen[grant.key] = (grant.meta.resource_version, now)
            return 0.0
        return now - seen[1]

    def lapses_in_s(self, grant: GpuReservation) -> float:
        """How long until `grant` lapses, as things stand."""
        return max(0.0, grant.grant_lasts_s + MARGIN_S - self.unrenewed_s(grant))

    def keep_only(self, keys: Iterable[str]) -> None:
        kept = set(keys)
        for key in self._seen.keys() - kept:
            del self._seen[key]
