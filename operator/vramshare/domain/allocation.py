"""Choosing a GPU for a request: a choice, or a refusal that explains every GPU.

`choose()` is the whole decision. It sees the inventory and the ledger as values and a `now` handed in
by the caller; the webhook commits the result atomically afterwards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from vramshare.domain.accounting import Accounting, StaleGpuMode
from vramshare.domain.bookings import LedgerIndex
from vramshare.domain.headroom import Headroom, booked, headroom_of
from vramshare.domain.models import AllocationRequest, Gpu, Reservation, model_matches


class Policy(StrEnum):
    """Which fitting GPU to take."""

    SPREAD = "spread"
    """The most headroom (least loaded): pods interfere less; Kaapana's choice."""
    BINPACK = "binpack"
    """The least headroom that still fits (best fit): keeps large holes free for large pods."""


class Exclusion(StrEnum):
    """Why a GPU was not chosen."""

    TOO_SMALL = "too-small"
    STALE = "stale-metrics"
    MISSING = "missing"
    UNHEALTHY = "unhealthy"
    MIG_ENABLED = "mig-enabled"
    OTHER_NODE = "other-node"
    OTHER_MODEL = "other-model"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationSettings:
    """How `choose()` judges GPUs: the webhook's policy over the accounting both components share."""

    policy: Policy = Policy.SPREAD
    accounting: Accounting = field(default_factory=Accounting)
    near_tie_mib: int = 0
    """GPUs whose headroom is within this of the policy's best count as tied; ties go to the one the
    deciding replica prefers (see `choose`), so replicas deciding at once rarely pick the same GPU."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuVerdict:
    """How one GPU fared for one request."""

    gpu: Gpu
    headroom: Headroom | None
    """None when the GPU was excluded before its headroom mattered (missing, other node, ...)."""
    excluded: Exclusion | None
    sample_age_s: float
    detail: str = ""
    """For a GPU on a node the pod cannot go to: why (cordoned, a taint, its node affinity, ...)."""

    @property
    def fits(self) -> bool:
        return self.excluded is None

    @property
    def room_mib(self) -> int:
        """Its headroom, 0 where it was excluded before that mattered."""
        return self.headroom.headroom_mib if self.headroom is not None else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    request: AllocationRequest
    gpu: Gpu
    headroom: Headroom
    """The chosen GPU's headroom before this request."""
    verdicts: tuple[GpuVerdict, ...]
    more: tuple[tuple[Gpu, Headroom], ...] = ()
    """For a request of several GPUs: the others, on the same node, in the order the pod sees them."""

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return (self.gpu, *(g for g, _ in self.more))


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    request: AllocationRequest
    verdicts: tuple[GpuVerdict, ...]
    """One per GPU in the inventory, in a stable order."""

    @property
    def closest_node(self) -> tuple[str, list[GpuVerdict]] | None:
        """For a request of several GPUs: the node with the most GPUs that have room (then the most
        headroom among them), with those GPUs; None when no GPU anywhere has room."""
        by_node: dict[str, list[GpuVerdict]] = {}
        for v in self.verdicts:
            if v.fits:
                by_node.setdefault(v.gpu.node, []).append(v)
        if not by_node:
            return None
        node = min(
            by_node,
            key=lambda n: (-len(by_node[n]), -sum(v.room_mib for v in by_node[n]), n),
        )
        return node, by_node[node]

    @property
    def best_headroom_mib(self) -> int | None:
        """The largest headroom among GPUs that could have taken a smaller request."""
        rooms = [
            v.headroom.headroom_mib
            for v in self.verdicts
            if v.headroom is not None and v.excluded in (None, Exclusion.TOO_SMALL)
        ]
        return max(rooms, default=None)


def _judge(
    gpu: Gpu,
    request: AllocationRequest,
    booked: Callable[[Gpu], tuple[int, int]],
    *,
    settings: AllocationSettings,
    now: float,
    credit: int = 0,
) -> GpuVerdict:
    age = max(0.0, now - gpu.sampled_at)

    def verdict(excluded: Exclusion | None, room: Headroom | None = None) -> GpuVerdict:
        return GpuVerdict(gpu=gpu, headroom=room, excluded=excluded, sample_age_s=age)

    if request.nodes is not None and gpu.node not in request.nodes:
        return replace(verdict(Exclusion.OTHER_NODE), detail=request.node_reasons.get(gpu.node, ""))
    if not model_matches(request.model, gpu.model):
        return verdict(Exclusion.OTHER_MODEL)
    if gpu.missing:
        return verdict(Exclusion.MISSING)
    if not gpu.healthy:
        return verdict(Exclusion.UNHEALTHY)
    if gpu.mig_enabled:
        return verdict(Exclusion.MIG_ENABLED)
    accounting = settings.accounting
    stale = age > accounting.max_sample_age_s
    if stale and accounting.stale_mode is StaleGpuMode.REFUSE:
        return verdict(Exclusion.STALE)
    reserved, unseen = booked(gpu)
    # Memory held for this very request (a hold has no pod, so it is unseen as well as reserved).
    reserved, unseen = reserved - credit, unseen - credit
    room = headroom_of(
        gpu,
        reserved_mib=reserved,
        unseen_mib=unseen,
        safety_margin_mib=accounting.safety_margin_mib,
        ledger_only=stale,
    )
    return verdict(None if room.headroom_mib >= request.mib else Exclusion.TOO_SMALL, room)


def has_room_for_its_bookings(gpu: Gpu, index: LedgerIndex, *, accounting: Accounting, now: float) -> bool:
    """Whether `gpu` has room for everything booked on it in `index`.

    This lets a commit that lost its race on a GPU stand without deciding again (see
    `KubeLedger._bump`): its own bookings are in `index` beside the winner's, and headroom falls by
    exactly what is booked, so a fresh decision for them would have found room exactly when headroom
    counting them is 0 or more. A GPU that a decision would pass over (missing, unhealthy, stale when
    stale GPUs are refused) never qualifies: this is the decision's own judgement of `gpu`, for a
    request of nothing more than what is booked."""
    nothing_more = AllocationRequest(mib=0, namespace="", pod="")
    verdict = _judge(
        gpu,
        nothing_more,
        lambda g: index.booked(g, settle_s=accounting.settle_s),
        settings=AllocationSettings(accounting=accounting),
        now=now,
    )
    return verdict.fits


def _gpu_order(gpu: Gpu) -> tuple[str, int, str]:
    return (gpu.node, gpu.index, gpu.uuid)


def _rank(prefer: str, gpu: Gpu) -> int:
    """A replica's own stable order of the GPUs (0 for all when it states no preference)."""
    if not prefer:
        return 0
    return int.from_bytes(hashlib.blake2s(f"{prefer}/{gpu.uuid}".encode(), digest_size=4).digest(), "big")


def choose(
    request: AllocationRequest,
    gpus: Iterable[Gpu],
    reservations: Iterable[Reservation],
    *,
    settings: AllocationSettings,
    now: float,
    index: LedgerIndex | None = None,
    prefer: str = "",
    avoid: Collection[str] = (),
    credit: Mapping[str, int] | None = None,
) -> Choice | Refusal:
    """Pick a GPU for `request` by `settings.policy`, or refuse with a verdict for every GPU.

    The ledger is `reservations`, or, when given, `index` (the same, summed per GPU ahead of time).
    GPUs within `settings.near_tie_mib` of the best are tied. Ties go first to the GPU that `prefer`
    (the deciding replica's name) ranks highest, then by node name, index and UUID. Replicas that
    decide at once then spread over near-equal GPUs instead of all taking the same one and
    conflicting at commit. Tied GPUs in `avoid` (where this request's last commit conflicted) come
    last. `credit` (GPU UUID -> MiB) is memory held for this request on those GPUs: it counts as
    free for it. The same inputs, `prefer` and `avoid` always give the same answer.
    """
    credit = credit or {}
    settle_s = settings.accounting.settle_s
    if index is not None:

        def booked_on(gpu: Gpu) -> tuple[int, int]:
            return index.booked(gpu, settle_s=settle_s)

    else:
        # Group the ledger by GPU once, so the cost grows with GPUs + reservations, not their product.
        by_gpu: dict[str, list[Reservation]] = {}
        for r in reservations:
            if r.is_active:
                by_gpu.setdefault(r.gpu_uuid, []).append(r)

        def booked_on(gpu: Gpu) -> tuple[int, int]:
            return booked(gpu, by_gpu.get(gpu.uuid, []), settle_s=settle_s)

    verdicts = tuple(
        _judge(gpu, request, booked_on, settings=settings, now=now, credit=credit.get(gpu.uuid, 0))
        for gpu in sorted(gpus, key=_gpu_order)
    )
    fitting = [v for v in verdicts if v.fits and v.headroom is not None]
    if not fitting:
        return Refusal(request=request, verdicts=verdicts)
    if request.count > 1:
        return _choose_set(request, fitting, verdicts, settings=settings, prefer=prefer, avoid=avoid)
    sign = -1 if settings.policy is Policy.SPREAD else 1
    top = min(sign * v.headroom.headroom_mib for v in fitting)  # type: ignore[union-attr]
    tied = [v for v in fitting if sign * v.headroom.headroom_mib - top <= settings.near_tie_mib]  # type: ignore[union-attr]
    best = min(
        tied,
        key=lambda v: (
            v.gpu.uuid in avoid,
            _rank(prefer, v.gpu),
            sign * v.headroom.headroom_mib,  # type: ignore[union-attr]
            *_gpu_order(v.gpu),
        ),
    )
    assert best.headroom is not None
    return Choice(request=request, gpu=best.gpu, headroom=best.headroom, verdicts=verdicts)


def _choose_set(
    request: AllocationRequest,
    fitting: list[GpuVerdict],
    verdicts: tuple[GpuVerdict, ...],
    *,
    settings: AllocationSettings,
    prefer: str,
    avoid: Collection[str],
) -> Choice | Refusal:
    """`request.count` GPUs on one node, each with room: on every node with enough, the policy's best
    GPUs; then the node whose set the policy likes best (spread: the most headroom in total; binpack:
    the least). A node with a GPU in `avoid` comes after the others, so a retry after a conflict tries
    elsewhere first."""
    sign = -1 if settings.policy is Policy.SPREAD else 1
    by_node: dict[str, list[GpuVerdict]] = {}
    for v in fitting:
        by_node.setdefault(v.gpu.node, []).append(v)
    sets = []
    for node, candidates in by_node.items():
        if len(candidates) < request.count:
            continue
        picked = sorted(candidates, key=lambda v: (sign * v.room_mib, *_gpu_order(v.gpu)))[: request.count]
        sets.append(
            (
                any(v.gpu.uuid in avoid for v in picked),
                sign * sum(v.room_mib for v in picked),
                _rank(prefer, picked[0].gpu),
                node,
                sorted(picked, key=lambda v: _gpu_order(v.gpu)),
            )
        )
    if not sets:
        return Refusal(request=request, verdicts=verdicts)
    best = min(sets, key=lambda s: s[:4])[4]
    first, *rest = best
    assert first.headroom is not None
    return Choice(
        request=request,
        gpu=first.gpu,
        headroom=first.headroom,
        verdicts=verdicts,
        more=tuple((v.gpu, v.headroom) for v in rest if v.headroom is not None),
    )
