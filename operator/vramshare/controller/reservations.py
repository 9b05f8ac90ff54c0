"""The reservation reconciler: each GpuReservation kept in step with its pod.

`plan()` is pure: from the reservation, what is known of its pod, whether its GPU is missing and the
time, it returns the status to write, the event to post on the pod and whether to delete the
reservation.

`ReservationReconciler` applies plans: for every reservation on a sweep, and at once for a pod event.

No ownerReference is written (issue #31): it was a second write per admitted pod (status is a
subresource, so it could not share the Bound status's), and all it did is now done here: a booking
is deleted once the pod it was bound to is gone, and its finalizer (set at creation) keeps it
counting until then however it is deleted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Literal

import structlog

from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain import (
    PodSighting,
    PodState,
    ReservationPhase,
    Transition,
    due_for_cleanup,
    genuine_pod,
    next_phase,
)
from vramshare.domain.headroom import booked_past_capacity
from vramshare.domain.inventory import GpuPresence
from vramshare.domain.lifecycle import belongs, stuck_unschedulable
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.conditional import read_reservation
from vramshare.kube.events import Event, Involved, post_event
from vramshare.kube.objects import (
    GpuReservation,
    ReservationStatus,
    remove_finalizer,
)
from vramshare.kube.resources import (
    ANNOTATION_GPU_UUID,
    API_VERSION,
    FINALIZER_POD_GONE,
    LABEL_ACTIVE,
    LABEL_RESERVATION,
    LABEL_SET,
    device_name,
    parse_time,
    reservations_path,
)

log = structlog.get_logger("vramshare.controller")


def pod_sighting(pod: Obj) -> PodSighting:
    """What the lifecycle needs of a pod carrying a reservation's label."""
    meta, status = pod["metadata"], pod.get("status") or {}
    starts = []
    for c in status.get("containerStatuses") or []:
        state = c.get("state") or {}
        started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
        if started:
            starts.append(parse_time(started))
    phase = str(status.get("phase") or "Pending")
    scheduled: Obj = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    unschedulable = scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
    return PodSighting(
        unschedulable_since=parse_time(scheduled.get("lastTransitionTime")) or 0.0 if unschedulable else None,
        unschedulable_message=str(scheduled.get("message") or "") if unschedulable else "",
        name=meta["name"],
        uid=meta["uid"],
        created_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        state=PodState.FINISHED if phase in ("Succeeded", "Failed") else PodState.ACTIVE,
        running_since=min((s for s in starts if s is not None), default=None),
        gpu_uuid=(meta.get("annotations") or {}).get(ANNOTATION_GPU_UUID),
    )


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

    @property
    def empty(self) -> bool:
        return not (self.status or self.event or self.delete or self.active_label or self.finalizer)


def _event(res: GpuReservation, transition: Transition) -> Event | None:
    spec = res.spec
    gpu = (
        f"{spec.gpu_uuid} ({spec.node_name}, index {spec.gpu_index})"
        if spec.placed
        else "no GPU yet (queued)"
    )
    match transition.reason:
        case "PodBound":
            return Event(
                type="Normal", reason="GpuReserved", message=f"Reserved {spec.memory_mib} MiB on {gpu}"
            )
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


def _involving(res: GpuReservation) -> Involved:
    """The GpuReservation itself as an event's object (for what happens to it with no pod to tell)."""
    return Involved(
        api_version=API_VERSION,
        kind="GpuReservation",
        name=res.name,
        uid=res.meta.uid,
        namespace=res.namespace,
    )


def plan(
    *,
    res: GpuReservation,
    pod: PodSighting | None,
    gpu_missing: bool,
    now: float,
    ttl_s: float,
    retention_s: float,
    hold_limit_s: float = float("inf"),
    bind_wait_s: float = 0.0,
    pod_deleted: bool = False,
) -> Plan:
    """What to write for `res` now. `pod_deleted`: its pod's deletion was just seen (it may have gone
    before its booking was bound: see `bind_wait_s`)."""
    current = res.status
    seen = bool(current.pod_uid) or pod_deleted
    status = current
    if current.phase is not res.phase:
        # Make the implicit phase visible to kubectl: Reserved when just committed or placed, Queued
        # again when a placement was withdrawn.
        status = replace(status, phase=res.phase)
    transition = next_phase(
        phase=res.phase,
        pod=pod.state if pod is not None else PodState.ABSENT,
        gpu_missing=gpu_missing,
        age_s=now - (res.meta.created_at or 0.0),
        ttl_s=ttl_s,
        seen=seen,
        hold_limit_s=hold_limit_s,
    )
    if pod is not None and _binds_later(transition, pod, now=now, bind_wait_s=bind_wait_s):
        return Plan(bind_at=pod.created_at + bind_wait_s)
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
        event = _event(res, transition)
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
        delete = due_for_cleanup(
            phase=transition.phase if transition is not None else res.phase,
            finished_age_s=now - finished,
            retention_s=retention_s,
            pod_gone=pod_gone,
        )
    label = None
    if not active_after and res.labelled_active and not delete:
        label = "false"
    elif active_after and not res.labelled_active:
        label = "true"
    # Every booking of a pod waits for it to be gone once deleted; a hold has no pod to wait for.
    missing = active_after and not res.held_for and not res.waits_for_pod_gone
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


_ABSENCE = ("PodDeleted", "PodNeverCreated")
"""Transitions taken for want of a pod."""


class ReservationReconciler:
    """Applies the lifecycle to reservations: all of them on a sweep, one on a pod event, and each new
    booking again the moment its pod should have appeared (`reservation_changed`)."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
        state: ClusterState,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self.state = state
        self.clock = clock
        self._deadlines: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._binds: dict[tuple[str, str], asyncio.TimerHandle] = {}
        """Bookings whose binding waits for their pod to run, with the look due when it waits no more."""
        self._checks: set[asyncio.Task[None]] = set()
        self._announced: set[tuple[str, str]] = set()
        self._stuck: dict[str, str] = {}
        """Reservation key -> UID of its pod that has been unschedulable too long (warned once)."""
        """(reservation, impostor pod UID) pairs already reported, so each gets one event."""

    async def run(self, *, presence: Callable[[], GpuPresence]) -> None:
        """Sweep every lifecycle interval, with the inventory's latest word on which GPUs are gone."""
        try:
            while True:
                try:
                    await self.sweep(presence=presence())
                except Exception as exc:
                    log.warning("reservation sweep failed", error=str(exc))
                await asyncio.sleep(self.settings.lifecycle_interval_s)
        finally:
            for handle in (*self._deadlines.values(), *self._binds.values()):
                handle.cancel()
            self._deadlines.clear()
            self._binds.clear()

    async def sweep(self, *, presence: GpuPresence) -> int:
        """Check every reservation against its pod, from the watch caches; returns how many changed.
        A conclusion that its pod is gone or never came is confirmed with a direct read first."""
        by_reservation = self.state.pods_by_reservation()
        changed = 0
        current = list(self.state.reservations.items.values())
        for res in current:
            labelled = by_reservation.get((res.namespace, res.pod_label), [])
            if await self.reconcile(res, labelled, presence=presence, confirm_absence=True):
                changed += 1
        keys = {r.key for r in current}
        # Said-once notes of reservations that no longer exist are forgotten.
        self._announced = {note for note in self._announced if note[0] in keys}
        gone = self._stuck.keys() - keys  # deleted with their pod
        if gone:
            for key in gone:
                del self._stuck[key]
            self.metrics.unschedulable_pods.set(len(set(self._stuck.values())))
        return changed

    async def pod_changed(self, pod: Obj, *, deleted: bool, presence: GpuPresence) -> None:
        """React to one pod event at once, instead of waiting for the next sweep."""
        meta = pod["metadata"]
        name = (meta.get("labels") or {}).get(LABEL_RESERVATION)
        if not name or not meta.get("uid"):
            return
        # From the watch cache, not a GET per pod event (issue #31: over one read per admitted pod).
        # A cached version that is behind only costs a conflict: every write carries its
        # resourceVersion, and a conflict looks again on a fresh read.
        res = self.state.reservations.items.get(f"{meta['namespace']}/{name}") or await self._get(
            meta["namespace"], name
        )
        if res is None:
            return
        members = [res]
        if res.spec.gpu_count > 1:  # a pod with several GPUs: one booking each, all under its label
            listed = await self.kube.list(
                reservations_path(res.namespace), label_selector=f"{LABEL_SET}={name}"
            )
            members = [GpuReservation.from_wire(o) for o in listed.get("items", [])]
        sighting = pod_sighting(pod)
        for member in members:
            if not belongs(member.to_domain(), sighting, bound_uid=member.status.pod_uid):
                if not deleted:
                    await self._announce_impostor(member, sighting, now=self.clock())
                continue  # another pod's event says nothing about this reservation's own pod
            await self.reconcile(member, [] if deleted else [pod], presence=presence, pod_deleted=deleted)

    def reservation_changed(self, res: GpuReservation, *, presence: Callable[[], GpuPresence]) -> None:
        """A reservation was created or changed: while it waits for its pod, look again at its TTL, so
        a booking whose pod never appears stops counting on time, not at the next sweep."""
        self._arm(res, presence=presence)

    def _arm(self, res: GpuReservation, *, presence: Callable[[], GpuPresence]) -> None:
        key = (res.namespace, res.name)
        if res.meta.deleting and res.waits_for_pod_gone:
            # Deleted: look now whether its pod is gone, so it (and its namespace) go without waiting
            # for the next sweep; if the pod still runs, its pod's events bring the next look.
            if key in self._deadlines:
                self._deadlines.pop(key).cancel()
            self._spawn(self._look_again(key, presence()))
            return
        if not res.labelled_active:
            return
        waiting = res.phase in (ReservationPhase.RESERVED, ReservationPhase.QUEUED) and not res.status.pod_uid
        if not waiting or key in self._deadlines:
            if not waiting and key in self._deadlines:
                self._deadlines.pop(key).cancel()
            return
        delay = max(0.0, (res.meta.created_at or 0.0) + self.settings.reservation_ttl_s - self.clock()) + 0.5
        loop = asyncio.get_running_loop()

        def due() -> None:
            self._deadlines.pop(key, None)
            self._spawn(self._look_again(key, presence()))

        self._deadlines[key] = loop.call_later(delay, due)

    def _bind_later(
        self, res: GpuReservation, pod: PodSighting, *, at: float, now: float, presence: GpuPresence
    ) -> None:
        """Look at `res` again when its binding waits no more, from the watch caches (no read): by then
        the pod's next event has usually bound it, and the look finds nothing to do."""
        key = (res.namespace, res.name)
        if key in self._binds:
            return

        def due() -> None:
            self._binds.pop(key, None)
            current = self.state.reservations.items.get(res.key)
            pod_now = self.state.pods.items.get(f"{res.namespace}/{pod.name}")
            if current is None or current.status.pod_uid:
                return  # gone, or bound meanwhile
            self._spawn(self._reconcile_quietly(current, [pod_now] if pod_now is not None else [], presence))

        self._binds[key] = asyncio.get_running_loop().call_later(max(0.0, at - now) + 0.1, due)

    async def _reconcile_quietly(self, res: GpuReservation, pods: list[Obj], presence: GpuPresence) -> None:
        try:
            await self.reconcile(res, pods, presence=presence, confirm_absence=True)
        except Exception as exc:  # the sweep catches it later
            log.warning("reservation check failed", reservation=res.key, error=str(exc))

    def _spawn(self, check: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(check)
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _look_again(self, key: tuple[str, str], presence: GpuPresence) -> None:
        try:
            res = await self._get(*key)
            if res is None:
                return
            pods = await self.kube.list(
                f"/api/v1/namespaces/{key[0]}/pods", label_selector=f"{LABEL_RESERVATION}={res.pod_label}"
            )
            await self.reconcile(res, pods.get("items", []), presence=presence)
            early = self.clock() - (res.meta.created_at or 0.0) < self.settings.reservation_ttl_s
            if early and not pods.get("items") and not res.meta.deleting:
                # Looked at a moment early (the API server's clock is estimated to within about half
                # a second): look again when it is due, not at the next sweep.
                self._arm(res, presence=lambda: presence)
        except Exception as exc:  # the sweep catches it later
            log.warning("reservation check failed", reservation=f"{key[0]}/{key[1]}", error=str(exc))

    async def _get(self, namespace: str, name: str) -> GpuReservation | None:
        return await read_reservation(self.kube, namespace, name)

    async def reconcile(
        self,
        res: GpuReservation,
        labelled: list[Obj],
        *,
        presence: GpuPresence,
        confirm_absence: bool = False,
        pod_deleted: bool = False,
    ) -> bool:
        """Move `res` on, given the pods that carry its label (its own, and any impostors). With
        `confirm_absence` (the pods came from a cache), a transition for want of its pod is taken only
        after a direct read of the pods carrying its label agrees."""
        now = self.clock()
        sightings = [pod_sighting(p) for p in labelled if p["metadata"].get("uid")]
        pod, impostors = genuine_pod(res.to_domain(), sightings, bound_uid=res.status.pod_uid)
        for impostor in impostors:
            await self._announce_impostor(res, impostor, now=now)
        await self._check_schedulable(res, pod, now=now)
        the_plan = plan(
            res=res,
            pod=pod,
            gpu_missing=presence.is_missing(res.spec.gpu_uuid),
            now=now,
            ttl_s=self.settings.reservation_ttl_s,
            retention_s=self.settings.retention_s,
            hold_limit_s=self.settings.hold_limit_s,
            bind_wait_s=self.settings.bind_wait_s,
            pod_deleted=pod_deleted,
        )
        if the_plan.bind_at is not None and pod is not None:
            self._bind_later(res, pod, at=the_plan.bind_at, now=now, presence=presence)
        if the_plan.deletion_waits:
            await self._announce_deletion_wait(res, pod, now=now)
        if the_plan.empty:
            return False
        if the_plan.transition is not None and the_plan.transition.reason == "PodAppearedLate":
            the_plan = self._late_on_a_full_gpu(res, the_plan)
        if confirm_absence and the_plan.transition is not None and the_plan.transition.reason in _ABSENCE:
            listed = await self.kube.list(
                f"/api/v1/namespaces/{res.namespace}/pods",
                label_selector=f"{LABEL_RESERVATION}={res.pod_label}",
            )
            if listed.get("items"):  # the cache was behind: decide on what is really there
                return await self.reconcile(res, listed["items"], presence=presence)
        if not await self._apply(res, pod=pod, the_plan=the_plan, now=now):
            # It changed under us (another write of ours, or someone else's): look again on a fresh
            # read now, rather than leave a due transition to the next sweep.
            if the_plan.transition is not None or the_plan.finalizer == "remove":
                self._spawn(self._look_again((res.namespace, res.name), presence))
            return False
        if the_plan.transition is not None:
            self.metrics.transitions.labels(the_plan.transition.phase.value, the_plan.transition.reason).inc()
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

    def _late_on_a_full_gpu(self, res: GpuReservation, the_plan: Plan) -> Plan:
        """A pod that appeared after its booking expired counts again, whatever its GPU holds since: it
        runs there. If the GPU is now booked past what it can hold, say so (vramshare evicts nothing):
        no pod is admitted there until that much frees, since its headroom is below zero."""
        device = self.state.devices.items.get(f"/{device_name(res.spec.gpu_uuid)}")
        gpu = device.to_domain() if device is not None else None
        if gpu is None or the_plan.event is None:
            return the_plan
        counted = [
            r.to_domain()
            for r in self.state.reservations.items.values()
            if r.phase.is_active and r.spec.gpu_uuid == gpu.uuid and r.key != res.key
        ]
        mine = replace(res.to_domain(), phase=ReservationPhase.BOUND)
        over = booked_past_capacity(
            gpu, [*counted, mine], safety_margin_mib=self.settings.accounting.safety_margin_mib
        )
        if not over:
            return the_plan
        self.metrics.overbooked_by_late_pods.inc()
        log.warning(
            "a pod appeared after its booking expired; its GPU is now booked past what it can hold",
            reservation=res.key,
            gpu=gpu.uuid,
            over_mib=over,
        )
        message = (
            f"{the_plan.event.message}. GPU {gpu.label} is now booked {over} MiB past what it can hold "
            "(memory given to others while this booking had expired): no pod is admitted there until "
            "that much frees; vramshare evicts nothing"
        )
        return replace(the_plan, event=replace(the_plan.event, message=message))

    async def _check_schedulable(self, res: GpuReservation, pod: PodSighting | None, *, now: float) -> None:
        """Warn once (event and gauge) when a booking's pod stays unschedulable: its memory is held for
        a pod that does not run."""
        after_s = self.settings.unschedulable_warning_s
        if pod is None or not stuck_unschedulable(res.phase, pod, now=now, after_s=after_s):
            if self._stuck.pop(res.key, None) is not None:
                self.metrics.unschedulable_pods.set(len(set(self._stuck.values())))
            return
        if self._stuck.get(res.key) == pod.uid:
            return
        told = pod.uid in self._stuck.values()  # a pod with several GPUs is warned about once
        self._stuck[res.key] = pod.uid
        self.metrics.unschedulable_pods.set(len(set(self._stuck.values())))
        if told:
            return
        spec = res.spec
        log.warning("booked pod unschedulable", reservation=res.key, pod=pod.name, node=spec.node_name)
        await post_event(
            self.kube,
            namespace=res.namespace,
            involved=Involved(
                api_version="v1", kind="Pod", name=pod.name, uid=pod.uid, namespace=res.namespace
            ),
            event=Event(
                type="Warning",
                reason="GpuPodUnschedulable",
                message=f"The pod has not been schedulable for {after_s:g} s onto node {spec.node_name}, "
                f"where its {spec.memory_mib} MiB are booked on GPU {spec.gpu_uuid}; the memory stays booked "
                "until the pod is deleted. The scheduler says: "
                f"{pod.unschedulable_message or 'no reason given'}",
            ),
            now=now,
            reporter=self.settings.identity,
        )

    async def _announce_deletion_wait(
        self, res: GpuReservation, pod: PodSighting | None, *, now: float
    ) -> None:
        """Say once why a deleted GpuReservation (and so its namespace, if that is being deleted) is
        still there: its pod may still hold the memory."""
        key = (res.key, "deletion")
        if key in self._announced:
            return
        self._announced.add(key)
        whose = f"pod {pod.name}" if pod is not None else f"pod {res.spec.pod_name}, if it appears,"
        message = (
            f"Deletion requested; the {res.spec.memory_mib} MiB on {res.spec.gpu_uuid or 'no GPU yet'} stay "
            f"booked until {whose} has terminated (finalizer {FINALIZER_POD_GONE})"
        )
        log.info("deleted booking waits for its pod", reservation=res.key, pod=pod.name if pod else None)
        await post_event(
            self.kube,
            namespace=res.namespace,
            involved=_involving(res),
            event=Event(type="Normal", reason="ReleaseWaitsForPod", message=message),
            now=now,
            reporter=self.settings.identity,
        )

    async def _announce_impostor(self, res: GpuReservation, impostor: PodSighting, *, now: float) -> None:
        key = (res.key, impostor.uid)
        if key in self._announced:
            return
        self._announced.add(key)
        uid = res.status.pod_uid
        owner = f"the pod with UID {uid}" if uid else f"pod {res.spec.pod_name}"
        message = (
            f"Pod {impostor.name} carries label {LABEL_RESERVATION}={res.pod_label}, but reservation "
            f"{res.name} of {res.spec.memory_mib} MiB on {res.spec.gpu_uuid} belongs to {owner}; the label "
            "is ignored and this pod has no GPU memory booked"
        )
        log.warning("impostor pod ignored", reservation=res.key, pod=impostor.name)
        self.metrics.impostor_pods.inc()
        await post_event(
            self.kube,
            namespace=res.namespace,
            involved=Involved(
                api_version="v1", kind="Pod", name=impostor.name, uid=impostor.uid, namespace=res.namespace
            ),
            event=Event(type="Warning", reason="ReservationNotYours", message=message),
            now=now,
            reporter=self.settings.identity,
        )

    async def _apply(
        self, res: GpuReservation, *, pod: PodSighting | None, the_plan: Plan, now: float
    ) -> bool:
        """Carry out a plan made from `res`; nothing happens if `res` changed meanwhile (a pod event and
        a sweep may plan the same change: the precondition lets exactly one of them act and post the
        event). False when it had changed (or was gone)."""
        path = reservations_path(res.namespace, res.name)
        version = res.meta.resource_version
        patched: Obj | None = None
        try:
            if the_plan.delete or the_plan.finalizer == "remove":
                if res.waits_for_pod_gone:
                    # Planned from the version read, as every write here is: a stale copy fails (422)
                    # and is looked at again.
                    unchanged = {"op": "test", "path": "/metadata/resourceVersion", "value": version}
                    patched = await self.kube.json_patch(
                        path, [unchanged, *remove_finalizer(res.meta, FINALIZER_POD_GONE)]
                    )
                    version = patched["metadata"]["resourceVersion"]
                if the_plan.delete:
                    await self.kube.delete(path, resource_version=version)
                    return True
            if the_plan.finalizer == "add":  # a booking made before the finalizer existed, or by hand
                finalizers = [*res.meta.finalizers, FINALIZER_POD_GONE]
                patched = await self.kube.merge_patch(
                    path, {"metadata": {"finalizers": finalizers, "resourceVersion": version}}
                )
                version = patched["metadata"]["resourceVersion"]
            if the_plan.status is not None:
                # observedGeneration: the spec this status was judged for (API conventions).
                judged = replace(the_plan.status, observed_generation=res.meta.generation or None)
                before, after = res.status.to_wire(), judged.to_wire()
                cleared = {k: None for k in before if k not in after}  # a merge patch removes with null
                patched = await self.kube.merge_patch(
                    f"{path}/status",
                    {"metadata": {"resourceVersion": version}, "status": {**after, **cleared}},
                )
                version = patched["metadata"]["resourceVersion"]
            if the_plan.active_label is not None:
                patched = await self.kube.merge_patch(
                    path,
                    {
                        "metadata": {
                            "resourceVersion": version,
                            "labels": {LABEL_ACTIVE: the_plan.active_label},
                        }
                    },
                )
        except ApiError as exc:
            # Deleted or changed meanwhile (a finalizer list that moved fails its test op: 422): the
            # next look decides again.
            if exc.not_found or exc.conflict or exc.status == 422:
                return False
            raise
        if patched is not None:
            # The next pod event plans from this version, not from the one its watch event replaces.
            self.state.reservations.put(
                res.key,
                GpuReservation.from_wire(patched),
                resource_version=patched["metadata"]["resourceVersion"],
            )
        if the_plan.event is None:
            return True
        if the_plan.event_on_reservation:
            involved = _involving(res)
        elif pod is not None:
            involved = Involved(
                api_version="v1", kind="Pod", name=pod.name, uid=pod.uid, namespace=res.namespace
            )
        else:
            return True
        await post_event(
            self.kube,
            namespace=res.namespace,
            involved=involved,
            event=the_plan.event,
            now=now,
            reporter=self.settings.identity,
        )
        return True
