"""Choosing a GPU for a request: a choice, or a refusal that explains every GPU.

`choose()` is the whole decision. It sees the inventory and the ledger as values and a `now` handed in
by the caller; the webhook commits the result atomically afterwards.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import cast

from vramshare.domain.accounting import Accounting, StaleGpuMode
from vramshare.domain.bookings import LedgerIndex
from vramshare.domain.headroom import Headroom, booked, headroom_mib, headroom_of
from vramshare.domain.models import AllocationRequest, Gpu, Reservation, model_matches
from vramshare.domain.shards import dealt_to


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
    NOT_SHARED = "not-shared"


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
    judged: Callable[[], tuple[GpuVerdict, ...]] = field(compare=False, repr=False)
    """Builds `verdicts` from figures taken at the decision. An admission that gets its GPU never
    reads them, and building one verdict per GPU was most of a decision's cost at fleet size."""
    more: tuple[tuple[Gpu, Headroom], ...] = ()
    """For a request of several GPUs: the others, on the same node, in the order the pod sees them."""

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return (self.gpu, *(g for g, _ in self.more))

    @property
    def verdicts(self) -> tuple[GpuVerdict, ...]:
        """How every GPU fared, in a stable order (as of the decision, whenever it is read)."""
        return self.judged()


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


Figures = tuple[int, int, int]
"""(reserved, unseen, headroom) MiB of one GPU at one sample: what the ledger books on it, the part of
that a sample cannot show yet, and the headroom the two leave (see `vramshare.domain.headroom`)."""

FiguresOf = Callable[[Gpu, bool], Figures]
"""A GPU's figures, judged on the ledger alone when the flag says so (its sample is stale)."""


def _screen(gpu: Gpu, request: AllocationRequest, accounting: Accounting, now: float, /) -> Exclusion | None:
    """Why `gpu` is out before its headroom matters, if it is. Runs for every GPU on every decision:
    positional arguments, and the checks that need a call only when the request asks for them."""
    if request.nodes is not None and gpu.node not in request.nodes:
        return Exclusion.OTHER_NODE
    if request.model is not None and not model_matches(request.model, gpu.model):
        return Exclusion.OTHER_MODEL
    if gpu.missing:
        return Exclusion.MISSING
    if not gpu.healthy:
        return Exclusion.UNHEALTHY
    if gpu.mig:
        return Exclusion.MIG_ENABLED
    if gpu.not_shared:
        return Exclusion.NOT_SHARED
    if accounting.stale_mode is StaleGpuMode.REFUSE and now - gpu.sampled_at > accounting.max_sample_age_s:
        return Exclusion.STALE
    return None


def _credited(
    gpu: Gpu, figures: Figures, credit: int, *, accounting: Accounting, ledger_only: bool
) -> Figures:
    """`figures` with memory held for this very request counted as free for it (a hold has no pod,
    so it is unseen as well as reserved)."""
    return _figures(
        gpu, figures[0] - credit, figures[1] - credit, accounting=accounting, ledger_only=ledger_only
    )


def _figures(gpu: Gpu, reserved: int, unseen: int, *, accounting: Accounting, ledger_only: bool) -> Figures:
    room = headroom_mib(
        gpu,
        reserved_mib=reserved,
        unseen_mib=unseen,
        safety_margin_mib=accounting.safety_margin_mib,
        ledger_only=ledger_only,
    )
    return reserved, unseen, room


def _verdict(
    gpu: Gpu, judged: Exclusion | Figures, request: AllocationRequest, *, accounting: Accounting, now: float
) -> GpuVerdict:
    """The verdict object for one GPU, from what the decision found for it."""
    age = max(0.0, now - gpu.sampled_at)
    if isinstance(judged, Exclusion):
        detail = request.node_reasons.get(gpu.node, "") if judged is Exclusion.OTHER_NODE else ""
        return GpuVerdict(gpu=gpu, headroom=None, excluded=judged, sample_age_s=age, detail=detail)
    reserved, unseen, room = judged
    headroom = headroom_of(
        gpu,
        reserved_mib=reserved,
        unseen_mib=unseen,
        safety_margin_mib=accounting.safety_margin_mib,
        ledger_only=age > accounting.max_sample_age_s,
    )
    excluded = None if room >= request.mib else Exclusion.TOO_SMALL
    return GpuVerdict(gpu=gpu, headroom=headroom, excluded=excluded, sample_age_s=age)


def _judge_all(
    request: AllocationRequest,
    gpus: Iterable[Gpu],
    figures_of: FiguresOf,
    *,
    accounting: Accounting,
    now: float,
    credit: Mapping[str, int],
) -> tuple[list[Gpu], list[Exclusion | Figures], list[int]]:
    """Every GPU judged for `request`: the GPUs, what was found for each (an exclusion, or its
    figures), and the positions of those with room. No object is built per GPU: at fleet size that
    was most of a decision's cost, and a decision that finds a GPU needs no verdict for the others."""
    listed = list(gpus)
    found: list[Exclusion | Figures] = []
    fitting: list[int] = []
    max_age = accounting.max_sample_age_s
    for position, gpu in enumerate(listed):
        excluded = _screen(gpu, request, accounting, now)
        if excluded is not None:
            found.append(excluded)
            continue
        ledger_only = now - gpu.sampled_at > max_age
        figures = figures_of(gpu, ledger_only)
        if credit and (held := credit.get(gpu.uuid)):
            figures = _credited(gpu, figures, held, accounting=accounting, ledger_only=ledger_only)
        found.append(figures)
        if figures[2] >= request.mib:
            fitting.append(position)
    return listed, found, fitting


def _judge(
    gpu: Gpu,
    request: AllocationRequest,
    figures_of: FiguresOf,
    *,
    settings: AllocationSettings,
    now: float,
) -> GpuVerdict:
    accounting = settings.accounting
    [listed], [found], _ = _judge_all(request, [gpu], figures_of, accounting=accounting, now=now, credit={})
    return _verdict(listed, found, request, accounting=accounting, now=now)


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
        index.figures_by(settle_s=accounting.settle_s, safety_margin_mib=accounting.safety_margin_mib),
        settings=AllocationSettings(accounting=accounting),
        now=now,
    )
    return verdict.fits


def _gpu_order(gpu: Gpu) -> tuple[str, int, str]:
    return (gpu.node, gpu.index, gpu.uuid)


@functools.lru_cache(maxsize=16_384)
def _rank(prefer: str, gpu_uuid: str) -> int:
    """A replica's own stable order of the GPUs (0 for all when it states no preference). Cached: a
    fleet's GPUs are often all tied, and hashing each on every decision would cost more than judging."""
    if not prefer:
        return 0
    return int.from_bytes(hashlib.blake2s(f"{prefer}/{gpu_uuid}".encode(), digest_size=4).digest(), "big")


def choose(
    request: AllocationRequest,
    gpus: Iterable[Gpu],
    reservations: Iterable[Reservation],
    *,
    settings: AllocationSettings,
    now: float,
    index: LedgerIndex | None = None,
    prefer: str = "",
    replicas: Sequence[str] = (),
    avoid: Collection[str] = (),
    credit: Mapping[str, int] | None = None,
) -> Choice | Refusal:
    """Pick a GPU for `request` by `settings.policy`, or refuse with a verdict for every GPU.

    The ledger is `reservations`, or, when given, `index` (the same, summed per GPU ahead of time).
    GPUs within `settings.near_tie_mib` of the best are tied. Ties go first to the GPUs dealt to
    `prefer` (the deciding replica's name) among `replicas` (the replicas up, see
    `vramshare.domain.shards`), then to the one `prefer` ranks highest, then by node name, index and
    UUID. Replicas that decide at once then spread over near-equal GPUs instead of all taking the same
    one and conflicting at commit. Tied GPUs in `avoid` (where this request's last commit conflicted) come
    last. `credit` (GPU UUID -> MiB) is memory held for this request on those GPUs: it counts as
    free for it. The same inputs, `prefer` and `avoid` always give the same answer.
    """
    accounting = settings.accounting
    figures_of: FiguresOf
    if index is not None:
        figures_of = index.figures_by(
            settle_s=accounting.settle_s, safety_margin_mib=accounting.safety_margin_mib
        )
    else:
        figures_of = _figures_from(reservations, accounting=accounting)
    listed, found, fitting = _judge_all(
        request, gpus, figures_of, accounting=accounting, now=now, credit=credit or {}
    )

    def judged() -> tuple[GpuVerdict, ...]:
        ordered = sorted(range(len(listed)), key=lambda i: _gpu_order(listed[i]))
        return tuple(_verdict(listed[i], found[i], request, accounting=accounting, now=now) for i in ordered)

    if not fitting:
        return Refusal(request=request, verdicts=judged())
    if request.count > 1:
        verdicts = judged()
        return _choose_set(
            request, [v for v in verdicts if v.fits], verdicts, settings=settings, prefer=prefer, avoid=avoid
        )
    sign = -1 if settings.policy is Policy.SPREAD else 1

    def room(i: int) -> int:
        return sign * cast(Figures, found[i])[2]  # a fitting GPU's entry is its figures

    top = min(room(i) for i in fitting)
    tied = [i for i in fitting if room(i) - top <= settings.near_tie_mib]
    mine: Collection[str] = ()
    if len(tied) > 1 and len(replicas) > 1:
        mine = dealt_to(prefer, tied=(listed[i].uuid for i in tied), replicas=replicas)
    best = min(
        tied,
        key=lambda i: (
            listed[i].uuid in avoid,
            bool(mine) and listed[i].uuid not in mine,
            _rank(prefer, listed[i].uuid),
            room(i),
            *_gpu_order(listed[i]),
        ),
    )
    chosen = _verdict(listed[best], found[best], request, accounting=accounting, now=now)
    assert chosen.headroom is not None
    return Choice(request=request, gpu=chosen.gpu, headroom=chosen.headroom, judged=judged)


def _figures_from(reservations: Iterable[Reservation], *, accounting: Accounting) -> FiguresOf:
    """Figures from a ledger given as a list, grouped by GPU once, so the cost grows with GPUs +
    reservations, not their product."""
    by_gpu: dict[str, list[Reservation]] = {}
    for r in reservations:
        if r.is_active:
            by_gpu.setdefault(r.gpu_uuid, []).append(r)

    def figures_of(gpu: Gpu, ledger_only: bool) -> Figures:
        reserved, unseen = booked(gpu, by_gpu.get(gpu.uuid, []), settle_s=accounting.settle_s)
        return _figures(gpu, reserved, unseen, accounting=accounting, ledger_only=ledger_only)

    return figures_of


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
                _rank(prefer, picked[0].gpu.uuid),
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
        judged=lambda: verdicts,
        more=tuple((v.gpu, v.headroom) for v in rest if v.headroom is not None),
    )
