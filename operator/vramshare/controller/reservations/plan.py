"""The reservation lifecycle's plan (pure): from a booking, what is known of its pod, whether its GPU
is missing and the time, the status to write, the event to post and whether to delete the booking.

No ownerReference is written (issue #31): it was a second write per admitted pod (status is a
subresource, so it could not share the Bound status's), and all it did is now done here: a booking
is deleted once the pod it was bound to is gone, and its finalizer (set at creation) keeps it
counting until then however it is deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from vramshare.controller.reservations.wording import event_for
from vramshare.domain import (
    PodSighting,
    PodState,
    ReservationPhase,
    Transition,
    due_for_cleanup,
    next_phase,
)
from vramshare.domain.grants import MARGIN_S as GRANT_MARGIN_S
from vramshare.kube.events import Event
from vramshare.kube.objects import (
    GpuReservation,
    ReservationStatus,
)
from vramshare.kube.sightings import KUBELET_KILL_S, pod_sighting

__all__ = ["ABSENCE", "KUBELET_KILL_S", "Plan", "plan", "pod_sighting"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    status: ReservationStatus | None = None
    """The status to write; None when it stays as it is."""
    transition: Transition | None = None
    event: Event | None = None
    event_on_reservation: bool = False
    """Post the event on the GpuReservation (its pod never appeared) instead of the pod."""
    delete: bool = False
    active_label: str | None = None
    """The vramshare.io/active label to write ("false" once ended, so the webhook's LIST skips it;
    "true" again for a booking that counts again); None to leave it."""
    finalizer: Literal["add", "remove"] | None = None
    """vramshare's finalizer: added to a booking that lacks it (made before it existed, or by hand);
    removed from a deleted one once it has ended, which lets it go."""
    deletion_waits: bool = False
    """It was deleted while its pod may still hold the memory: it stays, and counts, until then."""
    bind_at: float | None = None
    """Binding waits for its pod to run until then (see `_binds_later`); nothing is written now."""
    release_at: float | None = None
    """Its pod was force-deleted while it ran: the booking counts until then, when the kubelet has
    killed the containers (see `PodSighting.forced_grace_s`); nothing is written now."""

    @property
    def empty(self) -> bool:
        return not (self.status or self.event or self.delete or self.active_label or self.finalizer)


def plan(
    *,
    res: GpuReservation,
    pod: PodSighting | None,
    gpu_missing: bool,
    now: float,
    ttl_s: float,
    retention_s: float,
    never_created_retention_s: float | None = None,
    hold_limit_s: float = float("inf"),
    bind_wait_s: float = 0.0,
    pod_deleted: bool = False,
    running_until: float | None = None,
    watching_since: float = float("-inf"),
    unrenewed_s: float = 0.0,
) -> Plan:
    """What to write for `res` now. `pod_deleted`: its pod's deletion was just seen (it may have gone
    before its booking was bound: see `bind_wait_s`). `running_until`: its pod was force-deleted while it
    ran, and its containers may run until then. A booking whose pod never appeared is kept
    `never_created_retention_s` (default: `retention_s`). `watching_since`: when the controller started
    watching pods (a booking older than that may have had a pod that came and went unseen).
    `unrenewed_s`: for a grant, how long the controller has seen it unchanged (its own clock)."""
    current = res.status
    seen = bool(current.pod_uid) or pod_deleted
    status = current
    if current.phase is not res.phase:
        # Make the implicit phase visible to kubectl: Reserved when just committed or placed, Queued
        # again when a placement was withdrawn.
        status = replace(status, phase=res.phase)
    granted = res.phase is ReservationPhase.GRANTED
    transition = next_phase(
        phase=res.phase,
        pod=pod.state if pod is not None else PodState.ABSENT,
        gpu_missing=gpu_missing,
        age_s=unrenewed_s if granted else now - (res.meta.created_at or 0.0),
        ttl_s=ttl_s,
        seen=seen,
        hold_limit_s=hold_limit_s,
        grant_lapses_after_s=res.grant_lasts_s + GRANT_MARGIN_S,
    )
    if (
        transition is not None
        and transition.reason == "PodNeverCreated"
        and (res.meta.created_at or 0.0) < watching_since
    ):
        # Nothing records that a booking's pod was seen (issue #45): one made before this controller
        # started may have had a pod that ended, or was deleted, while none was running.
        transition = replace(
            transition,
            message=f"{transition.message}; or its pod came and went while no controller was watching",
        )
    if pod is not None and _binds_later(transition, pod, now=now, bind_wait_s=bind_wait_s):
        return Plan(bind_at=pod.created_at + bind_wait_s)
    if (
        transition is not None
        and transition.reason == "PodDeleted"
        and running_until is not None
        and now < running_until
    ):
        # Force-deleted while it ran: its containers still hold the memory (issue #42, 9).
        return Plan(release_at=running_until)
    # Open (queued or holding memory): its pod is recorded.
    active_after = transition.phase.is_open if transition is not None else res.phase.is_open
    if pod is not None and active_after:
        if current.pod_uid != pod.uid:
            status = replace(status, pod_uid=pod.uid)
        if pod.running_since is not None and current.pod_running_since is None:
            status = replace(status, pod_running_since=pod.running_since)
    event, on_reservation = None, False
    if transition is not None:
        status = replace(status, phase=transition.phase, reason=transition.reason, message=transition.message)
        status = replace(status, finished_at=None if transition.phase.is_open else now)
        if transition.phase is not ReservationPhase.QUEUED:
            status = replace(status, queue_position=None)  # it left the queue
        event = event_for(res, transition)
        on_reservation = transition.reason == "PodNeverCreated"
        if pod is None and not on_reservation:
            event = None  # no pod to tell
    if res.meta.deleting:
        written = status if status != current else None
        return _deleted(res, status=written, transition=transition, event=event, active_after=active_after)
    delete = False
    # The pod it was bound to is gone (deleted now, or after it finished): it goes at once, as it
    # went through an ownerReference before.
    pod_gone = pod is None and seen
    if not active_after and (transition is None or pod_gone):
        finished = current.finished_at if current.finished_at is not None else (res.meta.created_at or 0.0)
        reason = transition.reason if transition is not None else current.reason
        kept_s = retention_s
        if reason == "PodNeverCreated" and never_created_retention_s is not None:
            kept_s = never_created_retention_s
        delete = due_for_cleanup(
            phase=transition.phase if transition is not None else res.phase,
            finished_age_s=now - finished,
            retention_s=kept_s,
            pod_gone=pod_gone,
        )
    label = None
    if not active_after and res.labelled_active and not delete:
        label = "false"
    elif active_after and not res.labelled_active:
        label = "true"
    # Every booking of a pod waits for it to be gone once deleted; a hold or a grant has no pod.
    missing = active_after and not res.held_for and not res.granted_to and not res.waits_for_pod_gone
    return Plan(
        status=status if status != current else None,
        transition=transition,
        event=event,
        event_on_reservation=on_reservation,
        delete=delete,
        active_label=label,
        finalizer="add" if missing else None,
    )


def _binds_later(transition: Transition | None, pod: PodSighting, *, now: float, bind_wait_s: float) -> bool:
    """Whether binding waits: its pod has not run yet and was created less than `bind_wait_s` ago. Its
    start comes with the next pod event, and one status write then says both (issue #31: binding at
    first sight, then recording the start, was two writes for nearly every pod)."""
    return (
        bind_wait_s > 0
        and transition is not None
        and transition.reason == "PodBound"
        and pod.running_since is None
        and now - pod.created_at < bind_wait_s
    )


def _deleted(
    res: GpuReservation,
    *,
    status: ReservationStatus | None,
    transition: Transition | None,
    event: Event | None,
    active_after: bool,
) -> Plan:
    """A reservation whose deletion was requested (its namespace deleted, its pod deleted in the
    foreground, or by hand) follows the same lifecycle, but writes nothing the deletion makes moot:
    while it holds memory for a pod that may still run, it stays and counts; once it has ended (its
    pod gone or finished, or none within the TTL), the finalizer is removed and it goes."""
    if active_after:
        # The status still matters here: Reserved -> Bound records the pod it now waits for.
        return Plan(status=status, transition=transition, event=event, deletion_waits=res.waits_for_pod_gone)
    return Plan(transition=transition, event=event, finalizer="remove" if res.waits_for_pod_gone else None)


ABSENCE = ("PodDeleted", "PodNeverCreated")
"""Transitions taken for want of a pod."""
