"""When a GPU's status is written (pure): always when it changed, and only now and then when just its
sample time moved on, within a budget per poll. Every write moves the GPU's ledger token."""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import replace

from vramshare.kube.objects import DeviceStatus

WRITES_IN_FLIGHT = 16
"""GpuDevice writes one poll keeps in flight at once: a fleet's GPUs are independent objects, and one
at a time a thousand-GPU fleet's poll took as long as a thousand round trips."""


def refresh_after(uuid: str, *, max_sample_age_s: float) -> float:
    """How long an unchanged GPU's stored sample time may lag: between 3/16 and 1/4 of the maximum
    sample age, fixed per GPU by its UUID. GPUs discovered together (a new node, a restart) would
    otherwise all refresh on the same poll, a burst of one write per GPU."""
    spread = int.from_bytes(hashlib.blake2s(uuid.encode(), digest_size=2).digest(), "big") / 0xFFFF
    return max_sample_age_s / 4 * (0.75 + 0.25 * spread)


BOOKING_FIGURES_LAG_S = 10.0
"""The longest a GPU's booking figures (`reservedMiB`, `headroomMiB`) wait while commits land on it."""


class Write(enum.Enum):
    """Why a GPU's status is written this poll."""

    CHANGED = "changed"
    """Its sample's figures, state or conditions changed (or it has no status yet): always written."""
    BOOKINGS = "bookings"
    """Only the figures of its bookings changed (`reservedMiB`, `headroomMiB`, the words of a
    MemoryOverused condition that did not flip): written, except while commits land on the GPU (see
    `defer_booking_figures`)."""
    REFRESH = "refresh"
    """Only its sample time moved on, past its refresh interval: written within the poll's budget."""


def defer_booking_figures(*, committing: bool, deferred_s: float | None) -> bool:
    """Whether a write of booking figures alone waits for a later poll: while webhooks commit on the
    GPU (its ledger mark moved since the last poll), for at most `BOOKING_FIGURES_LAG_S` (`deferred_s`:
    how long it has waited, None if it has not). Every status write moves the GPU's ledger token, and
    a write in the middle of a burst makes each commit in flight on it pay a 409, a read and a second
    bump (issue #45: the clusters of slowest pods in the admission benchmark). The webhooks do not read
    these figures; they count the bookings themselves. A quiet GPU's are written at the next poll."""
    return committing and (deferred_s is None or deferred_s < BOOKING_FIGURES_LAG_S)


def why_write(desired: DeviceStatus, previous: DeviceStatus | None, *, refresh_s: float) -> Write | None:
    """Whether the status changed enough to write. A new sample with the same figures only moves
    `sampledAt`/`lastSeenAt`; those are refreshed every `refresh_s` (about a quarter of the maximum
    sample age, see `refresh_after`), not every poll. Every write moves the GPU's ledger token, and so
    makes the commits in flight on it conflict: writing only what matters keeps admissions from
    retrying for nothing. A stored sample time that lags makes decisions count more memory as not yet
    visible, never less."""
    if previous is None:
        return Write.CHANGED
    # Equal objects write equal JSON: the common case (nothing changed) needs no serialising.
    if _untimed(desired) != _untimed(previous):
        if _wire(_without_bookings(desired)) != _wire(_without_bookings(previous)):
            return Write.CHANGED
        if _wire(desired) != _wire(previous):
            return Write.BOOKINGS
    seen_lag = (desired.last_seen_at or 0.0) - (previous.last_seen_at or 0.0)
    if desired.sampled_at - previous.sampled_at >= refresh_s or seen_lag >= refresh_s:
        return Write.REFRESH
    return None


def _untimed(status: DeviceStatus) -> DeviceStatus:
    return replace(status, sampled_at=0.0, last_seen_at=None)


def _wire(status: DeviceStatus) -> dict[str, object]:
    times = ("sampledAt", "lastSeenAt")
    return {k: v for k, v in status.to_wire().items() if k not in times}


def _without_bookings(status: DeviceStatus) -> DeviceStatus:
    """`status` with the figures of its bookings blanked: what is left is the sample, the state and
    the conditions' verdicts (a MemoryOverused condition that flips is still a change)."""
    quiet = tuple(replace(c, message="") if c.type == "MemoryOverused" else c for c in status.conditions)
    return replace(status, reserved_mib=0, headroom_mib=0, conditions=quiet)


def refresh_budget(gpus: int, *, poll_interval_s: float, max_sample_age_s: float) -> int:
    """How many unchanged GPUs one poll may refresh: enough for every GPU once per its shortest
    refresh interval (3/16 of the maximum sample age) at this poll interval. Without a bound, a poll
    that took longer than the refresh interval (a thousand GPUs on a busy API server) found every GPU
    due again, and rewrote the whole fleet on every poll."""
    return max(1, math.ceil(gpus * poll_interval_s / (max_sample_age_s * 3 / 16)))


class RefreshBudget:
    """The refreshes of unchanged GPUs one poll may still write (see `refresh_budget`)."""

    def __init__(self, left: int = 0) -> None:
        self.left = left

    def take(self) -> bool:
        """One refresh, if any is left."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True
