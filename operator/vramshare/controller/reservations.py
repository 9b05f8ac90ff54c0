"""The reservation reconciler: each GpuReservation kept in step with its pod.

`plan()` is pure: from the reservation, what is known of its pod, whether its GPU is missing and the
time, it returns the status to write, the ownerReference to add, the event to post on the pod and
whether to delete the reservation. `ReservationReconciler` applies plans: for every reservation on a
sweep, and at once for a pod event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog

from vramshare.controller.settings import ControllerSettings
from vramshare.domain import PodState, ReservationPhase, Transition, due_for_cleanup, next_phase
from vramshare.domain.inventory import GpuPresence
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.events import Event, Involved, post_event
from vramshare.kube.objects import GpuReservation, OwnerRef, ReservationStatus
from vramshare.kube.resources import LABEL_ACTIVE, LABEL_RESERVATION, parse_time, reservations_path

log = structlog.get_logger("vramshare.controller")


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
class Plan:
    status: ReservationStatus | None = None
    """The status to write; None when it stays as it is."""
    transition: Transition | None = None
    owner: PodInfo | None = None
    event: Event | None = None
    delete: bool = False
    deactivate: bool = False
    """Label the reservation inactive: it has ended, and the webhook's LIST should skip it."""

    @property
    def empty(self) -> bool:
        return not (self.status or self.owner or self.event or self.delete or self.deactivate)


def _event(res: GpuReservation, transition: Transition) -> Event | None:
    spec = res.spec
    match transition.phase:
        case ReservationPhase.BOUND:
            return Event(
                type="Normal",
                reason="GpuReserved",
                message=f"Reserved {spec.memory_mib} MiB on {spec.gpu_uuid} "
                f"({spec.node_name}, index {spec.gpu_index})",
            )
        case ReservationPhase.LOST:
            return Event(
                type="Warning",
                reason="GpuLost",
                message=f"GPU {spec.gpu_uuid} ({spec.node_name}) is no longer reported by DCGM; "
                f"its reservation of {spec.memory_mib} MiB is Lost",
            )
        case ReservationPhase.RELEASED:
            return Event(
                type="Normal",
                reason="GpuReleased",
                message=f"Released {spec.memory_mib} MiB on {spec.gpu_uuid} ({transition.message})",
            )
        case _:
            return None


def plan(
    *,
    res: GpuReservation,
    pod: PodInfo | None,
    gpu_missing: bool,
    now: float,
    ttl_s: float,
    retention_s: float,
) -> Plan:
    current = res.status
    status = current
    if current.phase is None:
        status = replace(status, phase=res.phase)  # make the implicit Reserved visible to kubectl
    owner = None
    active = res.phase.is_active
    if pod is not None and active:
        if current.pod_uid != pod.uid:
            status = replace(status, pod_uid=pod.uid)
        if pod.running_since is not None and current.pod_running_since is None:
            status = replace(status, pod_running_since=pod.running_since)
        if not any(o.uid == pod.uid for o in res.meta.owners):
            owner = pod
    transition = next_phase(
        phase=res.phase,
        pod=pod.state if pod is not None else PodState.ABSENT,
        gpu_missing=gpu_missing,
        age_s=now - (res.meta.created_at or 0.0),
        ttl_s=ttl_s,
    )
    event = None
    if transition is not None:
        status = replace(status, phase=transition.phase, reason=transition.reason, message=transition.message)
        if transition.phase is not ReservationPhase.BOUND:
            status = replace(status, finished_at=now)
        event = _event(res, transition) if pod is not None else None  # no pod to tell
    delete = False
    if transition is None and not active:
        finished = current.finished_at if current.finished_at is not None else (res.meta.created_at or 0.0)
        delete = due_for_cleanup(phase=res.phase, finished_age_s=now - finished, retention_s=retention_s)
    ended = (transition is not None and not transition.phase.is_active) or not active
    return Plan(
        status=status if status != current else None,
        transition=transition,
        owner=owner,
        event=event,
        delete=delete,
        deactivate=ended and res.labelled_active and not delete,
    )


class ReservationReconciler:
    """Applies the lifecycle to reservations: all of them on a sweep, one on a pod event."""

    def __init__(
        self, *, kube: KubeClient, settings: ControllerSettings, clock: Callable[[], float] = time.time
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.clock = clock

    async def run(self, *, presence: Callable[[], GpuPresence]) -> None:
        """Sweep every lifecycle interval, with the inventory's latest word on which GPUs are gone."""
        while True:
            try:
                await self.sweep(presence=presence())
            except Exception as exc:
                log.warning("reservation sweep failed", error=str(exc))
            await asyncio.sleep(self.settings.lifecycle_interval_s)

    async def sweep(self, *, presence: GpuPresence) -> int:
        """Check every reservation against its pod; returns how many changed."""
        # Reservations first: a pod that bound one existed before it was listed, so the pod list
        # below has it unless it is really gone.
        reservations = (await self.kube.list(reservations_path())).get("items", [])
        pods = (await self.kube.list("/api/v1/pods", label_selector=LABEL_RESERVATION)).get("items", [])
        by_reservation = {
            (p["metadata"]["namespace"], p["metadata"]["labels"][LABEL_RESERVATION]): p for p in pods
        }
        changed = 0
        for obj in reservations:
            res = GpuReservation.from_wire(obj)
            pod = by_reservation.get((res.namespace, res.name))
            info = PodInfo.from_pod(pod) if pod is not None else None
            if await self.reconcile(res, info, presence=presence):
                changed += 1
        return changed

    async def pod_changed(self, pod: Obj, *, deleted: bool, presence: GpuPresence) -> None:
        """React to one pod event at once, instead of waiting for the next sweep."""
        meta = pod["metadata"]
        name = (meta.get("labels") or {}).get(LABEL_RESERVATION)
        if not name:
            return
        try:
            obj = await self.kube.get(reservations_path(meta["namespace"], name))
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        info = None if deleted else PodInfo.from_pod(pod)
        await self.reconcile(GpuReservation.from_wire(obj), info, presence=presence)

    async def reconcile(self, res: GpuReservation, pod: PodInfo | None, *, presence: GpuPresence) -> bool:
        now = self.clock()
        the_plan = plan(
            res=res,
            pod=pod,
            gpu_missing=presence.is_missing(res.spec.gpu_uuid),
            now=now,
            ttl_s=self.settings.reservation_ttl_s,
            retention_s=self.settings.retention_s,
        )
        if the_plan.empty:
            return False
        await self._apply(res, pod=pod, the_plan=the_plan, now=now)
        if the_plan.transition is not None or the_plan.delete:
            log.info(
                "reservation",
                reservation=res.key,
                phase=the_plan.transition.phase.value if the_plan.transition else None,
                reason=the_plan.transition.reason if the_plan.transition else None,
                deleted=the_plan.delete,
                gpu=res.spec.gpu_uuid,
                pod=pod.name if pod else None,
            )
        return True

    async def _apply(self, res: GpuReservation, *, pod: PodInfo | None, the_plan: Plan, now: float) -> None:
        """Carry out a plan made from `res`; nothing happens if `res` changed meanwhile (a pod event and
        a sweep may plan the same change: the precondition lets exactly one of them act and post the
        event)."""
        path = reservations_path(res.namespace, res.name)
        version = res.meta.resource_version
        try:
            if the_plan.delete:
                await self.kube.delete(path, resource_version=version)
                return
            if the_plan.owner is not None:
                owner = OwnerRef(
                    api_version="v1", kind="Pod", name=the_plan.owner.name, uid=the_plan.owner.uid
                )
                refs = [o.to_wire() for o in (*res.meta.owners, owner)]
                patched = await self.kube.merge_patch(
                    path, {"metadata": {"resourceVersion": version, "ownerReferences": refs}}
                )
                version = patched["metadata"]["resourceVersion"]
            if the_plan.status is not None:
                patched = await self.kube.merge_patch(
                    f"{path}/status",
                    {"metadata": {"resourceVersion": version}, "status": the_plan.status.to_wire()},
                )
                version = patched["metadata"]["resourceVersion"]
            if the_plan.deactivate:
                await self.kube.merge_patch(
                    path, {"metadata": {"resourceVersion": version, "labels": {LABEL_ACTIVE: "false"}}}
                )
        except ApiError as exc:
            if exc.not_found or exc.conflict:  # deleted or changed meanwhile: the next look decides again
                return
            raise
        if the_plan.event is not None and pod is not None:
            await post_event(
                self.kube,
                namespace=res.namespace,
                involved=Involved(
                    api_version="v1", kind="Pod", name=pod.name, uid=pod.uid, namespace=res.namespace
                ),
                event=the_plan.event,
                now=now,
                reporter=self.settings.identity,
            )
