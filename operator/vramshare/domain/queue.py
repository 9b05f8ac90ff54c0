"""Queue mode: which waiting pods to place now, in fair order, with backfill and a bounded hold.

A pod that does not fit when it is created can wait (behind a scheduling gate) instead of being
refused. `plan_queue()` is the whole policy, given the queue, the inventory and the ledger as values:

- **Fair share across namespaces, oldest first within one.** The next pod considered is the oldest of
  the namespace whose GPU memory held (bound, pending and held bookings, and what this pass placed for
  it) with that pod added, divided by its weight, is the smallest; ties go to the oldest pod. Weights
  come from a namespace label (equal by default), so a namespace of weight 3 is placed three times the
  memory of one of weight 1 while both wait. Each pod is placed by the same `choose()` the webhook uses,
  and the memory it books counts for the ones after it. A namespace may use memory others leave idle
  (borrowing); vramshare never preempts, so what it borrowed comes back as its pods finish, and until
  then the namespaces that return are placed first.
- **Backfill.** A pod that does not fit does not stop younger, smaller pods from using memory it could
  not use anyway...
- **...except on one GPU: the hold.** The first pod in that order that does not fit (the *head*) holds
  one GPU that is big enough for it, the one closest to fitting it. Nothing else is placed there, so the
  memory that frees up on it accumulates for the head instead of going to a stream of small pods, and a
  large request cannot starve. A hold lasts at most `hold_limit_s`; then the head moves its hold to the
  next closest GPU (the memory on the first may be taken by something vramshare does not book), so no
  GPU is held forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


MAX_WEIGHT = 1000.0


def parse_weight(value: str | None) -> float | None:
    """A namespace's weight from its label: a number above 0 and at most 1000 (None: not one)."""
    if value is None:
        return None
    try:
        weight = float(value)
    except ValueError:
        return None
    return weight if 0 < weight <= MAX_WEIGHT else None


def queue_order(waiting: Iterable[Waiting]) -> list[Waiting]:
    return sorted(waiting, key=lambda w: (w.queued_at, w.key))


class FairOrder:
    """Waiting pods in fair order (see the module's docstring): `next()` the pod to consider now,
    `placed()` when it was placed, which raises its namespace's share."""

    def __init__(
        self, waiting: Iterable[Waiting], *, held: Mapping[str, int], weights: Mapping[str, float]
    ) -> None:
        self._queues: dict[str, deque[Waiting]] = {}
        for w in queue_order(waiting):
            self._queues.setdefault(w.namespace, deque()).append(w)
        self._weights = weights
        self._share = {ns: held.get(ns, 0) / self.weight(ns) for ns in self._queues}

    def weight(self, namespace: str) -> float:
        return self._weights.get(namespace, 1.0)

    def next(self) -> Waiting | None:
        queues = [(ns, q) for ns, q in self._queues.items() if q]
        if not queues:
            return None
        # By the share each namespace would have once its next pod is placed (as weighted fair queueing
        # orders by finish time): with current shares alone, ties (5 of weight 1 against 15 of weight 3)
        # would go to the older pod, which is the lighter namespace's, every time.
        _, q = min(
            queues,
            key=lambda t: (
                self._share[t[0]] + t[1][0].mib / self.weight(t[0]),
                t[1][0].queued_at,
                t[1][0].key,
            ),
        )
        return q.popleft()

    def placed(self, w: Waiting) -> None:
        self._share[w.namespace] += w.mib / self.weight(w.namespace)

    def __iter__(self) -> Iterator[Waiting]:
        while (w := self.next()) is not None:
            yield w


def plan_queue(
    waiting: Iterable[Waiting],
    gpus: Sequence[Gpu],
    reservations: Iterable[Reservation],
    *,
    settings: AllocationSettings,
    queue: QueueSettings,
    hold: Hold | None,
    now: float,
    held_mib: Mapping[str, int] | None = None,
    weights: Mapping[str, float] | None = None,
) -> QueuePlan:
    """Place what fits now in fair order, keeping the head's held GPU for the head alone. `held_mib` is
    each namespace's GPU memory held now, `weights` its weight (1 where absent)."""
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
    order = FairOrder(waiting, held=held_mib or {}, weights=weights or {})
    for w in order:
        held = new_hold.gpu_uuid if new_hold is not None else None
        request = AllocationRequest(mib=w.mib, namespace=w.namespace, pod=w.pod, nodes=w.nodes, model=w.model)
        decision = None
        if max((r for u, r in rooms.items() if u != held), default=-1) >= w.mib:
            candidates = [g for g in gpus if g.uuid != held]
            decision = choose(request, candidates, (), settings=settings, now=now, index=index)
            if isinstance(decision, Choice):
                placements.append((w, decision))
                order.placed(w)
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
