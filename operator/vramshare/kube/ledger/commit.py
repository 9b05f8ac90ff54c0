"""The commit protocol: a booking written so that it holds across webhook replicas.

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

**Within one process** a decision puts its reservation into the view before its first await, so the
next decision already counts it and does not pick the same "best" GPU: requests that arrive together
are decided together without a batching window. Commits on different GPUs run in parallel; commits
on the same GPU bump its token in order, one bump at a time. A reservation is created as soon as it
is decided, without waiting for the bumps ahead of it: while one bump moves a GPU's token, the
reservations decided since are being created, and the next bump names all of them. (Until issue #45
a GPU's commits were chained create, bump, create, bump, and each waited for the whole group ahead
of it.) A bump never names an older reservation than the one before it on that GPU, so a view that
waits for the mark holds every booking committed before it, whichever create finished first. Across
replicas, GPUs that tie are dealt out so that replicas rarely commit on the same GPU at once
(`vramshare.domain.shards`, issue #31); the token, not the deal, keeps that safe.

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

from vramshare.domain import Gpu, LedgerIndex
from vramshare.domain.freshness import with_heartbeat
from vramshare.domain.inventory import DeviceState
from vramshare.domain.snapshot import CommitConflictError
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.lease_watch import HeartbeatSource
from vramshare.kube.ledger.grants import Grants, HeldGrant, may_take
from vramshare.kube.ledger.view import (
    FollowedStreams,
    LedgerView,
    _reservation_key,
    _version_of,
    last_commit_version,
)
from vramshare.kube.ledger.writes import label_committed
from vramshare.kube.ledger.writes import withdraw as withdraw_booking
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.resources import (
    ANNOTATION_LEDGER,
    device_name,
    devices_path,
    reservations_path,
)
from vramshare.kube.sightings import PodsByLabel

log = structlog.get_logger("vramshare.ledger")

MAX_GROUP = 32
"""At most this many reservations share one bump of a GPU's token."""

MAX_BUMPS = 8
"""Tries of one bump: a status write or a commit that left room moves the token, and we follow it."""
OUT_OF_SHARING = frozenset({DeviceState.NOT_SHARED.value, DeviceState.MISSING.value})
"""Device states no booking may land on: a status write to one of them ends a commit in flight."""


@dataclass(kw_only=True, eq=False)
class _Pending:
    reservation: GpuReservation
    key: str
    token: str
    live: bool
    done: asyncio.Future[GpuReservation]
    made: asyncio.Task[GpuReservation]
    """Its create (or placement), started when it was decided."""
    places: bool = False
    """It writes the placement of an existing queue entry instead of creating a reservation."""
    abandoned: bool = False
    """Its caller gave up (deadline) while its group was on its way: withdraw it once made."""


class CommitProtocol(LedgerView):
    """Commits on the view (see the module docstring), and their withdrawal."""

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
        watch_pods: bool = False,
        pods: PodsByLabel | None = None,
        follow: FollowedStreams | None = None,
    ) -> None:
        super().__init__(
            kube,
            clock=clock,
            on_write=on_write,
            on_consistent_read=on_consistent_read,
            heartbeat=heartbeat,
            watch_pods=watch_pods,
            pods=pods,
            follow=follow,
        )
        self.has_room = has_room
        """Whether a GPU has room for everything booked on it in the index (the domain's
        `has_room_for_its_bookings` with the deployment's accounting). With it, a commit that lost its
        race to one that left room for it stands on the newer token (step 5 above); without it, every
        lost race decides again."""
        self.on_rebase = on_rebase
        """Told of each commit that lost its race and stood on the newer token."""
        self._successor: dict[str, dict[str, str]] = {}
        """GPU UUID -> {token: the token our commit on it returned}, to chain our own commits."""
        self._queues: dict[str, list[_Pending]] = {}
        """GPU UUID -> commits decided and waiting for that GPU's bump, in the order they were decided."""
        self._named: dict[str, int] = {}
        """GPU UUID -> the highest reservation version this process's bumps named on it: a mark never
        names less (creates finish in any order)."""
        self._committers: dict[str, asyncio.Task[None]] = {}
        self.grants: Grants | None = None
        """This process's grants (`vramshare.kube.ledger.grants`); None: none are taken."""
        self.on_inside_grant: Callable[[], None] = lambda: None
        """Told of each booking made inside a grant (no bump)."""
        self._background: set[asyncio.Task[None]] = set()

    async def commit(
        self,
        *,
        reservation: GpuReservation,
        token: str,
        live: bool = False,
        places: bool = False,
        grant_room_mib: int | None = None,
    ) -> GpuReservation:
        """Create `reservation` and bump its GPU's token; `CommitConflictError` when it moved.

        Call it right after deciding, with no await in between: the reservation joins this process's
        view at once, before the first await, so the next decision counts it. Commits on one GPU are
        made in the order they were decided, and those decided on live views while one was in
        flight go together: their reservations are created as they are decided, and one bump of the
        token names the newest (group commit). With `live` (decided on a live view), a token moved since only
        by this process's own commits is followed to its latest value: those commits were decided
        before this one, so their reservations were in its view. A decision on a consistent read
        commits alone on its own token, or conflicts and decides again.

        If the caller is cancelled (the answer's deadline passed) its reservation does not stand: it is
        not created if still queued, and withdrawn if its group was already on its way.

        A booking one of this process's grants takes is made inside it, with a create alone; else, given
        `grant_room_mib` (the GPU's headroom once it is made), a grant may join its group
        (`vramshare.kube.ledger.grants`)."""
        grants = self.grants if not places and may_take(reservation) else None
        if grants is not None:
            grant = grants.usable(reservation.spec.gpu_uuid, reservation.spec.memory_mib)
            if grant is not None:
                return await self._commit_inside(reservation.inside(grant.key), grant)
        entry = self._enqueue(reservation, token=token, live=live, places=places)
        if grants is not None and live and grant_room_mib is not None:
            taken = grants.to_take(reservation, room_left_mib=grant_room_mib)
            if taken is not None:  # created beside the booking, committed by the same bump
                sent_at = self.clock()
                self._later(
                    grants.follow(taken, self._enqueue(taken, token=token, live=live).done, sent_at=sent_at)
                )
        queue = self._queues[reservation.spec.gpu_uuid]
        key = entry.key
        try:
            return await asyncio.shield(entry.done)
        except asyncio.CancelledError:
            if entry in queue:
                queue.remove(entry)
                self._later(self._abandon_once_made(entry))
            elif entry.done.done() and not entry.done.cancelled() and entry.done.exception() is None:
                if not places:  # a committed placement stands (see `place`)
                    self._later(self._abandon(entry.done.result(), key))
            else:
                entry.abandoned = True
            raise

    def relieve_grants(self, room_for_others: Callable[[str], int | None]) -> None:
        """Give back this process's grants that hold more than their GPU has left for others."""
        if self.grants is not None:
            self.grants.relieve(room_for_others)

    def grant_credit(self, mib: int) -> dict[str, int]:
        """GPU UUID -> what this process's grant there still holds, where it takes a pod of `mib`."""
        return self.grants.credit(mib) if self.grants is not None else {}

    def _enqueue(
        self, reservation: GpuReservation, *, token: str, live: bool, places: bool = False
    ) -> _Pending:
        """Put a decided reservation into the view (before any await), start its create, and queue it
        for its GPU's next bump."""
        gpu_uuid = reservation.spec.gpu_uuid
        key = _reservation_key(reservation.namespace, reservation.name)
        self.reservations.put(key, reservation.to_domain())  # reserved_at 0.0: decided, not created
        loop = asyncio.get_running_loop()
        entry = _Pending(
            reservation=reservation,
            key=key,
            token=token,
            live=live,
            done=loop.create_future(),
            made=loop.create_task(self._create(reservation, places=places)),
            places=places,
        )
        self._queues.setdefault(gpu_uuid, []).append(entry)
        if gpu_uuid not in self._committers:
            self._committers[gpu_uuid] = loop.create_task(self._drain(gpu_uuid))
        return entry

    async def _commit_inside(self, reservation: GpuReservation, grant: HeldGrant) -> GpuReservation:
        """A booking inside this process's grant: a create alone (`vramshare.domain.grants`). If its
        create comes back after the grant stopped being usable, the API server may have stored it after
        the controller ended the grant: it is withdrawn and the pod decides again."""
        assert self.grants is not None
        key = _reservation_key(reservation.namespace, reservation.name)
        self.reservations.put(key, reservation.to_domain())  # the grant's remainder gives up as much
        self.grants.used(grant)
        made = asyncio.get_running_loop().create_task(self._create(reservation, places=False))
        try:
            created = await asyncio.shield(made)
        except asyncio.CancelledError:
            self._later(self._withdraw_once_made(key, made))
            raise
        except BaseException:
            self.reservations.drop(key)
            raise
        if not self.grants.still_usable(grant):
            await self._abandon(created, key)
            raise CommitConflictError(f"grant {grant.key} lapsed while booking inside it")
        self.reservations.put(key, created.to_domain(), resource_version=created.meta.resource_version)
        self.on_inside_grant()
        return created

    async def _withdraw_once_made(self, key: str, made: asyncio.Task[GpuReservation]) -> None:
        self.reservations.drop(key)
        try:
            created = await asyncio.shield(made)
        except Exception:  # not made: nothing to withdraw
            return
        await self._withdraw(created)

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

    async def _abandon_once_made(self, entry: _Pending) -> None:
        """Withdraw a commit that will not be bumped (its caller gave up, or shutdown), once its create,
        already on its way, is answered: nobody will be told of it, so it may not stand."""
        self.reservations.drop(entry.key)
        if not entry.done.done():
            entry.done.cancel()
        try:
            created = await asyncio.shield(entry.made)
        except Exception:  # not made (its create failed): nothing to withdraw
            return
        await self._withdraw(created, unplace=entry.places)

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
                self._later(self._abandon_once_made(entry))
            queue.clear()

    async def _create(self, res: GpuReservation, *, places: bool) -> GpuReservation:
        if places:
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
        try:
            # Shielded: on shutdown the creates still finish, and what they made is withdrawn.
            results = await asyncio.shield(asyncio.gather(*(e.made for e in batch), return_exceptions=True))
        except asyncio.CancelledError:
            for entry in batch:
                self._later(self._abandon_once_made(entry))
            raise
        made: list[tuple[_Pending, GpuReservation]] = []
        for entry, result in zip(batch, results, strict=True):
            if isinstance(result, GpuReservation):
                made.append((entry, result))
            else:
                self._fail(entry, result)
        if not made:
            return
        newest = max((c for _, c in made), key=lambda c: int(c.meta.resource_version or 0))
        # Never less than this process named before on the GPU: an earlier group's create may have
        # finished after this one's.
        version = max(int(newest.meta.resource_version or 0), self._named.get(gpu_uuid, 0))
        mark = f"{newest.key}@{version}"
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
        self._named[gpu_uuid] = max(self._named.get(gpu_uuid, 0), last_commit_version(device))
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
                if current.status is not None and current.status.state in OUT_OF_SHARING:
                    # The controller took the GPU out of sharing meanwhile (a hold given back, a node
                    # no longer vramshare's): decide again, on the view that says so.
                    raise
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

    async def drain(self, *, timeout_s: float = 5.0) -> int:
        """On shutdown, after the last answer: give back this process's grants, and let the writes
        still running off the answers' path (the committed labels, withdrawals) finish, for at most
        `timeout_s`; returns how many did not."""
        if self.grants is not None:
            await self.grants.give_all_back()
        pending = set(self._background)
        if not pending:
            return 0
        _, left = await asyncio.wait(pending, timeout=timeout_s)
        for task in left:
            task.cancel()
        if left:
            log.warning("shutting down with writes unfinished", unfinished=len(left), timeout_s=timeout_s)
        return len(left)

    async def _label_committed(self, created: GpuReservation) -> None:
        await label_committed(self.kube, created, on_write=self.on_write)

    async def _withdraw(self, created: GpuReservation, *, unplace: bool = False) -> bool:
        return await withdraw_booking(self.kube, created, unplace=unplace, on_write=self.on_write)
