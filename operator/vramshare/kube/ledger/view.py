"""The ledger's view: GpuDevices and active GpuReservations in memory, fed by LIST+WATCH, and the
snapshot an admission decides on (a live view, or a consistent read).

**Where the view comes from.** Each replica keeps GpuDevices and active GpuReservations in memory,
fed by LIST+WATCH (`WatchCache`), and decides from that: no LIST per request. The view used for a
decision is complete for every GPU's token: successful commits on one GPU are chained through its
token, and the token names the last one with a resourceVersion R at or after the creation of every
reservation committed on the GPU so far (its own creation version, or the one the commit it was
rebased over named, whichever is later). Once the reservation stream has passed R, it holds that
reservation and every one committed on the GPU before it. `snapshot()` waits (briefly) for the stream to pass
every GPU's R before it hands out a view; a GPU whose token moved only by this process's own commits
needs no wait, since those reservations are put into the view the moment they are decided. The
reservation stream may be ahead of the device stream; that only adds reservations a decision counts.

That last step rests on this process's own bookings staying in its view, which two interleavings
broke (issue #30, 1), and `WatchCache` now rules out, each reproduced against the real API server
(`tests/integration/test_watch_cache_e2e.py`):

- *a relist after 410 Gone* replaced the view with the list, dropping bookings decided and not yet
  created (and writes newer than the list); a decision made before they came back saw the GPU
  without them and rode this process's token chain onto it. A relist now keeps this process's
  decisions not yet created and every item newer than the list.
- *an event still in flight from before this process's write* (a queue entry's status write, whose
  MODIFIED arrives after `_commit_group` put the placed version) replaced the placed version with
  the unplaced one, and the next queue pass planned a second pod onto the GPU. An item is now never
  replaced by an older version of itself (each item's resourceVersion is kept).

**A booking ends when its pod does, not when its object is deleted** (issue #30, 5). Deleting a
namespace deletes its GpuReservations at once, and foreground deletion of a pod deleted its booking
through the ownerReference first (vramshare wrote one until issue #31), both while the pod may still
be terminating with the memory in use: the ledger lost the booking of a pod that still held the GPU.
Every booking made for a pod is created with the finalizer `vramshare.io/pod-terminated`, so a deleted
one stays in every view, with its phase, and counts until the controller has seen its pod gone or
finished (or, with no pod, the TTL pass) and removes it. A booking this process withdraws (its pod
will never exist) has the finalizer removed before it is deleted, so it stops counting at once, as
before.

**Sample times come from two objects** (issue #31). The controller writes a GpuDevice's status only
when its figures or state change; that its figures were read again since is said once per poll by the
inventory heartbeat on its Lease (`vramshare.domain.freshness`). The heartbeat names the devices'
resourceVersion its figures are stored at, and a view applies it only once its device stream has passed
that version (a consistent read: its list is later than any heartbeat already held), so a new sample
time is never put on figures older than the ones it was read with. It moves sample times only later,
and only changes which bookings count as not yet visible in used memory and which GPUs are stale, never
the tokens: the commit protocol above is untouched.

**A booking counts from its pod's start, read from the pods** (issue #45). Where it watches the GPU
pods (`watch_pods`: the webhooks), the view counts each Reserved booking whose pod exists as Bound and
dates it by that pod's start (`vramshare.domain.with_its_pod`), whether or not the controller has
written either yet. Both only make a booking count less conservatively once its pod shows it: a view
whose pods lag counts the booking as the reservation alone says (pending, not started yet).

**Refusals** are decided on a consistent read (a quorum LIST of both kinds), never on the cache, so a
pod is not refused on a view that missed released memory or a new GPU. Concurrent refusals share one
such read, as long as it started after they arrived.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from vramshare.domain import Gpu, LedgerIndex, ReleaseLog, Reservation, with_its_pod
from vramshare.domain.freshness import InventoryHeartbeat, with_heartbeat
from vramshare.domain.snapshot import Snapshot
from vramshare.kube.client import KubeClient, list_all
from vramshare.kube.lease_watch import HeartbeatSource
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.resources import (
    ANNOTATION_LEDGER,
    LABEL_ACTIVE,
    LABEL_RESERVATION,
    devices_path,
    reservations_path,
)
from vramshare.kube.sightings import LabelledPod, PodsByLabel
from vramshare.kube.watch import WatchCache

log = structlog.get_logger("vramshare.ledger")
CATCH_UP_TIMEOUT_S = 2.0
"""How long a decision waits for the reservation stream to pass every token; then a consistent read."""

ACTIVE = f"{LABEL_ACTIVE}!=false"
"""Only the live ledger: ended reservations are labelled inactive by the controller. A reservation
without the label (made by hand) is counted, to be safe."""


def last_commit_version(device: GpuDevice) -> int:
    """The creation resourceVersion of the last reservation committed on `device` (0: none yet, or
    an annotation without it, written before vramshare recorded it: -1, so only a consistent read
    can vouch for that GPU)."""
    value = device.meta.annotations.get(ANNOTATION_LEDGER)
    if not value:
        return 0
    _, _, version = value.rpartition("@")
    return int(version) if version.isdigit() else -1


def _version_of(device: GpuDevice) -> int:
    raw = device.meta.resource_version
    return int(raw) if raw.isdigit() else 0


def _label_of(reservation: Reservation) -> tuple[str, str]:
    """The (namespace, label) the pod of `reservation` carries."""
    return reservation.namespace, reservation.pod_label or reservation.name


def _reservation_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowedStreams:
    """Watch caches of every GpuDevice and every GpuReservation a process keeps already (the
    controller's state): a view given them follows their streams (`WatchCache.following`) instead of
    opening two of its own, so each event is received and decoded once in that process. Its copies
    keep the view's rules: the active bookings only (as its own stream's label selector), and its own
    decisions put in."""

    devices: WatchCache[GpuDevice]
    reservations: WatchCache[GpuReservation]


def _same(device: GpuDevice) -> GpuDevice:
    return device


def _active_booking(reservation: GpuReservation) -> Reservation | None:
    """What the view's own stream (label selector `ACTIVE`) would hold of `reservation`."""
    return reservation.to_domain() if reservation.labelled_active else None


@dataclass(frozen=True, slots=True, kw_only=True)
class _DeviceView:
    """One GpuDevice as the live view needs it."""

    uuid: str
    token: str
    commit_version: int
    """`last_commit_version` of the device at this token."""
    gpu: Gpu | None


class LedgerView:
    """The view (see the module docstring); the commit protocol (`vramshare.kube.ledger.commit`) builds
    on it."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_write: Callable[[str, str], None] = lambda resource, verb: None,
        on_consistent_read: Callable[[], None] = lambda: None,
        heartbeat: HeartbeatSource | None = None,
        watch_pods: bool = False,
        pods: PodsByLabel | None = None,
        follow: FollowedStreams | None = None,
    ) -> None:
        self.kube = kube
        self.heartbeat = heartbeat
        """The controller's inventory heartbeat: the sample time of GPUs whose figures did not change
        (see `vramshare.domain.freshness`). Without it, stored sample times only."""
        self.clock = clock
        self.on_write = on_write
        """Told of every write (resource, verb), so the webhook can count API writes per admission."""
        self.on_consistent_read = on_consistent_read
        self.devices: WatchCache[GpuDevice]
        self.reservations: WatchCache[Reservation]
        if follow is None:
            self.devices = WatchCache(kube, devices_path(), decode=GpuDevice.from_wire, name="gpudevices")
            self.reservations = WatchCache(
                kube,
                reservations_path(),
                decode=lambda o: GpuReservation.from_wire(o).to_domain(),
                label_selector=ACTIVE,
                name="gpureservations",
            )
        else:
            self.devices = WatchCache.following(follow.devices, convert=_same, name="gpudevices (ledger)")
            self.reservations = WatchCache.following(
                follow.reservations, convert=_active_booking, name="gpureservations (ledger)"
            )
        self.pods: WatchCache[LabelledPod] | None = None
        """The pods carrying vramshare's reservation label (`watch_pods`), by namespace/name."""
        self.pods_by_label = pods
        """Those pods' sightings by label: this view's own (`watch_pods`), or a caller's that follows
        the pods already (the controller's)."""
        self._bookings_by_label: dict[tuple[str, str], set[str]] = {}
        """(namespace, label) -> the keys of the reservations made for the pod carrying it."""
        if watch_pods and self.pods_by_label is None:
            by_label = self.pods_by_label = PodsByLabel()
            self.pods = WatchCache(
                kube,
                "/api/v1/pods",
                decode=LabelledPod.from_wire,
                label_selector=LABEL_RESERVATION,
                name="pods",
            )
            self.pods.on_change(lambda key, pod, _previous: by_label.changed(key, pod))
        if self.pods_by_label is not None:
            self.pods_by_label.on_change(self._recount)
        self.index = LedgerIndex()
        """The reservations cache summed per GPU, kept in step with every change to it (and to its
        bookings' pods, with `watch_pods`)."""
        self.releases = ReleaseLog()
        """Memory freed by pods that ran, lately: when a refused request may expect room."""
        self.reservations.on_change(self._changed)
        self._devices: dict[str, _DeviceView] = {}
        """Device key -> what a decision needs of it, converted once per version (not per decision:
        with a thousand GPUs that conversion cost more than the decision itself)."""
        self._view_gpus: tuple[tuple[Gpu, ...], dict[str, str]] | None = None
        """The GPUs and their tokens as the last view handed them out, until a device changes."""
        self._view_heartbeat: InventoryHeartbeat | None = None
        """The heartbeat the last view's GPUs are dated by."""
        self._dated: dict[str, tuple[Gpu, InventoryHeartbeat | None, Gpu]] = {}
        """GPU UUID -> (its GPU as stored, the heartbeat, dated by it): the same object while neither
        changes, so what the ledger index remembers per GPU object stays valid."""
        self.devices.on_change(self._device_changed)
        self._own_tokens: dict[str, str] = {}
        """GPU UUID -> the token this process's last commit on it returned (no wait needed there)."""
        self._marks: dict[str, str] = {}
        """Token -> the last reservation the GPU named at that token (to tell a commit from a new
        sample when a bump meets a 409)."""
        self._fresh_lock = asyncio.Lock()
        self._fresh: tuple[float, Snapshot] | None = None
        self.consistent_reads = 0
        self.catch_up_waits = 0

    def _changed(self, key: str, reservation: Reservation | None, previous: Reservation | None) -> None:
        if self.pods_by_label is not None:
            if previous is not None:
                keys = self._bookings_by_label.get(_label_of(previous))
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._bookings_by_label[_label_of(previous)]
            if reservation is not None:
                self._bookings_by_label.setdefault(_label_of(reservation), set()).add(key)
        self._index_put(key, reservation)

    def _index_put(self, key: str, reservation: Reservation | None) -> None:
        before = self.index.get(key)
        self.index.put(key, self.as_seen(reservation) if reservation is not None else None)
        ended = reservation is None or not reservation.is_active
        if ended and before is not None and before.pod_running_since is not None:
            self.releases.add(at=self.clock(), gpu_uuid=before.gpu_uuid, mib=before.mib)

    def as_seen(self, reservation: Reservation) -> Reservation:
        """`reservation` as its pod shows it (see the module docstring); as it is without the pods."""
        if self.pods_by_label is None:
            return reservation
        pods = self.pods_by_label.of(*_label_of(reservation))
        return with_its_pod(reservation, pods) if pods else reservation

    def _recount(self, label: tuple[str, str]) -> None:
        """Put the bookings made for the pod carrying `label` into the index again, as its pods show them."""
        for key in self._bookings_by_label.get(label, ()):
            reservation = self.reservations.items.get(key)
            # Most pod events (scheduled, a condition, a container's state) change nothing the ledger
            # counts; putting the booking again would drop its GPU's remembered figures for nothing.
            if reservation is not None and self.index.get(key) != self.as_seen(reservation):
                self._index_put(key, reservation)

    def _device_changed(self, key: str, device: GpuDevice | None, _previous: GpuDevice | None) -> None:
        self._view_gpus = None
        if device is None:
            gone = self._devices.pop(key, None)
            if gone is not None:
                self._dated.pop(gone.uuid, None)
            return
        self._remember_mark(device)
        self._devices[key] = _DeviceView(
            uuid=device.spec.uuid,
            token=device.ledger_token,
            commit_version=last_commit_version(device),
            gpu=device.to_domain(),
        )

    def release_rate(self, gpu_uuid: str | None = None) -> float:
        """MiB per second freed lately by pods that ended, on one GPU or on all."""
        return self.releases.rate_mib_per_s(now=self.clock(), gpu_uuid=gpu_uuid)

    async def run(self) -> None:
        """Keep both caches fed until cancelled."""
        runs = [self.devices.run(), self.reservations.run()]
        if self.pods is not None:
            runs.append(self.pods.run())
        await asyncio.gather(*runs)

    @property
    def synced(self) -> bool:
        return self.devices.synced.is_set() and self.reservations.synced.is_set()

    @property
    def live(self) -> bool:
        """Both caches synced and following their streams; otherwise decisions read consistently."""
        return self.synced and self.devices.streaming and self.reservations.streaming

    async def snapshot(self, *, fresh: bool = False) -> Snapshot:
        """The cached view, complete for every token in it; with `fresh`, a consistent read (slower),
        as a refusal deserves."""
        if fresh or not self.live:
            return await self._consistent()
        needed = 0
        own = self._own_tokens
        for device in self._devices.values():
            if own.get(device.uuid) == device.token:
                continue  # moved only by our own commits, whose reservations are in the view already
            if device.commit_version < 0:
                return await self._consistent()  # a token only a consistent read can vouch for
            needed = max(needed, device.commit_version)
        if not await self._caught_up(needed):
            log.warning("reservation stream behind the GPU tokens; reading consistently", needed=needed)
            return await self._consistent()
        return self._view()

    async def _caught_up(self, needed: int) -> bool:
        """Whether the reservation stream has passed resourceVersion `needed`, waiting briefly for it."""
        if self.reservations.resource_version >= needed:
            return True
        self.catch_up_waits += 1
        return await self.reservations.wait_for(needed, timeout_s=CATCH_UP_TIMEOUT_S)

    def _view(self) -> Snapshot:
        heartbeat = (
            self.heartbeat.current(devices_seen_to=self.devices.resource_version)
            if self.heartbeat is not None
            else None
        )
        if self._view_gpus is None or heartbeat is not self._view_heartbeat:
            gpus = tuple(
                self._dated_gpu(d.gpu, heartbeat) for d in self._devices.values() if d.gpu is not None
            )
            tokens = {d.uuid: d.token for d in self._devices.values() if d.gpu is not None}
            self._view_gpus, self._view_heartbeat = (gpus, tokens), heartbeat
        gpus, tokens = self._view_gpus
        return Snapshot(gpus=gpus, reservations=(), index=self.index, tokens=tokens, live=True)

    def _dated_gpu(self, gpu: Gpu, heartbeat: InventoryHeartbeat | None) -> Gpu:
        known = self._dated.get(gpu.uuid)
        if known is not None and known[0] is gpu and known[1] is heartbeat:
            return known[2]
        dated = with_heartbeat(gpu, heartbeat)
        self._dated[gpu.uuid] = (gpu, heartbeat, dated)
        return dated

    async def _consistent(self) -> Snapshot:
        """A quorum read of both kinds. Callers that arrive while one is in flight wait for it and then
        share the next one, so a storm of refusals makes one read at a time, each fresh for its
        waiters."""
        arrived = self.clock()
        async with self._fresh_lock:
            if self._fresh is not None and self._fresh[0] >= arrived:
                return self._fresh[1]
            started = self.clock()
            snapshot = await self._read()
            self._fresh = (started, snapshot)
            self.consistent_reads += 1
            self.on_consistent_read()
            return snapshot

    async def _read(self) -> Snapshot:
        devices = await list_all(self.kube, devices_path())
        # At least as new as the devices' list: every reservation committed before a token we hold.
        listed = await list_all(
            self.kube,
            reservations_path(),
            label_selector=ACTIVE,
            resource_version=devices["metadata"]["resourceVersion"],
            not_older_than=True,
        )
        # Any heartbeat held now was published after the writes it relies on, so before this list.
        heartbeat = (
            self.heartbeat.for_read(devices_version=int(devices["metadata"]["resourceVersion"]))
            if self.heartbeat is not None
            else None
        )
        gpus, tokens = [], {}
        for obj in devices.get("items", []):
            device = GpuDevice.from_wire(obj)
            gpu = device.to_domain()
            if gpu is not None:
                gpus.append(with_heartbeat(gpu, heartbeat))
                tokens[gpu.uuid] = device.ledger_token
                self._remember_mark(device)
        # Dated by the pods as this view last saw them: a pod's start never changes once it is known.
        reservations = tuple(
            self.as_seen(GpuReservation.from_wire(o).to_domain()) for o in listed.get("items", [])
        )
        # This process's reservations decided but not yet created count too.
        listed_names = {(r.namespace, r.name) for r in reservations}
        pending = tuple(
            r
            for r in self.reservations.items.values()
            if r.reserved_at == 0.0 and (r.namespace, r.name) not in listed_names
        )
        return Snapshot(gpus=tuple(gpus), reservations=reservations + pending, tokens=tokens)

    def _remember_mark(self, device: GpuDevice) -> None:
        self._marks[device.ledger_token] = device.meta.annotations.get(ANNOTATION_LEDGER, "")
        if len(self._marks) > 4096:
            del self._marks[next(iter(self._marks))]
