"""This replica's grants on the wire (`vramshare.domain.grants`): which it holds, booking inside one
with a create alone, renewing them, and giving them back.

A grant is taken with a pod's commit (`CommitProtocol.commit`, `grant_room_mib`): it is one more
reservation in the same group, so the one bump that commits the pod commits the grant. It is usable
once that bump succeeded and this replica's view shows the controller recorded it Granted, until
`usable_for_s` after the last renewal that succeeded was sent, and no longer once the view shows it
ended. Each is renewed every `renew_every_s`, given back after `idle_s` with no booking made inside it,
and every one is given back at shutdown. A grant that lapses here (renewals failing) stays in the ledger
until its holder deletes it or the controller ends it; here it only stops taking bookings.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from vramshare.domain import LedgerIndex, ReservationPhase
from vramshare.domain.grants import GrantTerms, grant_size, relieves, takes
from vramshare.kube.client import ApiError, KubeClient
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import ANNOTATION_GRANT_RENEWED, reservations_path

log = structlog.get_logger("vramshare.grants")

RELEASE_TIMEOUT_S = 3.0
PAUSE_S = 300.0
"""How long no grant is taken after one went unrecorded by the controller."""


def holder_hash(identity: str) -> str:
    """A label value for a replica's name (pod names may be longer than a label value may be)."""
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def may_take(reservation: GpuReservation) -> bool:
    """A pod's own booking on one GPU, which a grant may take (not a hold, a queue entry, a set)."""
    return not reservation.held_for and reservation.spec.gpu_count == 1 and not reservation.queue_entry


@dataclass(kw_only=True, eq=False)
class HeldGrant:
    reservation: GpuReservation
    """As created (or last renewed)."""
    usable_until: float
    """By this process's clock; 0 until its commit held."""
    last_used: float
    renewals: int = 0

    @property
    def key(self) -> str:
        return self.reservation.key

    @property
    def gpu_uuid(self) -> str:
        return self.reservation.spec.gpu_uuid

    @property
    def mib(self) -> int:
        return self.reservation.spec.memory_mib


class Grants:
    """The grants this process holds; see the module docstring."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        terms: GrantTerms,
        namespace: str,
        holder: str,
        index: Callable[[], LedgerIndex],
        clock: Callable[[], float] = time.monotonic,
        on_write: Callable[[str, str], None] = lambda resource, verb: None,
    ) -> None:
        self.kube = kube
        self.terms = terms
        self.namespace = namespace
        self.holder = holder
        self.holder_hash = holder_hash(holder)
        self._index = index
        self.clock = clock
        self.on_write = on_write
        self._held: dict[str, list[HeldGrant]] = {}
        """GPU UUID -> this process's grants on it, committed or on their way."""
        self._keeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.taken = 0
        self.given_back = 0
        self.closed = False
        """Shutting down: no grant is taken, and one whose commit lands now is given back at once."""
        self.paused_until = 0.0
        """No grant is taken before then: one went unrecorded by the controller (an older controller,
        or CRDs without the phase Granted), so grants would only cost a create each."""

    # -- deciding -------------------------------------------------------------------------------

    def usable(self, gpu_uuid: str, mib: int) -> HeldGrant | None:
        """This process's grant on that GPU that takes a pod of `mib` now, if any."""
        now = self.clock()
        index = self._index()
        for grant in self._held.get(gpu_uuid, ()):
            seen = index.get(grant.key)
            left = index.grant_remainder(grant.key, gpu_uuid)
            if grant.usable_until <= now or left is None or seen is None or not seen.acknowledged:
                continue  # lapsed here, ended (as this view shows it), or not recorded by the controller
            if takes(grant_mib=grant.mib, inside_mib=grant.mib - left, pod_mib=mib):
                return grant
        return None

    def credit(self, mib: int) -> dict[str, int]:
        """GPU UUID -> the remainder of this process's grant there that takes a pod of `mib`: memory a
        decision for such a pod may count as its own (`vramshare.domain.choose`'s credit)."""
        out: dict[str, int] = {}
        index = self._index()
        for gpu_uuid in self._held:
            grant = self.usable(gpu_uuid, mib)
            if grant is not None:
                out[gpu_uuid] = index.grant_remainder(grant.key, gpu_uuid) or 0
        return out

    def to_take(self, booking: GpuReservation, *, room_left_mib: int) -> GpuReservation | None:
        """A new grant to commit with `booking`, on its GPU, or None (none worth taking). `room_left_mib`:
        the GPU's headroom once the booking is made."""
        if self.closed or self.clock() < self.paused_until:
            return None
        index = self._index()
        for held in self._held.get(booking.spec.gpu_uuid, ()):
            seen = index.get(held.key)
            if held.usable_until <= 0 or seen is None or not seen.acknowledged:
                # One is on its way (its commit, or the controller's record of it): a burst of pods
                # decided meanwhile must not take a grant each.
                return None
        size = grant_size(terms=self.terms, pod_mib=booking.spec.memory_mib, room_left_mib=room_left_mib)
        if size <= 0:
            return None
        spec = booking.spec
        reservation = GpuReservation.granted(
            name=f"vramshare-grant-{secrets.token_hex(6)}",
            namespace=self.namespace,
            mib=size,
            gpu_uuid=spec.gpu_uuid,
            node=spec.node_name,
            gpu_index=spec.gpu_index,
            holder=self.holder,
            holder_hash=self.holder_hash,
            lasts_s=self.terms.lasts_s,
        )
        self._held.setdefault(spec.gpu_uuid, []).append(
            HeldGrant(reservation=reservation, usable_until=0.0, last_used=self.clock())
        )
        return reservation

    def used(self, grant: HeldGrant) -> None:
        grant.last_used = self.clock()

    def committed(self, created: GpuReservation, *, sent_at: float) -> None:
        """The grant's commit held: usable from now, until `usable_for_s` after its create was sent."""
        for grant in self._held.get(created.spec.gpu_uuid, ()):
            if grant.key == created.key:
                grant.reservation = created
                if self.closed:
                    self._spawn(self.give_back(grant))
                    return
                grant.usable_until = sent_at + self.terms.usable_for_s
                self.taken += 1
                log.info(
                    "grant taken", grant=created.key, gpu=created.spec.gpu_uuid, mib=created.spec.memory_mib
                )
                self._start_keeping()
                return

    async def follow(
        self, taken: GpuReservation, done: asyncio.Future[GpuReservation], *, sent_at: float
    ) -> None:
        """Wait for the commit of the grant `taken` (`done`): usable once it held, forgotten if it did
        not (its group lost its race, or shutdown: the pod it came with decides again anyway)."""
        try:
            created = await asyncio.shield(done)
        except BaseException:
            self._forget(taken.key, taken.spec.gpu_uuid)
            return
        self.committed(created, sent_at=sent_at)

    def still_usable(self, grant: HeldGrant) -> bool:
        """Checked once a booking's create inside `grant` came back: past this, the API server may
        have stored it after the controller ended the grant."""
        return self.clock() < grant.usable_until

    def _forget(self, key: str, gpu_uuid: str) -> HeldGrant | None:
        held = self._held.get(gpu_uuid, [])
        for grant in held:
            if grant.key == key:
                held.remove(grant)
                if not held:
                    self._held.pop(gpu_uuid, None)
                return grant
        return None

    def held(self) -> list[HeldGrant]:
        return [g for grants in self._held.values() for g in grants]

    def relieve(self, room_for_others: Callable[[str], int | None]) -> list[HeldGrant]:
        """Give back each committed grant that holds more than its GPU has left for everyone else
        (`room_for_others`: the GPU's headroom as any replica computes it, this grant's remainder
        counted as booked): as a GPU fills, grants give their room back rather than hold it while
        other replicas refuse pods. Returns the grants given back (their deletes run on their own)."""
        index = self._index()
        relieved = []
        for grant in self.held():
            left = index.grant_remainder(grant.key, grant.gpu_uuid)
            room = room_for_others(grant.gpu_uuid)
            if (
                grant.usable_until > 0
                and left
                and room is not None
                and relieves(remainder_mib=left, room_for_others_mib=room)
            ):
                grant.usable_until = 0.0
                relieved.append(grant)
                self._spawn(self.give_back(grant))
        return relieved

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- keeping ---------------------------------------------------------------------------------

    def _start_keeping(self) -> None:
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        """Renew each committed grant every `renew_every_s`; give back those idle for `idle_s`."""
        while self._held:
            await asyncio.sleep(min(self.terms.renew_every_s, self.terms.idle_s) / 2)
            await self.keep_once()

    async def keep_once(self) -> None:
        """One round of `_keep`: each grant given back, renewed, or left as it is."""
        now = self.clock()
        for grant in self.held():
            if grant.usable_until <= 0:
                continue  # its commit is on its way
            try:
                if now - grant.last_used >= self.terms.idle_s:
                    await self.give_back(grant)
                elif now - (grant.usable_until - self.terms.usable_for_s) >= self.terms.renew_every_s:
                    if not self._recorded(grant):
                        await self._pause(grant)
                        continue
                    await self._renew(grant)
            except Exception as exc:  # it lapses here, and the next round tries again
                log.warning("grant not kept", grant=grant.key, error=repr(exc))

    def _recorded(self, grant: HeldGrant) -> bool:
        seen = self._index().get(grant.key)
        return seen is None or seen.acknowledged  # gone from the view: the renewal will tell

    async def _pause(self, grant: HeldGrant) -> None:
        """A grant the controller has not recorded by its first renewal never will be: give it back
        and take none for a while."""
        self.paused_until = self.clock() + PAUSE_S
        log.warning(
            "the controller did not record a grant: grants are off for a while (an older controller, "
            "or CRDs without the phase Granted: upgrade both)",
            grant=grant.key,
            paused_s=PAUSE_S,
        )
        await self.give_back(grant)

    async def _renew(self, grant: HeldGrant) -> None:
        sent = self.clock()
        grant.renewals += 1
        path = reservations_path(grant.reservation.namespace, grant.reservation.name)
        try:
            self.on_write("gpureservations", "patch")
            obj = await self.kube.merge_patch(
                path, {"metadata": {"annotations": {ANNOTATION_GRANT_RENEWED: str(grant.renewals)}}}
            )
        except ApiError as exc:
            if exc.not_found:
                self._forget(grant.key, grant.gpu_uuid)
                log.warning("grant gone", grant=grant.key)
            else:
                log.warning("grant not renewed", grant=grant.key, error=str(exc))
            return
        except (OSError, TimeoutError) as exc:
            log.warning("grant not renewed", grant=grant.key, error=repr(exc))
            return
        renewed = GpuReservation.from_wire(obj)
        if renewed.phase is not ReservationPhase.GRANTED or renewed.meta.deleting:
            # The controller ended it (it saw no renewal for too long): it takes no more bookings.
            self._forget(grant.key, grant.gpu_uuid)
            log.warning("grant ended by the controller", grant=grant.key, phase=renewed.phase.value)
            return
        grant.reservation = renewed
        grant.usable_until = sent + self.terms.usable_for_s

    async def give_back(self, grant: HeldGrant) -> None:
        """Stop booking inside `grant` and delete it. Its bookings then count on their own, and every
        reader that sees it gone has seen them: no bump is needed (`vramshare.domain.grants`). A
        booking inside it still on its way is withdrawn when its create comes back (`still_usable`)."""
        grant.usable_until = 0.0
        self._forget(grant.key, grant.gpu_uuid)
        path = reservations_path(grant.reservation.namespace, grant.reservation.name)
        try:
            self.on_write("gpureservations", "delete")
            await asyncio.wait_for(self.kube.delete(path), RELEASE_TIMEOUT_S)
            self.given_back += 1
            log.info("grant given back", grant=grant.key)
        except ApiError as exc:
            if not exc.not_found:
                log.warning("grant not given back; it lapses", grant=grant.key, error=str(exc))
        except (OSError, TimeoutError) as exc:
            log.warning("grant not given back; it lapses", grant=grant.key, error=repr(exc))

    async def give_all_back(self) -> None:
        """At shutdown: every grant stops taking bookings at once, and is deleted."""
        self.closed = True
        if self._keeper is not None:
            self._keeper.cancel()
        held = self.held()
        for grant in held:
            grant.usable_until = 0.0
        await asyncio.gather(*(self.give_back(g) for g in held if g.reservation.meta.uid), *self._tasks)
