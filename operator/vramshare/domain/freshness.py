"""The inventory heartbeat: one statement per poll that the GPUs whose figures did not change were
read again, in place of one status write per unchanged GPU (issue #31).

A decision needs each GPU's sample time twice: to refuse a GPU whose sample is too old (stale), and
to tell which bookings its used memory already shows (`headroom.is_unseen`). Before, the controller
kept those times current by rewriting `sampledAt` of every unchanged GPU every few polls: a thousand
idle GPUs cost hundreds of writes per poll, and a poll took ten seconds on a busy API server. Now the
leader writes a GpuDevice's status only when its figures or state change, and after each poll it
publishes one heartbeat (on its Lease, which it renews anyway):

    every GPU not listed as unconfirmed, as stored in the API server at resourceVersion
    `devices_version` or later, was read again with those same figures at `sampled_at` or later.

Why each part is there:

- `sampled_at` is the *oldest* sample among the GPUs it confirms. Claiming an earlier time than a
  GPU's own sample is safe: its used memory shows every pod that started before its own sample, so
  also before any earlier time. It never makes a booking look visible in used memory when it is not.
- `devices_version` fences the heartbeat against the figures it confirms. A webhook follows GpuDevices
  and the Lease on two streams; had it applied a heartbeat before its device stream brought that
  poll's status writes, it would have dated the *old* figures (less memory used, say) with the new
  time, and counted a booking as visible in used memory that those figures do not show. A heartbeat
  applies only once the reader's device view is at `devices_version` (every write the heartbeat
  relies on is at or before it); until then the last one that applied stands.
- `unconfirmed` names the GPUs it says nothing about: not Ready, a sample much older than the rest (it
  would drag every GPU's time back), or a status write that did not land. Their stored sample time
  stands, and the controller keeps refreshing it with writes, as before.

Applying a heartbeat only ever moves a GPU's sample time later, never its figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from vramshare.domain.models import Gpu

MAX_UNCONFIRMED = 256
"""A heartbeat listing more GPUs than this is not published (the Lease would carry a large list every
renewal): the controller then refreshes every GPU with status writes, as before heartbeats."""


@dataclass(frozen=True, kw_only=True)
class InventoryHeartbeat:
    sampled_at: float
    devices_version: int
    """The GpuDevices' resourceVersion the confirmed figures are stored at (or before)."""
    unconfirmed: frozenset[str] = frozenset()
    """GPU UUIDs this heartbeat says nothing about."""

    def applies_to(self, devices_seen_to: int) -> bool:
        """Whether a device view that holds every event up to `devices_seen_to` holds the figures this
        heartbeat confirms."""
        return devices_seen_to >= self.devices_version

    def confirms(self, uuid: str) -> bool:
        return uuid not in self.unconfirmed


def with_heartbeat(gpu: Gpu, heartbeat: InventoryHeartbeat | None) -> Gpu:
    """`gpu` dated by the heartbeat when it confirms the GPU with a later time; else `gpu` itself (the
    same object, so what is remembered per GPU object stays valid)."""
    if heartbeat is None or heartbeat.sampled_at <= gpu.sampled_at or not heartbeat.confirms(gpu.uuid):
        return gpu
    return replace(gpu, sampled_at=heartbeat.sampled_at)


def compose_heartbeat(
    *,
    confirmed: Mapping[str, float],
    known: Iterable[str],
    devices_version: int,
    window_s: float,
) -> InventoryHeartbeat | None:
    """The heartbeat of one poll. `confirmed`: the Ready GPUs whose stored figures this poll read again
    (or just wrote), with each one's sample time; `known`: every GPU the API server holds a GpuDevice
    for. GPUs sampled more than `window_s` before the newest are left unconfirmed (one lagging
    exporter must not age the whole fleet). None when nothing is confirmed or too much is not."""
    if not confirmed:
        return None
    newest = max(confirmed.values())
    covered = {uuid: at for uuid, at in confirmed.items() if at >= newest - window_s}
    unconfirmed = frozenset(known) - covered.keys()
    if len(unconfirmed) > MAX_UNCONFIRMED:
        return None
    return InventoryHeartbeat(
        sampled_at=min(covered.values()), devices_version=devices_version, unconfirmed=unconfirmed
    )


class HeartbeatView:
    """What a reader of the inventory applies: the newest heartbeat that its device view has caught up
    with (see `InventoryHeartbeat.devices_version`), the last such one until the newest does."""

    def __init__(self) -> None:
        self.applied: InventoryHeartbeat | None = None
        self._waiting: InventoryHeartbeat | None = None

    def offer(self, heartbeat: InventoryHeartbeat | None) -> None:
        """The newest heartbeat published (None: none; the last applied one stays true)."""
        if heartbeat is None or heartbeat == self.applied:
            return
        if self.applied is not None and heartbeat.sampled_at <= self.applied.sampled_at:
            return  # an older statement (a stand-by's view of a past leader's) adds nothing
        self._waiting = heartbeat

    def current(self, *, devices_seen_to: int) -> InventoryHeartbeat | None:
        """The heartbeat to apply to the live device view, which holds every event up to
        `devices_seen_to` (and only moves on: a heartbeat that applied once applies for good)."""
        waiting = self._waiting
        if waiting is not None and waiting.applies_to(devices_seen_to):
            self.applied, self._waiting = waiting, None
        return self.applied

    def for_read(self, *, devices_version: int) -> InventoryHeartbeat | None:
        """The heartbeat to apply to a one-off read of the devices at `devices_version` (a consistent
        read), leaving the live view's as it is."""
        waiting = self._waiting
        if waiting is not None and waiting.applies_to(devices_version):
            return waiting
        return self.applied
