"""The reservation ledger in the API server, with an atomic commit that holds across webhook replicas.

Commit protocol (optimistic concurrency, no lock held anywhere across processes):

1. Read the GPUs (GpuDevices) with each one's resourceVersion: the GPU's *ledger token*.
2. Read the active GpuReservations, complete up to every token held (see below).
3. Decide with the pure domain.
4. Create the GpuReservation, then bump the chosen GPU's token with a merge patch that carries the
   token from step 1 as a precondition and names the new reservation with its own resourceVersion
   (annotation `vramshare.io/last-reservation: <namespace>/<name>@<resourceVersion>`).
5. If the token moved because another replica committed on that GPU (409 Conflict, and the device names
   another last reservation), wait until the reservation stream holds that commit, and check the GPU
   again with every booking counted, ours and the winner's. If it still has room (with small pods on
   large GPUs it nearly always has), the bump is retried on the new token: a fresh decision would have
   found that same room, and deleting, re-deciding and re-creating would only lose the next race too.
   Ours may have been created before the winner's, so that bump names the larger of the two
   resourceVersions: the token must still cover every booking on the GPU. If not, delete our
   reservation and start again. A 409 from a status write alone (the controller recording a new sample)
   names the same last reservation: nothing was committed meanwhile, so the bump is retried on the new
   resourceVersion. Otherwise a queue placement or a hold is labelled committed (off the answer's
   path, retried, and waited for on shutdown: `drain`), so the next leader and observers can tell it
   from a candidate that may still be withdrawn. A pod's own booking is not labelled: the webhook
   answers only once the commit held, so its pod existing is the record (issue #31: that label was a
   third write on every admission).

Any commit on a GPU between our steps 1 and 4 moves its token and names a new reservation (names
are unique), so two admissions can never both succeed on a view that misses the other.

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

**Refusals** are decided on a consistent read (a quorum LIST of both kinds), never on the cache, so a
pod is not refused on a view that missed released memory or a new GPU. Concurrent refusals share one
such read, as long as it started after they arrived.

**Within one process** a decision puts its reservation into the view before its first await, so the
next decision already counts it and does not pick the same "best" GPU: requests that arrive together
are decided together without a batching window. Commits on different GPUs run in parallel; commits
on the same GPU are chained in order on one token. Across replicas, GPUs that tie are dealt out so
that replicas rarely commit on the same GPU at once (`vramshare.domain.shards`, issue #31); the token,
not the deal, keeps that safe. (Pipelining a GPU's groups, the next group's creates while the last
one moves the token, was tried in issue #31 and measured no faster on a CPU-bound API server; it
also needed a mark that never names less than the one it moves from.)

The webhook bounds its whole answer by a deadline below the API server's timeout. A commit cancelled
by that deadline anywhere after its create withdraws the reservation (bounded by a few seconds), so
an admission the API server gave up on leaves no booking behind; one that cannot be withdrawn (the
API server is what made us late) expires with the controller's short TTL, as Expired/PodNeverCreated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from vramshare.domain import Gpu, LedgerIndex, ReleaseLog, Reservation
from vramshare.domain.freshness import InventoryHeartbeat, with_heartbeat
from vramshare.domain.snapshot import CommitConflictError, Snapshot
from vramshare.kube.client import ApiError, KubeClient, Obj, list_all
from vramshare.kube.lease_watch import HeartbeatSource
from vramshare.kube.objects import GpuDevice, GpuReservation, remove_finalizer
from vramshare.kube.resources import (
    ANNOTATION_LEDGER,
    ANNOTATION_REINVOKED,
    FINALIZER_POD_GONE,
    LABEL_ACTIVE,
    LABEL_COMMITTED,
    LABEL_GPU,
    LABEL_HELD_FOR,
    LABEL_RESERVATION,
    device_name,
    devices_path,
    pod_path,
    reservations_path,
)
from vramshare.kube.watch import WatchCache

log = structlog.get_logger("vramshare.ledger")

WITHDRAW_TIMEOUT_S = 3.0
LABEL_ATTEMPTS = 5
LABEL_BACKOFF_S = 0.2
"""The committed label is retried this many times, waiting 0.2, 0.4, 0.8, 1.6 s in between."""
CATCH_UP_TIMEOUT_S = 2.0
"""How long a decision waits for the reservation stream to pass every token; then a consistent read."""
ACTIVE = f"{LABEL_ACTIVE}!=false"
"""Only the live ledger: ended reservations are labelled inactive by the controller. A reservation
without the label (made by hand) is counted, to be safe."""


MAX_GROUP = 32
"""At most this many reservations share one bump of a GPU's token."""

MAX_BUMPS = 8
"""Tries of one bump: a status write or a commit that left room moves the token, and we follow it."""


@dataclass(kw_only=True, eq=False)
class _Pending:
    reservation: GpuReservation
    key: str
    token: str
    live: bool
    done: asyncio.Future[GpuReservation]
    places: bool = False
    """It writes the placement of an existing queue entry instead of creating a reservation."""
    abandoned: bool = False
    """Its caller gave up (deadline) while its group was on its way: withdraw it once made."""


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


def _reservation_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class _DeviceView:
    """One GpuDevice as the live view needs it."""

    uuid: str
    token: str
    commit_version: int
    """`last_commit_version` of the device at this token."""
    gpu: Gpu | None


class KubeLedger:
    def __init__(
        self,
        kube: KubeClient,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_write: Callable[[str, str], None] = lambda resource, verb: None,
        on_consistent_read: Callable[[], None] = lambda: None,
        has_room: Callable[[Gpu, LedgerIndex], bool] | None = None,
        on_rebase: Callable[[], None] = lambda: None,
        heartbeat: HeartbeatSource | None = None,
    ) -> None:
        self.kube = kube
        self.heartbeat = heartbeat
        """The controller's inventory heartbeat: the sample time of GPUs whose figures did not change
        (see `vramshare.domain.freshness`). Without it, stored sample times only."""
        self.clock = clock
        self.on_write = on_write
        """Told of every write (resource, verb), so the webhook can count API writes per admission."""
        self.on_consistent_read = on_consistent_read
        self.has_room = has_room
        """Whether a GPU has room for everything booked on it in the index (the domain's
        `has_room_for_its_bookings` with the deployment's accounting). With it, a commit that lost its
        race to one that left room for it stands on the newer token (step 5 above); without it, every
        lost race decides again."""
        self.on_rebase = on_rebase
        """Told of each commit that lost its race and stood on the newer token."""
        self.devices: WatchCache[GpuDevice] = WatchCache(
            kube, devices_path(), decode=GpuDevice.from_wire, name="gpudevices"
        )
        self.reservations: WatchCache[Reservation] = WatchCache(
            kube,
            reservations_path(),
            decode=lambda o: GpuReservation.from_wire(o).to_domain(),
            label_selector=ACTIVE,
            name="gpureservations",
        )
        self.index = LedgerIndex()
        """The reservations cache summed per GPU, kept in step with every change to it."""
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
        self._successor: dict[str, dict[str, str]] = {}
        self._marks: dict[str, str] = {}
        """Token -> the last reservation the GPU named at that token (to tell a commit from a new
        sample when a bump meets a 409)."""
        """GPU UUID -> {token: the token our commit on it returned}, to chain our own commits."""
        self._queues: dict[str, list[_Pending]] = {}
        """GPU UUID -> commits decided and waiting for that GPU, in the order they were decided."""
        self._committers: dict[str, asyncio.Task[None]] = {}
        self._fresh_lock = asyncio.Lock()
        self._fresh: tuple[float, Snapshot] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.consistent_reads = 0
        self.catch_up_waits = 0

    def _changed(self, key: str, reservation: Reservation | None, _previous: Reservation | None) -> None:
        before = self.index.get(key)
        self.index.put(key, reservation)
        ended = reservation is None or not reservation.is_active
        if ended and before is not None and before.pod_running_since is not None:
            self.releases.add(at=self.clock(), gpu_uuid=before.gpu_uuid, mib=before.mib)

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

    async def withdraw_hold(self, namespace: str, name: str) -> None:
        """Delete a hold whose task was just admitted, off the answer's path: it runs after the task's
        commit succeeded, so a slow delete must not make the admission miss its deadline (it would
        answer Late while the booking stands). A hold that stays lapses on its own."""
        self._later(self._delete_hold(namespace, name))

    async def _delete_hold(self, namespace: str, name: str) -> None:
        self.on_write("gpureservations", "delete")
        try:
            await self.kube.delete(reservations_path(namespace, name))
        except ApiError as exc:
            if not exc.not_found:
                log.warning(
                    "hold not withdrawn; it lapses", reservation=f"{namespace}/{name}", error=str(exc)
                )

    async def run(self) -> None:
        """Keep both caches fed until cancelled."""
        await asyncio.gather(self.devices.run(), self.reservations.run())

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
        reservations = tuple(GpuReservation.from_wire(o).to_domain() for o in listed.get("items", []))
        # This process's reservations decided but not yet created count too.
        listed_names = {(r.namespace, r.name) for r in reservations}
        pending = tuple(
            r
            for r in self.reservations.items.values()
            if r.reserved_at == 0.0 and (r.namespace, r.name) not in listed_names
        )
        return Snapshot(gpus=tuple(gpus), reservations=reservations + pending, tokens=tokens)

    async def get_reservation(self, namespace: str, name: str) -> GpuReservation | None:
        try:
            return GpuReservation.from_wire(await self.kube.get(reservations_path(namespace, name)))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def claim_reinvocation(self, reservation: GpuReservation, *, claimant: str) -> bool:
        """Mark `reservation` as taken up by a reinvocation of its admission; False when another pass
        already did (the API server reinvokes a webhook at most once, so a second claim is a copy).
        A precondition makes the claim exclusive; a conflict from another change (the committed label
        landing meanwhile) is read again and retried."""
        current: GpuReservation | None = reservation
        for _ in range(5):
            if current is None or ANNOTATION_REINVOKED in current.meta.annotations:
                return False
            try:
                self.on_write("gpureservations", "patch")
                await self.kube.merge_patch(
                    reservations_path(current.namespace, current.name),
                    {
                        "metadata": {
                            "resourceVersion": current.meta.resource_version,
                            "annotations": {ANNOTATION_REINVOKED: claimant},
                        }
                    },
                )
                return True
            except ApiError as exc:
                if exc.not_found:
                    return False
                if not exc.conflict:
                    raise
            current = await self.get_reservation(reservation.namespace, reservation.name)
        return False

    async def pod_exists(self, namespace: str, name: str) -> bool:
        """Whether a pod of that name exists (a GET, cheap beside a pod cache). Served from the API
        server's watch cache, not etcd (issue #31: one read of etcd less per admission): it may miss
        a pod created in the last moment, whose duplicate then gets a booking that ends at the TTL,
        as before this check; a loop of such creates is caught from its second try on."""
        try:
            await self.kube.get(pod_path(namespace, name), resource_version="0")
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def active_holds(self) -> list[GpuReservation]:
        """Every hold in the fleet not ended, on a consistent read."""
        listed = await list_all(self.kube, reservations_path(), label_selector=f"{ACTIVE},{LABEL_HELD_FOR}")
        holds = [GpuReservation.from_wire(o) for o in listed.get("items", [])]
        return [h for h in holds if h.phase.is_active]

    async def pod_labels(self, namespace: str) -> set[str]:
        """The reservation labels of the namespace's GPU pods (a consistent read)."""
        pods = await list_all(
            self.kube, f"/api/v1/namespaces/{namespace}/pods", label_selector=LABEL_RESERVATION
        )
        return {str(p["metadata"]["labels"][LABEL_RESERVATION]) for p in pods.get("items", [])}

    async def pod_carries(self, namespace: str, reservation: str) -> bool:
        """Whether any pod already carries the reservation's label (a consistent read)."""
        pods = await self.kube.list(
            f"/api/v1/namespaces/{namespace}/pods", label_selector=f"{LABEL_RESERVATION}={reservation}"
        )
        return bool(pods.get("items"))

    async def enqueue(self, reservation: GpuReservation) -> GpuReservation:
        """Create a queue entry (no GPU: it books nothing, so no token moves)."""
        self.on_write("gpureservations", "create")
        return GpuReservation.from_wire(
            await self.kube.create(reservations_path(reservation.namespace), reservation.to_wire())
        )

    async def place(
        self, *, entry: GpuReservation, gpu: Gpu, token: str, live: bool = False
    ) -> GpuReservation:
        """Book `gpu` for a queue entry through the same commit as an admission: its placement is
        written (with the entry's resourceVersion as a precondition, so two controllers cannot both
        place it), then the GPU's token is bumped naming it; `CommitConflictError` when either moved.

        A placement that committed stands even if the caller gives up meanwhile (its leadership
        ended): its pod exists and waits behind its gate, and the label `committed` lets the next
        leader lift it (see `vramshare.controller.queue`)."""
        return await self.commit(reservation=entry.placed_on(gpu), token=token, live=live, places=True)

    async def unplace(self, entry: GpuReservation) -> bool:
        """Take a placed queue entry back to the queue, unless it changed since `entry` was read (a
        leader still committing it labels it, or placed it anew); False then."""
        return await self._withdraw(entry, unplace=True)

    async def commit(
        self, *, reservation: GpuReservation, token: str, live: bool = False, places: bool = False
    ) -> GpuReservation:
        """Create `reservation` and bump its GPU's token; `CommitConflictError` when it moved.

        Call it right after deciding, with no await in between: the reservation joins this process's
        view at once, before the first await, so the next decision counts it. Commits on one GPU are
        made in the order they were decided, and those decided on live views while one was in
        flight go together: their reservations are created in parallel, then one bump of the token
        names the newest (group commit). With `live` (decided on a live view), a token moved since only
        by this process's own commits is followed to its latest value: those commits were decided
        before this one, so their reservations were in its view. A decision on a consistent read
        commits alone on its own token, or conflicts and decides again.

        If the caller is cancelled (the answer's deadline passed) its reservation does not stand: it is
        not created if still queued, and withdrawn if its group was already on its way."""
        gpu_uuid = reservation.spec.gpu_uuid
        key = _reservation_key(reservation.namespace, reservation.name)
        self.reservations.put(key, reservation.to_domain())  # reserved_at 0.0: decided, not created
        entry = _Pending(
            reservation=reservation,
            key=key,
            token=token,
            live=live,
            done=asyncio.get_running_loop().create_future(),
            places=places,
        )
        queue = self._queues.setdefault(gpu_uuid, [])
        queue.append(entry)
        if gpu_uuid not in self._committers:
            self._committers[gpu_uuid] = asyncio.get_running_loop().create_task(self._drain(gpu_uuid))
        try:
            return await asyncio.shield(entry.done)
        except asyncio.CancelledError:
            if entry in queue:
                queue.remove(entry)
                self.reservations.drop(key)
            elif entry.done.done() and not entry.done.cancelled() and entry.done.exception() is None:
                if not places:  # a committed placement stands (see `place`)
                    self._later(self._abandon(entry.done.result(), key))
            else:
                entry.abandoned = True
            raise

    def _later(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def decided(self, reservation: GpuReservation) -> None:
        """Put a booking into this process's view now, before any await: `commit` does it for one
        booking, but a pod with several GPUs commits them concurrently and every one must be in the
        view before another decision can run (see `commit` on why the view must hold it)."""
        self.reservations.put(
            _reservation_key(reservation.namespace, reservation.name), reservation.to_domain()
        )

    def undecided(self, reservation: GpuReservation) -> None:
        """Take a booking `decided` but never committed out of the view (its commit was cancelled)."""
        self.reservations.drop(_reservation_key(reservation.namespace, reservation.name))

    async def withdraw(self, created: GpuReservation) -> None:
        """Take back a committed booking nobody will use (the rest of its pod's set lost its race)."""
        await self._abandon(created, _reservation_key(created.namespace, created.name))

    async def _abandon(self, created: GpuReservation, key: str) -> None:
        self.reservations.drop(key)
        await self._withdraw(created)

    def _head(self, gpu_uuid: str, token: str) -> str:
        chain = self._successor.get(gpu_uuid, {})
        while token in chain:
            token = chain[token]
        return token

    async def _drain(self, gpu_uuid: str) -> None:
        queue = self._queues[gpu_uuid]
        try:
            while queue:
                first = queue.pop(0)
                batch = [first]
                token = first.token
                if first.live:
                    token = self._head(gpu_uuid, first.token)
                    while (
                        queue
                        and len(batch) < MAX_GROUP
                        and queue[0].live
                        and self._head(gpu_uuid, queue[0].token) == token
                    ):
                        batch.append(queue.pop(0))
                await self._commit_group(gpu_uuid, batch, token)
        finally:
            self._committers.pop(gpu_uuid, None)
            for entry in queue:  # only when this task itself is cancelled (shutdown)
                self.reservations.drop(entry.key)
                entry.done.cancel()
            queue.clear()

    async def _create(self, entry: _Pending) -> GpuReservation:
        res = entry.reservation
        if entry.places:
            self.on_write("gpureservations", "patch")
            obj = await self.kube.merge_patch(
                reservations_path(res.namespace, res.name),
                {
                    "metadata": {
                        "resourceVersion": res.meta.resource_version,
                        "labels": dict(res.meta.labels),
                    },
                    "spec": res.spec.to_wire(),
                },
            )
        else:
            self.on_write("gpureservations", "create")
            obj = await self.kube.create(reservations_path(res.namespace), res.to_wire())
        return GpuReservation.from_wire(obj)

    async def _commit_group(self, gpu_uuid: str, batch: list[_Pending], token: str) -> None:
        results = await asyncio.gather(*(self._create(e) for e in batch), return_exceptions=True)
        made: list[tuple[_Pending, GpuReservation]] = []
        for entry, result in zip(batch, results, strict=True):
            if isinstance(result, GpuReservation):
                made.append((entry, result))
            else:
                self._fail(entry, result)
        if not made:
            return
        newest = max((c for _, c in made), key=lambda c: int(c.meta.resource_version or 0))
        mark = f"{newest.key}@{newest.meta.resource_version}"
        try:
            bumped, token = await self._bump(gpu_uuid, token=token, mark=mark)
        except BaseException as exc:
            # The token moved, the GPU is gone, the API server failed, or we were cancelled: nobody
            # will be told of these bookings, so none may stand.
            await asyncio.gather(*(self._withdraw(c, unplace=e.places) for e, c in made))
            error: BaseException = exc
            if isinstance(exc, ApiError) and (exc.conflict or exc.not_found):
                error = CommitConflictError(f"GPU {gpu_uuid} changed while deciding")
            for entry, _ in made:
                self._fail(entry, error)
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
                raise  # this GPU's committer is being shut down
            return
        new_token = bumped["metadata"]["resourceVersion"]
        self._marks[new_token] = bumped["metadata"]["annotations"][ANNOTATION_LEDGER]
        chain = self._successor.setdefault(gpu_uuid, {})
        # From the token the bump moved, which is newer than the batch's own after a rebase: a decision
        # made on the batch's token never saw the commit it was rebased over, so it must not follow.
        chain[token] = new_token
        if len(chain) > 256:  # decisions older than that many own commits conflict and decide again
            del chain[next(iter(chain))]
        self._own_tokens[gpu_uuid] = new_token
        device = GpuDevice.from_wire(bumped)
        self.devices.put(f"/{device_name(gpu_uuid)}", device, resource_version=device.meta.resource_version)
        for entry, created in made:
            if entry.abandoned and not entry.places:  # a committed placement stands (see `place`)
                self._later(self._abandon(created, entry.key))
                continue
            self.reservations.put(
                entry.key, created.to_domain(), resource_version=created.meta.resource_version
            )
            if entry.places or created.held_for:  # no pod vouches for these (see the module's step 5)
                self._later(self._label_committed(created))
            entry.done.set_result(created)

    def _remember_mark(self, device: GpuDevice) -> None:
        self._marks[device.ledger_token] = device.meta.annotations.get(ANNOTATION_LEDGER, "")
        if len(self._marks) > 4096:
            del self._marks[next(iter(self._marks))]

    async def _bump(self, gpu_uuid: str, *, token: str, mark: str) -> tuple[Obj, str]:
        """Move the GPU's token from `token`, naming the newest reservation (`mark`, whose version a
        rebase raises to the winner's); returns the patched device and the token it moved from.

        The token is the GpuDevice's resourceVersion, so the controller's status writes (new samples)
        move it too. A 409 is therefore checked: if the device still names the same last reservation
        as it did at `token`, no commit happened since, and the bump is retried on the new
        resourceVersion instead of failing every commit in flight on that GPU. If another commit
        landed, the bump is retried on its token only where the GPU still has room with both counted
        (`_room_after`); otherwise the 409 stands and the batch decides again."""
        path = devices_path(device_name(gpu_uuid))
        rebased = False
        for _ in range(MAX_BUMPS):
            try:
                self.on_write("gpudevices", "patch")
                patched = await self.kube.merge_patch(
                    path, {"metadata": {"resourceVersion": token, "annotations": {ANNOTATION_LEDGER: mark}}}
                )
                if rebased:
                    self.on_rebase()
                return patched, token
            except ApiError as exc:
                expected = self._marks.get(token)
                if not exc.conflict or (expected is None and self.has_room is None):
                    raise
                current = GpuDevice.from_wire(await self.kube.get(path))
                landed = current.meta.annotations.get(ANNOTATION_LEDGER, "") != expected
                if landed:
                    if not await self._room_after(current):
                        raise  # another commit landed on this GPU and left no room for ours: decide again
                    # Ours may have been created before the winner's: the mark must still cover every
                    # booking on the GPU, or a view that waits for it could miss the winner's.
                    name, _, version = mark.rpartition("@")
                    mark = f"{name}@{max(int(version), last_commit_version(current))}"
                    rebased = True
                token = current.ledger_token
                self._remember_mark(current)
        raise CommitConflictError(f"GPU {gpu_uuid} kept changing")

    async def _room_after(self, device: GpuDevice) -> bool:
        """Whether the GPU, as `device` shows it after another commit landed, still has room for every
        booking on it, this process's in-flight ones included. Judged on the live view once it holds
        that commit (the same wait as `snapshot`'s); False where that cannot be known quickly."""
        if self.has_room is None or not self.live:
            return False
        needed = last_commit_version(device)
        if needed < 0 or not await self._caught_up(needed):
            return False
        gpu = device.to_domain()
        if gpu is None:
            return False
        if self.heartbeat is not None:
            # Read just now: as of its own resourceVersion or later, it holds every write before it.
            gpu = with_heartbeat(gpu, self.heartbeat.for_read(devices_version=_version_of(device)))
        return self.has_room(gpu, self.index)

    def _fail(self, entry: _Pending, error: BaseException) -> None:
        self.reservations.drop(entry.key)
        if entry.done.done():
            return
        if isinstance(error, asyncio.CancelledError):
            entry.done.cancel()
        else:
            entry.done.set_exception(error)

    async def _label_committed(self, created: GpuReservation) -> None:
        """Label a placement or hold committed, off the answer's path, retried while the API server
        fails: a placement left unlabelled goes back to the queue (nobody vouches for it), and
        observers count only labelled ones. The booking stands either way."""
        error = ""
        for attempt in range(LABEL_ATTEMPTS):
            if attempt:
                await asyncio.sleep(LABEL_BACKOFF_S * 2 ** (attempt - 1))
            try:
                self.on_write("gpureservations", "patch")
                await self.kube.merge_patch(
                    reservations_path(created.namespace, created.name),
                    {"metadata": {"labels": {LABEL_COMMITTED: "true"}}},
                )
                return
            except ApiError as exc:
                if exc.not_found:
                    return  # withdrawn or ended meanwhile: nothing to label
                error = str(exc)
            except (OSError, TimeoutError) as exc:
                error = str(exc)
        log.warning(
            "reservation committed but not labelled",
            reservation=created.key,
            attempts=LABEL_ATTEMPTS,
            error=error,
        )

    async def drain(self, *, timeout_s: float = 5.0) -> int:
        """On shutdown, after the last answer: let the writes still running off the answers' path (the
        committed labels, withdrawals) finish, for at most `timeout_s`; returns how many did not."""
        pending = set(self._background)
        if not pending:
            return 0
        _, left = await asyncio.wait(pending, timeout=timeout_s)
        for task in left:
            task.cancel()
        if left:
            log.warning("shutting down with writes unfinished", unfinished=len(left), timeout_s=timeout_s)
        return len(left)

    async def _withdraw(self, created: GpuReservation, *, unplace: bool = False) -> bool:
        """Delete a booking nobody will use, within a few seconds; one that cannot be deleted (the API
        server is what made us late) expires with the reservation TTL instead. A placed queue entry
        goes back to the queue: its placement is removed, only as `created` left it (another leader
        may have taken the entry over since, and its pod may run on that placement). True when done."""
        path = reservations_path(created.namespace, created.name)
        try:
            if unplace:
                self.on_write("gpureservations", "patch")
                unplaced = {"nodeName": None, "gpuUUID": None, "gpuIndex": None}
                labels = {LABEL_GPU: None, LABEL_COMMITTED: None}
                meta = {"resourceVersion": created.meta.resource_version, "labels": labels}
                await asyncio.wait_for(
                    self.kube.merge_patch(path, {"metadata": meta, "spec": unplaced}), WITHDRAW_TIMEOUT_S
                )
                log.info("placement withdrawn; the entry is back in the queue", reservation=created.key)
                return True
            if created.waits_for_pod_gone:
                # Its pod will never exist: nothing to wait for. Without this a deleted booking would
                # stay (and count) until the controller saw it ended.
                self.on_write("gpureservations", "patch")
                await asyncio.wait_for(
                    self.kube.json_patch(path, remove_finalizer(created.meta, FINALIZER_POD_GONE)),
                    WITHDRAW_TIMEOUT_S,
                )
            self.on_write("gpureservations", "delete")
            await asyncio.wait_for(self.kube.delete(path), WITHDRAW_TIMEOUT_S)
            return True
        except ApiError as exc:
            if unplace and exc.conflict:
                log.info("placement not withdrawn: the entry changed meanwhile", reservation=created.key)
            elif not exc.not_found:
                log.warning("booking not withdrawn; it expires", reservation=created.key, error=str(exc))
        except (TimeoutError, OSError) as exc:
            log.warning("booking not withdrawn; it expires", reservation=created.key, error=repr(exc))
        return False
