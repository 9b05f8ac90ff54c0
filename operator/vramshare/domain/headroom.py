"""How much memory a GPU can still promise to a new pod.

    headroom = min(free_live - R_unseen, total - R_all) - safety_margin

- `R_all`: memory of every active reservation on the GPU (of a grant, what its bookings do not use
  yet: `vramshare.domain.grants`).
- `R_unseen`: the part of `R_all` whose usage cannot show in the sample yet, because its pod had not
  been running for at least `settle_s` seconds when DCGM took the sample (not started, or still
  loading its model). A pod that has settled is already counted in `used`, so subtracting it again from
  `free` (Kaapana's "free minus reserved") would double-count it.
- `total - R_all` caps the promise by the ledger alone, so a pod that uses less than it asked never
  lets the GPU be promised beyond its size, and a sample older than a reservation is never trusted.
  `total` here is what applications can have, `FB_FREE + FB_USED`: the driver's own `FB_RESERVED`
  is part of the card but never available to pods.

A GPU whose sample is too old to trust can, by setting, be judged by the ledger alone:
`headroom = total - R_all - safety_margin`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vramshare.domain.grants import remainder
from vramshare.domain.models import Gpu, Reservation, ReservationPhase


@dataclass(frozen=True, slots=True, kw_only=True)
class Headroom:
    """A GPU's headroom with the terms it came from, for status fields and messages."""

    gpu_uuid: str
    total_mib: int
    free_mib: int
    reserved_mib: int
    """R_all: every active reservation on the GPU."""
    unseen_mib: int
    """R_unseen: reservations whose usage the sample cannot show yet."""
    safety_margin_mib: int
    headroom_mib: int
    ledger_only: bool = False
    """True when the live sample was ignored (stale) and only the ledger counted."""


def is_unseen(reservation: Reservation, *, sampled_at: float, settle_s: float) -> bool:
    """True when the reservation's usage cannot be in a sample taken at `sampled_at`."""
    started = reservation.pod_running_since
    return started is None or started + settle_s > sampled_at


def booked(gpu: Gpu, reservations: Iterable[Reservation], *, settle_s: float) -> tuple[int, int]:
    """(reserved, unseen) MiB of the active reservations on `gpu` among `reservations`. A grant counts
    its remainder, as a booking whose pod has not started (`vramshare.domain.grants`)."""
    reserved = 0
    unseen = 0
    grants: dict[str, int] = {}
    inside: dict[str, int] = {}
    for r in reservations:
        if r.gpu_uuid != gpu.uuid or not r.is_active:
            continue
        if r.phase is ReservationPhase.GRANTED:
            grants[r.key] = grants.get(r.key, 0) + r.mib
            continue
        if r.grant:
            inside[r.grant] = inside.get(r.grant, 0) + r.mib
        reserved += r.mib
        if is_unseen(r, sampled_at=gpu.sampled_at, settle_s=settle_s):
            unseen += r.mib
    for key, mib in grants.items():
        left = remainder(grant_mib=mib, inside_mib=inside.get(key, 0))
        reserved += left
        unseen += left
    return reserved, unseen


def headroom(
    gpu: Gpu,
    reservations: Iterable[Reservation],
    *,
    settle_s: float,
    safety_margin_mib: int,
    ledger_only: bool = False,
) -> Headroom:
    """The headroom of `gpu`, counting only the active reservations on it among `reservations`."""
    reserved, unseen = booked(gpu, reservations, settle_s=settle_s)
    return headroom_of(
        gpu,
        reserved_mib=reserved,
        unseen_mib=unseen,
        safety_margin_mib=safety_margin_mib,
        ledger_only=ledger_only,
    )


def booked_past_capacity(gpu: Gpu, reservations: Iterable[Reservation], *, safety_margin_mib: int) -> int:
    """How many MiB the active bookings on `gpu` go past what it can ever hold (0 when within)."""
    reserved = sum(r.mib for r in reservations if r.is_active and r.gpu_uuid == gpu.uuid)
    room = headroom_of(
        gpu, reserved_mib=reserved, unseen_mib=0, safety_margin_mib=safety_margin_mib, ledger_only=True
    )
    return max(0, -room.headroom_mib)


def headroom_mib(
    gpu: Gpu, *, reserved_mib: int, unseen_mib: int, safety_margin_mib: int, ledger_only: bool = False
) -> int:
    """The headroom of `gpu` given what its active reservations add up to, as a number alone."""
    # What applications can ever have: the driver's own FB_RESERVED is never theirs. That is total
    # less driver_reserved_mib, written out: this runs for every GPU on every decision.
    by_ledger = min(gpu.total_mib, gpu.used_mib + gpu.free_mib) - reserved_mib
    room = by_ledger if ledger_only else min(gpu.free_mib - unseen_mib, by_ledger)
    return room - safety_margin_mib


def headroom_of(
    gpu: Gpu, *, reserved_mib: int, unseen_mib: int, safety_margin_mib: int, ledger_only: bool = False
) -> Headroom:
    """The headroom of `gpu` given what its active reservations add up to, with the terms it came from."""
    return Headroom(
        gpu_uuid=gpu.uuid,
        total_mib=gpu.total_mib,
        free_mib=gpu.free_mib,
        reserved_mib=reserved_mib,
        unseen_mib=unseen_mib,
        safety_margin_mib=safety_margin_mib,
        headroom_mib=headroom_mib(
            gpu,
            reserved_mib=reserved_mib,
            unseen_mib=unseen_mib,
            safety_margin_mib=safety_margin_mib,
            ledger_only=ledger_only,
        ),
        ledger_only=ledger_only,
    )
