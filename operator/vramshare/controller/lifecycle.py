"""Reconciling one reservation with its pod: the domain's transition, expressed as API changes.

`plan()` is pure: from the GpuReservation object, what is known of its pod, whether its GPU is missing
and the time, it returns the status to write, the ownerReference to add, the event to post on the pod
and whether to delete the reservation. `apply()` performs a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramshare.domain import PodState, ReservationPhase, due_for_cleanup, next_phase
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.resources import (
    LABEL_ACTIVE,
    format_time,
    parse_time,
    reservation_from_object,
    reservations_path,
)


@dataclass(frozen=True, kw_only=True)
class PodInfo:
    """What the lifecycle needs of a pod."""

    name: str
    uid: str
    phase: str
    running_since: float | None

    @property
    def state(self) -> PodState:
        return PodState.FINISHED if self.phase in ("Succeeded", "Failed") else PodState.ACTIVE

    @classmethod
    def from_pod(cls, pod: Obj) -> PodInfo:
        status = pod.get("status") or {}
        starts = []
        for c in status.get("containerStatuses") or []:
            state = c.get("state") or {}
            started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
            if started:
                starts.append(parse_time(started))
        running = min((s for s in starts if s is not None), default=None)
        return cls(
            name=pod["metadata"]["name"],
            uid=pod["metadata"]["uid"],
            phase=str(status.get("phase") or "Pending"),
            running_since=running,
        )


@dataclass(frozen=True, kw_only=True)
class PodEvent:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    status: dict[str, Any] = field(default_factory=dict)
    owner: PodInfo | None = None
    event: PodEvent | None = None
    delete: bool = False
    deactivate: bool = False
    """Label the reservation inactive: it has ended, and the webhook's LIST should skip it."""

    @property
    def empty(self) -> bool:
        return not (self.status or self.owner or self.event or self.delete or self.deactivate)


def plan(
    *, obj: Obj, pod: PodInfo | None, gpu_missing: bool, now: float, ttl_s: float, retention_s: float
) -> Plan:
    res = reservation_from_object(obj)
    current = obj.get("status") or {}
    status: dict[str, Any] = {}
    if not current.get("phase"):
        status["phase"] = res.phase.value  # make the implicit Reserved visible to kubectl
    owner = None
    if pod is not None and res.is_active:
        if current.get("podUID") != pod.uid:
            status["podUID"] = pod.uid
        if pod.running_since is not None and not current.get("podRunningSince"):
            status["podRunningSince"] = format_time(pod.running_since)
        owners = obj["metadata"].get("ownerReferences") or []
        if not any(o.get("uid") == pod.uid for o in owners):
            owner = pod
    transition = next_phase(
        phase=res.phase,
        pod=pod.state if pod is not None else PodState.ABSENT,
        gpu_missing=gpu_missing,
        age_s=now - res.reserved_at,
        ttl_s=ttl_s,
    )
    event = None
    if transition is not None:
        status.update(phase=transition.phase.value, reason=transition.reason, message=transition.message)
        if transition.phase is ReservationPhase.BOUND:
            status["boundAt"] = format_time(now)
            event = PodEvent(
                type="Normal",
                reason="GpuReserved",
                message=f"Reserved {res.mib} MiB on {res.gpu_uuid} ({res.node}, index {res.gpu_index})",
            )
        else:
            status["finishedAt"] = format_time(now)
            if transition.phase is ReservationPhase.LOST:
                event = PodEvent(
                    type="Warning",
                    reason="GpuLost",
                    message=f"GPU {res.gpu_uuid} ({res.node}) is no longer reported by DCGM; "
                    f"its reservation of {res.mib} MiB is Lost",
                )
            elif transition.phase is ReservationPhase.RELEASED:
                event = PodEvent(
                    type="Normal",
                    reason="GpuReleased",
                    message=f"Released {res.mib} MiB on {res.gpu_uuid} ({transition.message})",
                )
        if pod is None:
            event = None  # no pod to tell
    delete = False
    if transition is None and not res.is_active:
        finished = res.finished_at if res.finished_at is not None else res.reserved_at
        delete = due_for_cleanup(phase=res.phase, finished_age_s=now - finished, retention_s=retention_s)
    ended = (transition is not None and not transition.phase.is_active) or not res.is_active
    labelled_active = (obj["metadata"].get("labels") or {}).get(LABEL_ACTIVE) != "false"
    return Plan(
        status=status,
        owner=owner,
        event=event,
        delete=delete,
        deactivate=ended and labelled_active and not delete,
    )


async def apply(
    kube: KubeClient, *, obj: Obj, pod: PodInfo | None, the_plan: Plan, now: float, reporter: str
) -> None:
    """Carry out a plan made from `obj`; nothing happens if `obj` changed meanwhile (a pod event and a
    sweep may plan the same change: the precondition lets exactly one of them act and post the event)."""
    meta = obj["metadata"]
    path = reservations_path(meta["namespace"], meta["name"])
    version = meta["resourceVersion"]
    try:
        if the_plan.delete:
            await kube.delete(path, resource_version=version)
            return
        if the_plan.owner is not None:
            owner = the_plan.owner
            refs = [
                *(meta.get("ownerReferences") or []),
                {"apiVersion": "v1", "kind": "Pod", "name": owner.name, "uid": owner.uid},
            ]
            patched = await kube.merge_patch(
                path, {"metadata": {"resourceVersion": version, "ownerReferences": refs}}
            )
            version = patched["metadata"]["resourceVersion"]
        if the_plan.status:
            patched = await kube.merge_patch(
                f"{path}/status", {"metadata": {"resourceVersion": version}, "status": the_plan.status}
            )
            version = patched["metadata"]["resourceVersion"]
        if the_plan.deactivate:
            await kube.merge_patch(
                path, {"metadata": {"resourceVersion": version, "labels": {LABEL_ACTIVE: "false"}}}
            )
    except ApiError as exc:
        if exc.not_found or exc.conflict:  # deleted or changed meanwhile: the next look decides again
            return
        raise
    if the_plan.event is not None and pod is not None:
        await post_event(
            kube,
            namespace=meta["namespace"],
            involved={
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod.name,
                "namespace": meta["namespace"],
                "uid": pod.uid,
            },
            event=the_plan.event,
            now=now,
            reporter=reporter,
        )


async def post_event(
    kube: KubeClient, *, namespace: str, involved: Obj, event: PodEvent, now: float, reporter: str
) -> None:
    stamp = format_time(now)
    await kube.create(
        f"/api/v1/namespaces/{namespace}/events",
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": involved,
            "type": event.type,
            "reason": event.reason,
            "message": event.message,
            "source": {"component": "vramshare-controller"},
            "reportingComponent": "vramshare.io/controller",
            "reportingInstance": reporter,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        },
    )
