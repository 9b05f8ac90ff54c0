"""What the reservation reconciler tells users, as events: each worded from the booking and what
happened to it (pure: the reconciler posts them)."""

from __future__ import annotations

from dataclasses import replace

from vramshare.domain import (
    PodSighting,
    Transition,
)
from vramshare.kube.events import Event, Involved
from vramshare.kube.objects import (
    GpuReservation,
)
from vramshare.kube.resources import (
    API_VERSION,
    FINALIZER_POD_GONE,
    LABEL_RESERVATION,
)


def event_for(res: GpuReservation, transition: Transition) -> Event | None:
    spec = res.spec
    gpu = (
        f"{spec.gpu_uuid} ({spec.node_name}, index {spec.gpu_index})"
        if spec.placed
        else "no GPU yet (queued)"
    )
    match transition.reason:
        case "PodBound":
            # No event: `kubectl describe pod` shows the booking in the pod's own annotations
            # (vramshare.io/gpu-uuid, vramshare.io/reservation), written at admission, and an event per
            # pod was one API write per admitted pod (issue #45). Events are for what is unusual.
            return None
        case "GpuMissing":
            return Event(
                type="Warning",
                reason="GpuLost",
                message=f"GPU {gpu} is no longer reported by DCGM; the reservation of {spec.memory_mib} MiB "
                "is kept while the pod runs and counts again when the GPU returns",
            )
        case "GpuReturned":
            return Event(type="Normal", reason="GpuReturned", message=f"GPU {gpu} is reported by DCGM again")
        case "PodAppearedLate":
            return Event(
                type="Warning",
                reason="GpuReservedLate",
                message=f"The pod appeared after its reservation of {spec.memory_mib} MiB on {gpu} had "
                "expired; the reservation counts again (check the GPU for overuse)",
            )
        case "PodNeverCreated":
            return Event(
                type="Warning",
                reason="PodNeverCreated",
                message=f"No pod {res.namespace}/{spec.pod_name} appeared for this reservation of "
                f"{spec.memory_mib} MiB on {gpu}: {transition.message}; the memory is free again",
            )
        case "PodFinished" | "PodDeleted":
            return Event(
                type="Normal",
                reason="GpuReleased",
                message=f"Released {spec.memory_mib} MiB on {spec.gpu_uuid or 'no GPU yet (queued)'} "
                f"({transition.message})",
            )
        case _:
            return None


def involving(res: GpuReservation) -> Involved:
    """The GpuReservation itself as an event's object (for what happens to it with no pod to tell)."""
    return Involved(
        api_version=API_VERSION,
        kind="GpuReservation",
        name=res.name,
        uid=res.meta.uid,
        namespace=res.namespace,
    )


def on_pod(res: GpuReservation, pod: PodSighting) -> Involved:
    """The booking's pod as an event's object."""
    return Involved(api_version="v1", kind="Pod", name=pod.name, uid=pod.uid, namespace=res.namespace)


def unschedulable(res: GpuReservation, pod: PodSighting, *, after_s: float) -> Event:
    spec = res.spec
    return Event(
        type="Warning",
        reason="GpuPodUnschedulable",
        message=f"The pod has not been schedulable for {after_s:g} s onto node {spec.node_name}, "
        f"where its {spec.memory_mib} MiB are booked on GPU {spec.gpu_uuid}; the memory stays booked "
        "until the pod is deleted. The scheduler says: "
        f"{pod.unschedulable_message or 'no reason given'}",
    )


def deletion_waits(res: GpuReservation, pod: PodSighting | None) -> Event:
    whose = f"pod {pod.name}" if pod is not None else f"pod {res.spec.pod_name}, if it appears,"
    message = (
        f"Deletion requested; the {res.spec.memory_mib} MiB on {res.spec.gpu_uuid or 'no GPU yet'} stay "
        f"booked until {whose} has terminated (finalizer {FINALIZER_POD_GONE})"
    )
    return Event(type="Normal", reason="ReleaseWaitsForPod", message=message)


def not_yours(res: GpuReservation, impostor: PodSighting) -> Event:
    uid = res.status.pod_uid
    owner = f"the pod with UID {uid}" if uid else f"pod {res.spec.pod_name}"
    message = (
        f"Pod {impostor.name} carries label {LABEL_RESERVATION}={res.pod_label}, but reservation "
        f"{res.name} of {res.spec.memory_mib} MiB on {res.spec.gpu_uuid} belongs to {owner}; the label "
        "is ignored and this pod has no GPU memory booked"
    )
    return Event(type="Warning", reason="ReservationNotYours", message=message)


def booked_past_capacity_note(event: Event, *, gpu_label: str, over_mib: int) -> Event:
    """A late pod's event, saying its GPU is now booked past what it can hold."""
    message = (
        f"{event.message}. GPU {gpu_label} is now booked {over_mib} MiB past what it can hold "
        "(memory given to others while this booking had expired): no pod is admitted there until "
        "that much frees; vramshare evicts nothing"
    )
    return replace(event, message=message)
