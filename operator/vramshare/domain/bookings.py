"""The active ledger summed per GPU, kept up to date one change at a time.

A decision needs, per GPU, the memory of its active reservations (`reserved`) and the part of it a
sample cannot show yet (`unseen`). Summing the whole ledger for every decision costs time in
proportion to it (about 10 ms for 10 000 reservations); this index keeps the sums as reservations
come and go, so a decision costs time in proportion to the GPUs and the few reservations whose pods
started recently. Reservations whose pod has not started are unseen in any sample; those whose pod
started count as unseen until `settle_s` after the start, and once a GPU's sample is past that they
are settled for good (samples only get newer) and leave the short list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vramshare.domain.grants import remainder
from vramshare.domain.headroom import headroom_mib
from vramshare.domain.models import Gpu, Reservation, ReservationPhase
from vramshare.domain.tenancy import Holding, Holdings, awaits_its_pod, creator_of, holding_of


@dataclass(slots=True)
class _GpuSums:
    reserved_mib: int = 0
    not_started_mib: int = 0
    recent: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Reservations whose pod started, not yet settled: key -> (start, MiB)."""
    newest_sample: float = float("-inf")


class LedgerIndex:
    """Active reservations by key, with per-GPU sums. Pure: no clock, no I/O."""

    def __init__(self) -> None:
        self._members: dict[str, Reservation] = {}
        self._sums: dict[str, _GpuSums] = {}
        self._pending: dict[str, int] = {}
        """Namespace -> bookings and queue entries made at admission whose pod is not seen yet
        (`awaits_its_pod`)."""
        self._holds: dict[str, dict[str, Reservation]] = {}
        """Held-for key -> the holds kept for it, by reservation key."""
        self._open: dict[str, Reservation] = {}
        """Every reservation not ended, queue entries without a GPU included (for tenancy)."""
        self._holdings: dict[str, Holdings] = {}
        """Namespace -> what it holds (see `vramshare.domain.tenancy`)."""
        self._user_pending: dict[str, int] = {}
        """User -> MiB of their bookings whose pod has not appeared."""
        self._pending_bookings: dict[str, Reservation] = {}
        """The bookings whose pod has not appeared (few: each ends within a second, or its TTL)."""
        self._granted: dict[tuple[str, str], int] = {}
        """(grant key, GPU UUID) -> MiB of the active grant (`vramshare.domain.grants`)."""
        self._inside: dict[tuple[str, str], int] = {}
        """(grant key, GPU UUID) -> MiB of the active bookings made inside that grant."""
        self._memo: dict[str, tuple[Gpu, float, int, bool, tuple[int, int, int]]] = {}
        """GPU UUID -> its figures as last computed, with what they were computed from (`figures_by`);
        dropped whenever a booking on the GPU comes or goes."""

    def __len__(self) -> int:
        return len(self._members)

    def put(self, key: str, reservation: Reservation | None) -> None:
        """Record `reservation` under `key` (None, or an ended one: it leaves the index)."""
        self._remove(key)
        if reservation is None or not reservation.phase.is_open:
            return
        self._open[key] = reservation
        self._account(reservation, sign=1)
        if not reservation.is_active:
            return
        self._members[key] = reservation
        self._memo.pop(reservation.gpu_uuid, None)
        sums = self._sums.setdefault(reservation.gpu_uuid, _GpuSums())
        if reservation.phase is ReservationPhase.GRANTED or reservation.grant:
            self._grant_change(reservation, sums, sign=1)
        if reservation.phase is ReservationPhase.GRANTED:
            return
        sums.reserved_mib += reservation.mib
        if reservation.pod_running_since is None:
            sums.not_started_mib += reservation.mib
        else:
            sums.recent[key] = (reservation.pod_running_since, reservation.mib)
        if reservation.held_for:
            self._holds.setdefault(reservation.held_for, {})[key] = reservation

    def _account(self, reservation: Reservation, *, sign: int) -> None:
        namespace = reservation.namespace
        if awaits_its_pod(reservation):
            waiting = self._pending.get(namespace, 0) + sign
            if waiting:
                self._pending[namespace] = waiting
            else:
                self._pending.pop(namespace, None)
        held = self._holdings.get(namespace, Holdings()).with_(reservation, sign=sign)
        if held == Holdings():
            self._holdings.pop(namespace, None)
        else:
            self._holdings[namespace] = held
        if holding_of(reservation) is Holding.PENDING:
            if sign > 0:
                self._pending_bookings[f"{namespace}/{reservation.name}"] = reservation
            else:
                self._pending_bookings.pop(f"{namespace}/{reservation.name}", None)
            creator = creator_of(reservation.user, namespace)
            left = self._user_pending.get(creator, 0) + sign * reservation.mib
            if left:
                self._user_pending[creator] = left
            else:
                self._user_pending.pop(creator, None)

    def _remove(self, key: str) -> None:
        opened = self._open.pop(key, None)
        if opened is None:
            return
        self._account(opened, sign=-1)
        old = self._members.pop(key, None)
        if old is None:
            return
        self._memo.pop(old.gpu_uuid, None)
        sums = self._sums[old.gpu_uuid]
        if old.phase is ReservationPhase.GRANTED or old.grant:
            self._grant_change(old, sums, sign=-1)
        if old.phase is ReservationPhase.GRANTED:
            return
        sums.reserved_mib -= old.mib
        if old.pod_running_since is None:
            sums.not_started_mib -= old.mib
        else:
            sums.recent.pop(key, None)
        if old.held_for:
            holds = self._holds[old.held_for]
            del holds[key]
            if not holds:
                del self._holds[old.held_for]

    def _grant_change(self, reservation: Reservation, sums: _GpuSums, *, sign: int) -> None:
        """A grant, or a booking inside one, came (+1) or went (-1): the grant's remainder, which
        counts as booked and not started (`vramshare.domain.grants`), moves by what changed."""
        granting = reservation.phase is ReservationPhase.GRANTED
        at = (reservation.key if granting else reservation.grant, reservation.gpu_uuid)
        before = self._remainder(at)
        table = self._granted if granting else self._inside
        left = table.get(at, 0) + sign * reservation.mib
        if left:
            table[at] = left
        else:
            table.pop(at, None)
        change = self._remainder(at) - before
        sums.reserved_mib += change
        sums.not_started_mib += change

    def _remainder(self, at: tuple[str, str]) -> int:
        granted = self._granted.get(at)
        return 0 if granted is None else remainder(grant_mib=granted, inside_mib=self._inside.get(at, 0))

    def grant_remainder(self, key: str, gpu_uuid: str) -> int | None:
        """What the grant `key` on that GPU still holds; None when no such grant is active."""
        at = (key, gpu_uuid)
        return self._remainder(at) if at in self._granted else None

    def booked(self, gpu: Gpu, *, settle_s: float) -> tuple[int, int]:
        """(reserved, unseen) MiB on `gpu` for its current sample."""
        return self._booked(gpu, settle_s)

    def figures_by(
        self, *, settle_s: float, safety_margin_mib: int
    ) -> Callable[[Gpu, bool], tuple[int, int, int]]:
        """(reserved, unseen, headroom) MiB of a GPU at its sample, judged on the ledger alone when
        asked (see `vramshare.domain.headroom`). A decision asks this of every GPU, and between two
        decisions few GPUs change, so each GPU's figures are remembered until its bookings change or
        it is handed in as another object (a new sample)."""

        def figures(gpu: Gpu, ledger_only: bool) -> tuple[int, int, int]:
            memo = self._memo.get(gpu.uuid)
            if (
                memo is not None
                and memo[0] is gpu
                and memo[1] == settle_s
                and memo[2] == safety_margin_mib
                and memo[3] is ledger_only
            ):
                return memo[4]
            reserved, unseen = self._booked(gpu, settle_s)
            room = headroom_mib(
                gpu,
                reserved_mib=reserved,
                unseen_mib=unseen,
                safety_margin_mib=safety_margin_mib,
                ledger_only=ledger_only,
            )
            self._memo[gpu.uuid] = (gpu, settle_s, safety_margin_mib, ledger_only, (reserved, unseen, room))
            return reserved, unseen, room

        return figures

    def _booked(self, gpu: Gpu, settle_s: float) -> tuple[int, int]:
        sums = self._sums.get(gpu.uuid)
        if sums is None:
            return 0, 0
        if not sums.recent:  # the usual case: every started pod settled long ago
            if gpu.sampled_at > sums.newest_sample:
                sums.newest_sample = gpu.sampled_at
            return sums.reserved_mib, sums.not_started_mib
        unseen = sums.not_started_mib
        settled = []
        for key, (started, mib) in sums.recent.items():
            if started + settle_s > gpu.sampled_at:
                unseen += mib
            else:
                settled.append(key)
        if gpu.sampled_at >= sums.newest_sample:  # an older sample must not settle anything for good
            sums.newest_sample = gpu.sampled_at
            for key in settled:
                del sums.recent[key]
        return sums.reserved_mib, unseen

    def pending_in(self, namespace: str) -> int:
        """How many bookings and queue entries in `namespace` wait for their pod (`awaits_its_pod`)."""
        return self._pending.get(namespace, 0)

    def holdings(self, namespace: str) -> Holdings:
        """What `namespace` holds: bound, pending, held and queued MiB."""
        return self._holdings.get(namespace, Holdings())

    def pending_bookings(self) -> list[Reservation]:
        """Every booking whose pod has not appeared (to the controller) yet."""
        return list(self._pending_bookings.values())

    def pending_of_user(self, creator: str) -> int:
        """MiB of `creator`'s bookings (see `tenancy.creator_of`) whose pod has not appeared."""
        return self._user_pending.get(creator, 0)

    def get(self, key: str) -> Reservation | None:
        return self._members.get(key)

    def holds_for(self, held_for: str) -> list[Reservation]:
        """The holds kept for the task with that key."""
        return list(self._holds.get(held_for, {}).values())

    def held_gpus(self) -> set[str]:
        """GPUs that hold memory for some task."""
        return {r.gpu_uuid for holds in self._holds.values() for r in holds.values()}

    def reservations(self) -> list[Reservation]:
        return list(self._members.values())
