"""Step 5, place: a GPU chosen and booked for the pod. Each attempt reads the view, applies the
node constraints and the tenancy limits, chooses (pure: `vramshare.domain.choose`) and commits;
a commit that lost its race on a GPU is tried again, avoiding that GPU, until a little before the
answer's deadline. Nothing fits: the pod waits (queue mode) or is refused."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from vramshare.domain import AllocationRequest, Choice, Refusal, choose, could_ever_fit, model_matches
from vramshare.domain.scheduling import schedulable_nodes
from vramshare.domain.snapshot import Snapshot
from vramshare.kube.pods import MODEL_ANNOTATION
from vramshare_webhook.admission.budget import budget
from vramshare_webhook.admission.commit import bookings_for, commit_all
from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.admission.limits import within_limits
from vramshare_webhook.admission.naming import reservation_name
from vramshare_webhook.admission.queueing import enqueue
from vramshare_webhook.admission.refusal import refuse
from vramshare_webhook.decision import Admit, Contention, Decision, Invalid, Reason
from vramshare_webhook.pod import Placement
from vramshare_webhook.pod_patch import placement_patch


@dataclass(frozen=True, kw_only=True)
class _Conflicted:
    """The commit on this GPU lost a race: decide again."""

    gpu_uuid: str


async def place(intent: Intent, *, ctx: Context) -> Decision:
    """Admit the pod on a GPU, queue it, or refuse it; retry commits that lost a race."""
    # Stop retrying conflicts a little before the answer's own deadline, to say why.
    allowed_s = ctx.settings.decision_deadline_s
    deadline = time.monotonic() + max(allowed_s / 2, allowed_s - 1.0)
    alloc = intent.allocation()
    attempt = 0
    avoid: frozenset[str] = frozenset()
    while True:
        attempt += 1
        tried = intent.noting(attempts=attempt)
        # No lock: a decision joins this process's view before its commit's first await, so the next
        # one counts it; replicas race, and the commit's precondition settles that.
        decision = await _attempt(tried, alloc=alloc, avoid=avoid, ctx=ctx)
        if not isinstance(decision, _Conflicted):
            return decision
        # Another replica is committing on that GPU: among near ties, try another one next.
        avoid = avoid | {decision.gpu_uuid}
        ctx.metrics.conflicts.inc()
        if time.monotonic() >= deadline:
            return Contention(
                message=(
                    f"could not reserve {intent.mib} MiB for pod {intent.pod} "
                    f"within {allowed_s:g} s: too many concurrent admissions "
                    f"on the same GPUs. {ctx.hint(intent.style)}"
                ),
                details=tried.details,
                style=intent.style,
            )
        backoff = min(0.2, 0.005 * 2**attempt) * (0.5 + secrets.randbelow(100) / 100)
        await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))


async def _attempt(
    intent: Intent, *, alloc: AllocationRequest, avoid: frozenset[str], ctx: Context
) -> Decision | _Conflicted:
    """Decide on a view and commit; `_Conflicted` when the chosen GPU's ledger moved meanwhile."""
    request, facts, details = intent.request, intent.facts, intent.details
    choosing = time.perf_counter()
    snapshot = await ctx.ledger.snapshot()
    unknown = _unknown_model(alloc, snapshot)
    if unknown is not None:
        return unknown
    alloc = _onto_schedulable_nodes(alloc, intent, snapshot, ctx=ctx)
    view = await within_limits(intent, alloc, snapshot, ctx=ctx, details=details)
    if not isinstance(view, Snapshot):
        return view
    snapshot = view
    if intent.defer and _could_ever_take(alloc, snapshot, ctx=ctx):
        return await enqueue(intent, ctx=ctx)

    def chosen(view: Snapshot, *, granted: bool = False) -> Choice | Refusal:
        # Memory held for this task's next try (an earlier refusal of it) counts as its own, and with
        # `granted` so does what this replica's grants still hold (each GPU's, where it takes the pod).
        credit = {h.gpu_uuid: h.mib for h in view.holds_for(facts.task_key)}
        if granted:
            for gpu_uuid, mib in ctx.ledger.grant_credit(intent.mib).items():
                credit[gpu_uuid] = max(mib, credit.get(gpu_uuid, 0))
        return choose(
            alloc,
            view.gpus,
            view.reservations,
            settings=ctx.settings.allocation,
            now=ctx.clock(),
            index=view.index,
            prefer=ctx.settings.identity,
            replicas=ctx.cluster.replicas(),
            avoid=avoid,
            credit=credit,
        )

    # The policy ranks GPUs by the room every replica sees; this replica's grants count as its own
    # only where nothing else fits (a pod the policy puts on a GPU with such a grant goes inside it).
    choice = chosen(snapshot)
    if not isinstance(choice, Choice):
        choice = chosen(snapshot, granted=True)
    if not isinstance(choice, Choice):  # refuse only on a consistent view
        snapshot = await ctx.ledger.snapshot(fresh=True)
        choice = chosen(snapshot, granted=True)
    if not isinstance(choice, Choice):
        if intent.queue and _could_ever_take(alloc, snapshot, ctx=ctx):
            # It can wait for one of these; a request none could ever take is refused.
            return await enqueue(intent, ctx=ctx)
        return await refuse(intent, choice, snapshot=snapshot, ctx=ctx, details=details)
    gpus = list(choice.gpus)
    name = reservation_name(request.object)
    placement = Placement(
        reservation=name,
        gpu_uuid=choice.gpu.uuid,
        gpu_index=choice.gpu.index,
        node=choice.gpu.node,
        more=tuple((g.uuid, g.index) for g in gpus[1:]),
    )
    admitted = {**details, "headroom_mib": choice.headroom.headroom_mib}
    patch = placement_patch(
        request.object,
        placement,
        guardrails=budget(intent.mib, gpus, nodes=ctx.cluster.nodes()) if intent.guard else None,
    )
    if request.dry_run:
        return Admit(placement=placement, patch=patch, reason=Reason.DRY_RUN, details=admitted)
    committing = time.perf_counter()
    ctx.metrics.choose_seconds.observe(committing - choosing)
    try:
        conflicted = await commit_all(
            bookings_for(intent, name=name, gpus=gpus),
            snapshot,
            ledger=ctx.ledger,
            room_left_mib=choice.headroom.headroom_mib - intent.mib,
        )
    finally:
        ctx.metrics.commit_seconds.observe(time.perf_counter() - committing)
    if conflicted is not None:
        return _Conflicted(gpu_uuid=conflicted)
    ctx.ledger.relieve_grants(_room_for_others(snapshot, ctx=ctx))
    ctx.refused_tasks.forget(facts.task_key)
    for hold in snapshot.holds_for(facts.task_key):  # its task is in: the held memory is its own now
        await ctx.ledger.withdraw_hold(hold.namespace, hold.name)
        admitted["hold_used"] = hold.gpu_uuid
    return Admit(placement=placement, patch=patch, reason=Reason.FITS, details=admitted)


def _room_for_others(snapshot: Snapshot, *, ctx: Context) -> Callable[[str], int | None]:
    """A GPU's headroom as every replica computes it now (grants' remainders counted as booked), from
    a live view; None for a GPU it does not show, and for all on a consistent read."""
    index = snapshot.index
    if index is None:
        return lambda uuid: None
    accounting = ctx.settings.accounting
    figures = index.figures_by(settle_s=accounting.settle_s, safety_margin_mib=accounting.safety_margin_mib)
    gpus = {g.uuid: g for g in snapshot.gpus}
    return lambda uuid: figures(gpus[uuid], False)[2] if uuid in gpus else None


def _unknown_model(alloc: AllocationRequest, snapshot: Snapshot) -> Invalid | None:
    """A model no GPU of the fleet has: the pod's own input is wrong."""
    if (
        alloc.model is None
        or not snapshot.gpus
        or any(model_matches(alloc.model, g.model) for g in snapshot.gpus)
    ):
        return None
    models = ", ".join(sorted({g.model for g in snapshot.gpus}))
    return Invalid(
        reason=Reason.INVALID_MODEL,
        message=f'annotation "{MODEL_ANNOTATION}" is "{alloc.model}": no GPU in the fleet has that '
        f"model; the models are: {models} (exact, or a pattern with * and ?)",
    )


def _onto_schedulable_nodes(
    alloc: AllocationRequest, intent: Intent, snapshot: Snapshot, *, ctx: Context
) -> AllocationRequest:
    """Step 5a: only GPUs on nodes the scheduler could bind the pod to, each other one with why not."""
    nodes = list(ctx.cluster.nodes())
    if not nodes:
        return alloc
    allowed, reasons = schedulable_nodes(
        nodes, intent.facts.node_rules, gpu_nodes=(g.node for g in snapshot.gpus)
    )
    if not reasons:
        return alloc  # every GPU node will do
    return replace(alloc, nodes=allowed, node_reasons=reasons)


def _could_ever_take(alloc: AllocationRequest, snapshot: Snapshot, *, ctx: Context) -> bool:
    """Whether some GPU the pod could be placed on would have room for it, empty."""
    return any(
        (alloc.nodes is None or g.node in alloc.nodes)
        and model_matches(alloc.model, g.model)
        and could_ever_fit(alloc.mib, g, settings=ctx.settings.allocation)
        for g in snapshot.gpus
    )
