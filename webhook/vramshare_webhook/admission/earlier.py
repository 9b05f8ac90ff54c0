"""Step 3, an earlier pass? A pod the API server sends again (reinvocation, after a later webhook
changed it) already carries the placement, or the queue entry, of vramshare's first pass.

The API server gives every call a new request UID, reinvocations included, so the earlier pass is
recognised by its booking (see `not_an_earlier_pass`). Anything else is not honoured: the pod is decided
afresh and its copied annotations are overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramshare.domain import ReservationPhase
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import ANNOTATION_REINVOKED
from vramshare_webhook.admission.context import Context
from vramshare_webhook.admission.intent import Intent
from vramshare_webhook.pod import Placement, PodFacts


@dataclass(frozen=True, kw_only=True)
class EarlierPass:
    """What the pod's annotations point to, and whether it is honoured."""

    placement: Placement | None = None
    """The earlier pass's placement: the pod is admitted there again."""
    entry: str | None = None
    """The earlier pass's queue entry: the pod waits as it again."""
    not_honoured: str | None = None
    """Why what the annotations claim is not this pod's earlier pass (the pod is decided afresh)."""


async def earlier_pass(intent: Intent, *, ctx: Context) -> EarlierPass:
    """The placement (or, in queue mode, the queue entry) of an earlier pass of this same pod
    creation, if the pod carries a genuine one."""
    facts, request = intent.facts, intent.request
    placement = facts.claimed_placement
    name = placement.reservation if placement is not None else facts.claimed_queue_entry
    if name is None or (placement is None and not intent.queue):
        return EarlierPass()
    existing = await ctx.ledger.get_reservation(request.namespace, name)
    why = (
        "the reservation does not exist"
        if existing is None
        else not_an_earlier_pass(
            existing,
            placement=placement,
            facts=facts,
            mib=intent.mib,
            user=request.username,
            now=ctx.server_now(),
            window_s=ctx.settings.reinvocation_window_s,
        )
    )
    if why is None and existing is not None:
        if await ctx.ledger.pod_carries(request.namespace, existing.name):
            why = "a pod already carries the reservation"
        elif not await ctx.ledger.claim_reinvocation(existing, claimant=request.uid):
            why = "the reservation was already taken up by a reinvocation"
    if why is not None:
        return EarlierPass(not_honoured=why)
    return EarlierPass(placement=placement) if placement is not None else EarlierPass(entry=name)


def not_an_earlier_pass(
    existing: GpuReservation,
    *,
    placement: Placement | None,
    facts: PodFacts,
    mib: int,
    user: str,
    now: float,
    window_s: float,
) -> str | None:
    """Why the booking a pod's annotations point to is not this pod's own earlier pass (None if it is).

    `placement` is what the annotations claim; None when they name a queue entry instead. Everything
    compared is the reservation's own record, which only vramshare writes: a user who copies another
    pod's vramshare.io/* annotations can match the placement, but not a booking that is still unbound
    and untaken, younger than the window, made for the same pod name and size, by the same user.
    `claim_reinvocation` then lets at most one pass take it up.
    """
    spec = existing.spec
    if placement is None:
        if spec.placed:
            return "the reservation is placed; the annotations name no GPU"
    elif (spec.gpu_uuid, spec.gpu_index, spec.node_name) != (
        placement.gpu_uuid,
        placement.gpu_index,
        placement.node,
    ):
        return "the annotations name another GPU than the reservation"
    if spec.pod_name != facts.display_name or spec.memory_mib != mib:
        return "the reservation was made for another pod or size"
    if spec.admitted_user != user:
        return "the reservation was made for another user"
    waiting = ReservationPhase.RESERVED if placement is not None else ReservationPhase.QUEUED
    if existing.phase is not waiting or existing.status.pod_uid:
        return "the reservation already belongs to a pod"
    if now - (existing.meta.created_at or 0.0) > window_s:
        return f"the reservation is older than {window_s:g} s"
    if ANNOTATION_REINVOKED in existing.meta.annotations:
        return "the reservation was already taken up by a reinvocation"
    return None
