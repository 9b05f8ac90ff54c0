"""Step 7, outcome: the pod's one patch. An admitted or queued pod's placement patch, followed by what
its delivery mode adds (see `vramshare_webhook.delivery_modes`) and its request of the memory resource (see
`vramshare_webhook.memory_resource`); a pod admitted again on an earlier pass's placement."""

from __future__ import annotations

from dataclasses import replace

from vramshare_webhook.admission.budget import budget
from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.decision import Admit, Decision, Queue, Reason
from vramshare_webhook.memory_resource import memory_resource_patch
from vramshare_webhook.patching import Operation
from vramshare_webhook.pod import Placement
from vramshare_webhook.pod_patch import placement_patch
from vramshare_webhook.settings import WebhookSettings


async def readmitted(intent: Intent, placement: Placement, *, ctx: Context) -> Admit:
    """The pod admitted again where its earlier pass placed it (its budget where every GPU is known)."""
    known = {g.uuid: g for g in (await ctx.ledger.snapshot()).gpus}
    gpus = [known[u] for u in placement.gpu_uuids if u in known]
    told = intent.guard and len(gpus) == len(placement.gpu_uuids)
    return Admit(
        placement=placement,
        patch=placement_patch(
            intent.request.object,
            placement,
            guardrails=budget(intent.mib, gpus, nodes=ctx.cluster.nodes()) if told else None,
        ),
        reason=Reason.REINVOCATION,
        details=intent.details,
    )


def with_delivery(decision: Decision, intent: Intent, *, settings: WebhookSettings) -> Decision:
    """The admitted or queued pod's whole patch; other decisions unchanged. A queued pod gets its
    delivery without GPUs (only modes that can deliver when the gate lifts queue)."""
    if not isinstance(decision, Admit | Queue):
        return decision
    gpus = decision.placement.gpu_uuids if isinstance(decision, Admit) else ()
    return replace(
        decision,
        patch=[
            *decision.patch,
            *intent.delivery.patch(intent.request.object, gpus),
            *_memory_resource(intent, settings=settings),
        ],
    )


def _memory_resource(intent: Intent, *, settings: WebhookSettings) -> list[Operation]:
    """The pod's request of the memory resource: its MiB, all GPUs together, which ResourceQuota, the
    scheduler and Kueue count."""
    resource = settings.memory_resource
    if not resource:
        return []
    return memory_resource_patch(intent.request.object, resource=resource, mib=intent.mib * intent.count)
