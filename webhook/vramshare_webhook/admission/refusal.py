"""Step 6, refusal: no GPU has room. The pod is refused in its style, memory is kept for the task's
next try where fairness asks for it (see `vramshare.domain.fairness`), and the answer says when to
retry from how fast memory frees lately."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramshare.domain import Gpu, Refusal, gpu_to_hold, missing_mib, refusal_message, retry_after_s
from vramshare.domain.snapshot import CommitConflictError, Snapshot
from vramshare.domain.tenancy import why_no_hold
from vramshare.kube.objects import GpuReservation
from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.admission.limits import namespace_quotas
from vramshare_webhook.admission.naming import reservation_name
from vramshare_webhook.decision import Refuse


async def refuse(
    intent: Intent, refusal: Refusal, *, snapshot: Snapshot, ctx: Context, details: Mapping[str, Any]
) -> Refuse:
    request, settings = intent.request, ctx.settings
    holds = snapshot.holds_for(intent.facts.task_key)
    note = ""
    if holds:
        held = holds[0]
        note = f" GPU {held.gpu_uuid} keeps the memory that frees on it for this task's next try."
    elif not request.dry_run and refusal.request.count == 1:  # one GPU cannot be held for a set
        held_gpus = snapshot.held_gpus()
        # Only a task seen retrying gets a hold, within its namespace's share of them and its quota.
        retrying = ctx.refused_tasks.refused(intent.facts.task_key, now=ctx.clock())
        no_hold = why_no_hold(
            mib=refusal.request.mib,
            holdings=snapshot.holdings(request.namespace),
            quotas=namespace_quotas(request.namespace, ctx=ctx),
            settings=settings.tenancy,
        )
        gpu = (
            gpu_to_hold(refusal, held=held_gpus, settings=settings.allocation, fairness=settings.fairness)
            if retrying and no_hold is None and len(held_gpus) < settings.max_holds
            else None
        )
        if gpu is not None and await _hold(
            intent, gpu=gpu, mib=refusal.request.mib, snapshot=snapshot, ctx=ctx
        ):
            note = (
                f" GPU {gpu.label} now keeps the memory that frees on it for this task, for up to "
                f"{settings.hold_limit_s:g} s: its next try is admitted there as soon as it has room."
            )
            details = {**details, "hold": gpu.uuid}
    retry_after = retry_after_s(
        deficit_mib=missing_mib(refusal),
        rate_mib_per_s=ctx.ledger.release_rate(holds[0].gpu_uuid if holds else None),
        floor_s=settings.retry_after_min_s,
        ceiling_s=settings.retry_after_s,
    )
    note += _granted_note(refusal, snapshot=snapshot, idle_s=settings.grant_idle_s)
    message = refusal_message(
        refusal,
        max_sample_age_s=settings.accounting.max_sample_age_s,
        retry_hint=ctx.hint(intent.style, retry_after),
    )
    return Refuse(
        message=message + note,
        details={**details, "best_headroom_mib": refusal.best_headroom_mib},
        retry_after_s=retry_after,
        style=intent.style,
    )


def _granted_note(refusal: Refusal, *, snapshot: Snapshot, idle_s: float) -> str:
    """Where room held in grants (`vramshare.domain.grants`) for webhook replicas' next pods
    would have taken this pod, say so: that room comes back, so a retry may find it."""
    granted = snapshot.granted_by_gpu()
    if not granted:
        return ""
    mib = refusal.request.mib
    near = [
        (v.gpu.label, granted[v.gpu.uuid])
        for v in refusal.verdicts
        if v.headroom is not None and v.gpu.uuid in granted and v.room_mib + granted[v.gpu.uuid] >= mib
    ]
    if not near:
        return ""
    where = ", ".join(f"{held} MiB on GPU {label}" for label, held in near[:3])
    return (
        f" Room for it is held for webhook replicas' next pods ({where}, in grants); it is given "
        f"back within {idle_s:g} s of their last booking there, so a retry may find it free."
    )


async def _hold(intent: Intent, *, gpu: Gpu, mib: int, snapshot: Snapshot, ctx: Context) -> bool:
    """Book `gpu` for the refused task's next try; False when another commit got there first, or
    other holds made meanwhile took the namespace's or the fleet's last one.

    Holds on different GPUs commit on different tokens, so two refusals at once could both pass the
    count on their views. Each therefore counts again on a consistent read after its commit and
    withdraws its own when there are more than allowed: both may withdraw (no hold, until a later
    refusal), never both stay."""
    request = intent.request
    hold = GpuReservation.new(
        name=f"hold-{reservation_name(request.object)}",
        namespace=request.namespace,
        pod=intent.facts.task,
        mib=mib,
        gpu=gpu,
        admission_uid=request.uid,
        user=request.username,
        held_for=intent.facts.task_key,
    )
    try:
        created = await ctx.ledger.commit(
            reservation=hold, token=snapshot.tokens[gpu.uuid], live=snapshot.live
        )
    except CommitConflictError:
        return False
    # A queue head's hold is the queue's, not a refused task's: it does not count here.
    holds = [h for h in await ctx.ledger.active_holds() if not h.queue_entry]
    in_namespace = [h for h in holds if h.namespace == request.namespace]
    if len(in_namespace) > ctx.settings.max_holds_per_namespace or len(holds) > ctx.settings.max_holds:
        await ctx.ledger.withdraw(created)
        return False
    return True
