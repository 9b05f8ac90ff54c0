"""A pod that waits: its queue entry written (a GpuReservation with no GPU yet) and the pod admitted
behind vramshare's scheduling gate, which the controller lifts once it has placed the entry."""

from __future__ import annotations

from vramshare.kube.objects import GpuReservation
from vramshare.kube.pods import QUEUE_GATE
from vramshare_webhook.admission.budget import known_before_placement
from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.admission.naming import reservation_name
from vramshare_webhook.decision import Queue, Reason
from vramshare_webhook.pod_patch import queue_patch


async def enqueue(intent: Intent, *, ctx: Context) -> Queue:
    """Write a new queue entry for the pod (none on a dry run) and admit it behind the gate."""
    request, facts = intent.request, intent.facts
    name = reservation_name(request.object)
    if facts.held_elsewhere:
        intent = intent.noting(held_elsewhere=list(facts.held_elsewhere))
    if not request.dry_run:
        await ctx.ledger.enqueue(
            GpuReservation.queued(
                name=name,
                namespace=request.namespace,
                pod=facts.display_name,
                mib=intent.mib,
                admission_uid=request.uid,
                user=request.username,
            )
        )
    return queued(intent, entry=name)


def queued(intent: Intent, *, entry: str) -> Queue:
    """The pod admitted behind the gate, waiting as queue entry `entry`."""
    request, facts, mib = intent.request, intent.facts, intent.mib
    patch = queue_patch(
        request.object, reservation=entry, guardrails=known_before_placement(mib) if intent.guard else None
    )
    if facts.held_elsewhere:
        return Queue(
            entry=entry,
            patch=patch,
            message=(
                f"vramshare: pod {intent.pod} is held by "
                f"{', '.join(facts.held_elsewhere)}: it waits as GpuReservation {entry} behind "
                f"scheduling gate {QUEUE_GATE} too, and its {mib} MiB are booked only once its other "
                "gates are lifted (Kueue admitted it), on a GPU with room then"
            ),
            reason=Reason.HELD_ELSEWHERE,
            details=intent.details,
        )
    return Queue(
        entry=entry,
        patch=patch,
        message=(
            f"vramshare: no GPU has {mib} MiB free now; pod {intent.pod} "
            f"waits in the queue as GpuReservation {entry} behind scheduling gate {QUEUE_GATE} until "
            "one has room (kubectl get gpureservations shows its position)"
        ),
        details=intent.details,
    )
