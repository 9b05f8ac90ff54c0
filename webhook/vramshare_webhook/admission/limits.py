"""Step 5b, limits: the namespace's pending-booking count, its quota and the bounds on pending memory
(see `vramshare.domain.tenancy`). A limit is confirmed on a consistent view before it refuses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from vramshare.domain import AllocationRequest
from vramshare.domain.snapshot import Snapshot
from vramshare.domain.tenancy import Limit, OverLimit, Quota, creator_of, over_limit, with_pods_seen
from vramshare.kube.resources import MEMORY_RESOURCE
from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.decision import Reason, Refuse
from vramshare_webhook.memory_resource import quotas_in

_LIMIT_REASONS = {
    Limit.QUOTA: Reason.QUOTA,
    Limit.PENDING_NAMESPACE: Reason.PENDING_MIB_LIMIT,
    Limit.PENDING_USER: Reason.PENDING_MIB_LIMIT,
}

POD_LABEL_NAMESPACES = 8
"""At most this many namespaces' GPU pods are listed to confirm a pending bound."""


async def within_limits(
    intent: Intent, alloc: AllocationRequest, snapshot: Snapshot, *, ctx: Context, details: Mapping[str, Any]
) -> Snapshot | Refuse:
    """The view to go on deciding with (a fresher one where a limit had to be confirmed), or the
    refusal that names the limit."""
    request = intent.request
    limit = ctx.settings.max_pending_per_namespace
    if limit and not request.dry_run and snapshot.pending_in(request.namespace) >= limit:
        return Refuse(
            reason=Reason.PENDING_LIMIT,
            message=f"namespace {request.namespace} already has {limit} GPU bookings whose pods have not "
            "appeared yet (webhook.settings.max_pending_per_namespace); each ends when its pod "
            f"appears or expires. {ctx.hint(intent.style)}",
            details=details,
            style=intent.style,
        )
    over = over_limits(intent, alloc=alloc, snapshot=snapshot, ctx=ctx)
    if over is None:
        return snapshot
    # Confirmed on a consistent view: bookings may have been bound meanwhile, and pods created a moment
    # ago may not have reached this replica's watch yet.
    snapshot = await ctx.ledger.snapshot(fresh=True)
    pods: set[tuple[str, str]] | None = None
    if over.reason is not Reason.QUOTA:
        creator = creator_of(request.username, request.namespace)
        concerned = {request.namespace} | {
            r.namespace for r in snapshot.pending_bookings() if creator_of(r.user, r.namespace) == creator
        }
        pods = {
            (ns, label)
            for ns in sorted(concerned)[:POD_LABEL_NAMESPACES]
            for label in await ctx.ledger.pod_labels(ns)
        }
    over = over_limits(intent, alloc=alloc, snapshot=snapshot, ctx=ctx, pods=pods)
    if over is None:
        return snapshot
    return replace(over, details={**details, **over.details})


def over_limits(
    intent: Intent,
    *,
    alloc: AllocationRequest,
    snapshot: Snapshot,
    ctx: Context,
    pods: set[tuple[str, str]] | None = None,
) -> Refuse | None:
    """The namespace's quota and the bounds on pending memory, as they stand on `snapshot`: a refusal
    naming the limit, or None. A booking whose pod has appeared (in `pods`, (namespace, reservation
    label) of the GPU pods; else this replica's pod watch) is not pending, though the controller may
    not have bound it yet."""
    request, settings = intent.request, ctx.settings
    namespace = request.namespace
    holdings = snapshot.holdings(namespace)
    creator = creator_of(request.username, namespace)
    user_pending = snapshot.pending_of_user(creator)
    quotas = namespace_quotas(namespace, ctx=ctx)
    # Memory held for this task's next try is its own: its admission takes the hold's place.
    credit_mib = sum(h.mib for h in snapshot.holds_for(intent.facts.task_key))

    def verdict() -> OverLimit | None:
        return over_limit(
            namespace=namespace,
            user=creator,
            mib=alloc.mib * alloc.count,
            holdings=holdings,
            user_pending_mib=user_pending,
            quotas=quotas,
            settings=settings.tenancy,
            resource=settings.memory_resource or MEMORY_RESOURCE,
            credit_mib=credit_mib,
        )

    over = verdict()
    if over is not None and over.limit is not Limit.QUOTA:
        # Only when a pending bound is hit: which of those bookings' pods exist already.
        seen = pods if pods is not None else set(ctx.cluster.gpu_pods())
        holdings, user_pending = with_pods_seen(
            holdings,
            snapshot.pending_bookings(),
            namespace=namespace,
            user=creator,
            appeared=lambda r: (r.namespace, r.pod_label or r.name) in seen,
        )
        over = verdict()
    if over is None:
        return None
    return Refuse(
        reason=_LIMIT_REASONS[over.limit],
        message=f"{over.message}. {ctx.hint(intent.style)}",
        details={"limit": over.limit.value, "namespace_holds_mib": holdings.total_mib},
        style=intent.style,
    )


def namespace_quotas(namespace: str, *, ctx: Context) -> list[Quota]:
    """The namespace's GPU-memory quotas (none where vramshare sets no memory resource)."""
    resource = ctx.settings.memory_resource
    return quotas_in(ctx.cluster.resource_quotas(namespace), resource=resource) if resource else []
