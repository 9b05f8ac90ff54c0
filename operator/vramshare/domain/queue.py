"""Queue mode: which waiting pods to place now, oldest first, with backfill and a bounded hold.

A pod that does not fit when it is created can wait (behind a scheduling gate) instead of being
refused. `plan_queue()` is the whole policy, given the queue, the inventory and the ledger as values:

- **Oldest first.** Waiting pods are taken in the order they were queued; each is placed by the same
  `choose()` the webhook uses, and the memory it books counts for the ones after it.
- **Backfill.** A pod that does not fit does not stop younger, smaller pods from using memory it could
  not use anyway...
- **...except on one GPU: the hold.** The oldest pod that does not fit (the *head*) holds one GPU that
  is big enough for it, the one closest to fitting it. Nothing else is placed there, so the memory
  that frees up on it accumulates for the head instead of going to a stream of small pods, and a
  large request cannot starve. A hold lasts at most `hold_limit_s`; then the head moves its hold to
  the next closest GPU (the memory on the first may be taken by something vramshare does not
  book), so no GPU is held forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vramshare.domain.allocation import AllocationSettings, Choice, GpuVerdict, choose
from vramshare.domain.bookings import LedgerIndex
from vramshare.domain.fairness import closest_to_fitting, could_ever_fit
from vramshare.domain.models import AllocationRequest, Gpu, Reservation, ReservationPhase, model_matches


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """A queued pod's request."""

    key: str
    """The queue entry (namespace/name of its GpuReservation)."""
    namespace: str
    pod: str
    mib: int
    queued_at: float
    nodes: frozenset[str] | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """The GPU whose freed memory is kept for the head of the queue."""

    key: str
    """The waiting entry it is kept for."""
    gpu_uuid: str
    since: float


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueSettings:
    hold_limit_s: float = 900.0
    """How long one GPU's freed memory may be kept for the head before the hold moves on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuePlan:
    placements: tuple[tuple[Waiting, Choice], ...]
    """Whom to place now and where, in queue order."""
    hold: Hold | None
    positions: dict[str, int] = field(default_factory=dict)
    """Key -> 1-based position of each entry still waiting."""


def queue_order(waiting: Iterable[Waiting]) -> list[Waiting]:
    return sorted(waiting, key=lambda w: (w.queued_at, w.key))


def plan_queue(
    waiting: Iterable[Waiting],
    gpus: Sequence[Gpu],
    reservations: Iterable[Reservation],
    *,
    settings: AllocationSettings,
    queue: QueueSettings,
    hold: Hold | None,
    now: float,
) -> QueuePlan:
    """Place what fits now, oldest first, keeping the head's held GPU for the head alone."""
    index = LedgerIndex()
    for r in reservations:
        index.put(f"{r.namespace}/{r.name}", r)
    # Each GPU's headroom, kept up to date as the plan books: a request larger than every one of them
    # is passed over without judging each GPU again (a long queue costs little per pass).
    probe = choose(
        AllocationRequest(mib=0, namespace="", pod=""), gpus, (), settings=settings, now=now, index=index
    )
    rooms = {v.gpu.uuid: v.headroom.headroom_mib for v in probe.verdicts if v.fits and v.headroom}
    placements: list[tuple[Waiting, Choice]] = []
    left: list[Waiting] = []
    new_hold: Hold | None = None
    for w in queue_order(waiting):
        held = new_hold.gpu_uuid if new_hold is not None else None
        request = AllocationRequest(mib=w.mib, namespace=w.namespace, pod=w.pod, nodes=w.nodes, model=w.model)
        decision = None
        if max((r for u, r in rooms.items() if u != held), default=-1) >= w.mib:
            candidates = [g for g in gpus if g.uuid != held]
            decision = choose(request, candidates, (), settings=settings, now=now, index=index)
            if isinstance(decision, Choice):
                placements.append((w, decision))
                gpu = decision.gpu
                rooms[gpu.uuid] -= w.mib
                index.put(
                    f"{w.key}@queue",
                    Reservation(
                        name=w.key,
                        namespace=w.namespace,
                        pod=w.pod,
                        mib=w.mib,
                        node=gpu.node,
                        gpu_uuid=gpu.uuid,
                        gpu_index=gpu.index,
                        phase=ReservationPhase.RESERVED,
                        reserved_at=now,
                    ),
                )
                continue
        left.append(w)
        if new_hold is None and any(
            could_ever_fit(w.mib, g, settings=settings) and model_matches(w.model, g.model) for g in gpus
        ):
            # No hold yet, so `decision` (if any) judged every GPU: its verdicts serve the hold.
            if decision is None:
                decision = choose(request, gpus, (), settings=settings, now=now, index=index)
            new_hold = _hold_for(w, decision.verdicts, hold=hold, settings=settings, queue=queue, now=now)
    return QueuePlan(
        placements=tuple(placements),
        hold=new_hold,
        positions={w.key: i for i, w in enumerate(left, start=1)},
    )


def _hold_for(
    head: Waiting,
    verdicts: Iterable[GpuVerdict],
    *,
    hold: Hold | None,
    settings: AllocationSettings,
    queue: QueueSettings,
    now: float,
) -> Hold | None:
    """The head's hold: the one it has while it lasts, else the GPU closest to fitting it (another
    one than the GPU whose hold has lapsed, if there is one)."""
    verdicts = list(verdicts)
    closest = closest_to_fitting(head.mib, verdicts, settings=settings, nodes=head.nodes)
    if hold is not None and hold.key == head.key:
        if now - hold.since < queue.hold_limit_s:
            still = [v for v in verdicts if v.gpu.uuid == hold.gpu_uuid]
            if closest_to_fitting(head.mib, still, settings=settings, nodes=head.nodes) is not None:
                return hold
        else:
            # It had its time: let the next closest GPU collect for the head.
            other = closest_to_fitting(
                head.mib, verdicts, settings=settings, nodes=head.nodes, exclude=(hold.gpu_uuid,)
            )
            closest = other or closest
    return Hold(key=head.key, gpu_uuid=closest.uuid, since=now) if closest is not None else None
