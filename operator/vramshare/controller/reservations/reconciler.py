"""The reservation reconciler: applies the lifecycle's plan (`plan`) to each GpuReservation, for every
booking on a sweep, and at once for a pod event or when a booking's wait runs out (`timers`). Which pod
each booking is bound to is kept in memory (`pins`); what it tells people, once, is in `notices`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import structlog

from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.reservations.grants import GrantRenewals
from vramshare.controller.reservations.notices import Notices
from vramshare.controller.reservations.pins import Pins
from vramshare.controller.reservations.plan import ABSENCE, KUBELET_KILL_S, Plan, plan, pod_sighting
from vramshare.controller.reservations.timers import Checks, KeyedTimers
from vramshare.controller.reservations.wording import (
    booked_past_capacity_note,
    involving,
    on_pod,
)
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain import (
    PodSighting,
    ReservationPhase,
    genuine_pod,
)
from vramshare.domain.headroom import booked_past_capacity
from vramshare.domain.inventory import GpuPresence
from vramshare.domain.lifecycle import EndedRecord, belongs, records_past_bound
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.conditional import read_reservation
from vramshare.kube.objects import (
    GpuReservation,
    remove_finalizer,
)
from vramshare.kube.resources import (
    FINALIZER_POD_GONE,
    LABEL_ACTIVE,
    LABEL_RESERVATION,
    LABEL_SET,
    device_name,
    pods_path,
    reservations_path,
)

log = structlog.get_logger("vramshare.controller")


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
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self.state = state
        self.clock = clock
        self._deadlines = KeyedTimers()
        """Bookings waiting for their pod, with the look due when their TTL runs out."""
        self._binds = KeyedTimers()
        """Bookings whose binding waits for their pod to run, with the look due when it waits no more."""
        self._checks = Checks()
        self._releases = KeyedTimers()
        """Bookings whose pod was force-deleted while it ran, with the look due when the kubelet has
        killed its containers."""
        self._running_until: dict[str, float] = {}
        """Reservation key -> when the containers of its force-deleted pod are gone at the latest. Kept
        in memory: after a failover the new leader releases such a booking at its first look."""
        self._renewals = GrantRenewals(clock=monotonic)
        self._notices = Notices(kube=kube, settings=settings, metrics=metrics)
        self._pins = Pins(on_bound=self._bound_now)
        self.watching_since = clock()
        """When this reconciler started: a booking older than this whose pod it never saw may have had
        one that came and went unwatched."""

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
            self._deadlines.cancel_all()
            self._binds.cancel_all()
            self._releases.cancel_all()

    async def sweep(self, *, presence: GpuPresence) -> int:
        """Check every reservation against its pod, from the watch caches; returns how many changed.
        A conclusion that its pod is gone or never came is confirmed with a direct read first."""
        changed = 0
        current = list(self.state.reservations.items.values())
        for res in current:
            # The sightings the pod watch keeps: a sweep decodes no pod.
            labelled = list(self.state.pods_by_label.of(res.namespace, res.pod_label))
            if await self.reconcile(res, labelled, presence=presence, confirm_absence=True):
                changed += 1
        # From the caches as the loop above left them (its writes are in them), not from `current`.
        await self._trim_never_created(list(self.state.reservations.items.values()))
        keys = {r.key for r in current}
        for key in self._running_until.keys() - keys:
            del self._running_until[key]
        self._pins.keep_only(keys)
        self._notices.keep_only(keys)
        self._renewals.keep_only(keys)
        return changed

    async def _trim_never_created(self, current: list[GpuReservation]) -> None:
        """Delete the records of bookings whose pod never appeared beyond the newest
        `never_created_kept_per_namespace` of each namespace (issue #42, 7)."""
        records = {
            (r.namespace, r.name): r
            for r in current
            if r.phase is ReservationPhase.EXPIRED and r.status.reason == "PodNeverCreated"
        }
        excess = records_past_bound(
            (
                EndedRecord(namespace=r.namespace, name=r.name, finished_at=r.status.finished_at or 0.0)
                for r in records.values()
            ),
            keep_per_namespace=self.settings.never_created_kept_per_namespace,
        )
        deleted = 0
        for record in excess:
            # As any cleanup: its finalizer off, then deleted, each on the version judged (a record that
            # changed meanwhile is left to the next sweep).
            res = records[(record.namespace, record.name)]
            deleted += await self._apply(res, pod=None, the_plan=Plan(delete=True), now=self.clock())
        if deleted:
            self.metrics.never_created_trimmed.inc(deleted)
            log.info("records of pods that never appeared trimmed", deleted=deleted)

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
            if not belongs(member.to_domain(), sighting, bound_uid=self._pins.uid_of(member)):
                if not deleted:
                    await self._notices.impostor(
                        self._pins.as_bound(member, None), sighting, now=self.clock()
                    )
                continue  # another pod's event says nothing about this reservation's own pod
            if deleted and sighting.forced_grace_s is not None:
                # Gone while its containers ran (a force delete): the kubelet still gives them their
                # grace period, and they hold the memory until it kills them (issue #42, 9).
                self._running_until[member.key] = self.clock() + sighting.forced_grace_s + KUBELET_KILL_S
                log.info(
                    "pod gone while its containers run; its booking counts until the kubelet kills them",
                    pod=f"{meta['namespace']}/{meta['name']}",
                    grace_s=sighting.forced_grace_s,
                )
            await self.reconcile(
                member, [] if deleted else [sighting], presence=presence, pod_deleted=deleted
            )

    def reservation_changed(self, res: GpuReservation, *, presence: Callable[[], GpuPresence]) -> None:
        """A reservation was created or changed: while it waits for its pod, look again at its TTL, so
        a booking whose pod never appears stops counting on time, not at the next sweep."""
        self._arm(res, presence=presence)

    def _arm(self, res: GpuReservation, *, presence: Callable[[], GpuPresence]) -> None:
        key = (res.namespace, res.name)
        if res.meta.deleting and res.waits_for_pod_gone:
            # Deleted: look now whether its pod is gone, so it (and its namespace) go without waiting
            # for the next sweep; if the pod still runs, its pod's events bring the next look.
            self._deadlines.cancel(key)
            self._checks.spawn(self._look_again(key, presence()))
            return
        if not res.labelled_active:
            return
        if res.phase is ReservationPhase.GRANTED:  # each renewal puts its end further off
            if res.status.phase is not ReservationPhase.GRANTED:
                # Recorded at once: its holder books inside it only once the controller has.
                self._checks.spawn(self._reconcile_quietly(res, [], presence()))
            self._deadlines.cancel(key)
            delay = self._renewals.lapses_in_s(res) + 0.5
            self._deadlines.arm(key, delay, lambda: self._checks.spawn(self._look_again(key, presence())))
            return
        waiting = res.phase in (ReservationPhase.RESERVED, ReservationPhase.QUEUED) and not self._pins.uid_of(
            res
        )
        if not waiting or key in self._deadlines:
            if not waiting:
                self._deadlines.cancel(key)
            return
        delay = max(0.0, (res.meta.created_at or 0.0) + self.settings.reservation_ttl_s - self.clock()) + 0.5
        self._deadlines.arm(key, delay, lambda: self._checks.spawn(self._look_again(key, presence())))

    def _bind_later(
        self, res: GpuReservation, pod: PodSighting, *, at: float, now: float, presence: GpuPresence
    ) -> None:
        """Look at `res` again when its binding waits no more, from the watch caches (no read): by then
        the pod's next event has usually bound it, and the look finds nothing to do."""
        key = (res.namespace, res.name)
        if key in self._binds:
            return

        def due() -> None:
            current = self.state.reservations.items.get(res.key)
            pod_now = self.state.pods.items.get(f"{res.namespace}/{pod.name}")
            if current is None or current.status.pod_uid:
                return  # gone, or bound meanwhile
            self._checks.spawn(
                self._reconcile_quietly(
                    current, sightings([pod_now] if pod_now is not None else []), presence
                )
            )

        self._binds.arm(key, max(0.0, at - now) + 0.1, due)

    def _release_later(self, res: GpuReservation, *, at: float, now: float, presence: GpuPresence) -> None:
        """Look at `res` again when its force-deleted pod's containers are gone at the latest."""
        key = (res.namespace, res.name)
        if key in self._releases:
            return

        def due() -> None:
            current = self.state.reservations.items.get(res.key)
            if current is not None:
                self._checks.spawn(self._reconcile_quietly(current, [], presence))

        self._releases.arm(key, max(0.0, at - now) + 0.1, due)

    async def _reconcile_quietly(
        self, res: GpuReservation, pods: list[PodSighting], presence: GpuPresence
    ) -> None:
        try:
            await self.reconcile(res, pods, presence=presence, confirm_absence=True)
        except Exception as exc:  # the sweep catches it later
            log.warning("reservation check failed", reservation=res.key, error=str(exc))

    async def _look_again(self, key: tuple[str, str], presence: GpuPresence) -> None:
        try:
            res = await self._get(*key)
            if res is None:
                return
            if res.phase is ReservationPhase.GRANTED:  # no pod to look for
                await self.reconcile(res, [], presence=presence)
                if res.phase is ReservationPhase.GRANTED and res.labelled_active:
                    self._arm(res, presence=lambda: presence)
                return
            pods = await self.kube.list(
                pods_path(key[0]), label_selector=f"{LABEL_RESERVATION}={res.pod_label}"
            )
            await self.reconcile(res, sightings(pods.get("items", [])), presence=presence)
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
        labelled: list[PodSighting],
        *,
        presence: GpuPresence,
        confirm_absence: bool = False,
        pod_deleted: bool = False,
    ) -> bool:
        """Move `res` on, given the sightings of the pods that carry its label (its own, and any
        impostors). With `confirm_absence` (the pods came from a cache), a transition for want of its
        pod is taken only after a direct read of the pods carrying its label agrees."""
        now = self.clock()
        pod, impostors = genuine_pod(res.to_domain(), labelled, bound_uid=self._pins.uid_of(res))
        res = self._pins.as_bound(res, pod)
        for impostor in impostors:
            await self._notices.impostor(res, impostor, now=now)
        await self._notices.if_unschedulable(res, pod, now=now)
        the_plan = plan(
            res=res,
            pod=pod,
            gpu_missing=presence.is_missing(res.spec.gpu_uuid),
            now=now,
            ttl_s=self.settings.reservation_ttl_s,
            retention_s=self.settings.retention_s,
            never_created_retention_s=self.settings.never_created_retention_s,
            hold_limit_s=self.settings.hold_limit_s,
            bind_wait_s=self.settings.bind_wait_s,
            pod_deleted=pod_deleted,
            running_until=self._running_until.get(res.key),
            watching_since=self.watching_since,
            unrenewed_s=self._renewals.unrenewed_s(res) if res.phase is ReservationPhase.GRANTED else 0.0,
        )
        if the_plan.bind_at is not None and pod is not None:
            self._bind_later(res, pod, at=the_plan.bind_at, now=now, presence=presence)
        if the_plan.release_at is not None:
            self._release_later(res, at=the_plan.release_at, now=now, presence=presence)
        elif the_plan.transition is not None:
            self._running_until.pop(res.key, None)
        if the_plan.deletion_waits:
            await self._notices.deletion_wait(res, pod, now=now)
        if the_plan.empty:
            return False
        if the_plan.transition is not None and the_plan.transition.reason == "PodAppearedLate":
            the_plan = self._late_on_a_full_gpu(res, the_plan)
        if confirm_absence and the_plan.transition is not None and the_plan.transition.reason in ABSENCE:
            listed = await self.kube.list(
                pods_path(res.namespace),
                label_selector=f"{LABEL_RESERVATION}={res.pod_label}",
            )
            if listed.get("items"):  # the cache was behind: decide on what is really there
                return await self.reconcile(res, sightings(listed["items"]), presence=presence)
        if not await self._apply(res, pod=pod, the_plan=the_plan, now=now):
            # It changed under us (another write of ours, or someone else's): look again on a fresh
            # read now, rather than leave a due transition to the next sweep.
            if the_plan.transition is not None or the_plan.finalizer == "remove":
                self._checks.spawn(self._look_again((res.namespace, res.name), presence))
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

    def bound_pod(self, key: str) -> str | None:
        """The UID of the pod the booking `key` (namespace/name) is bound to in memory, if any."""
        return self._pins.of(key)

    def _bound_now(self, res: GpuReservation) -> None:
        self.metrics.transitions.labels(ReservationPhase.BOUND.value, "PodBound").inc()  # as the write was
        self._deadlines.cancel((res.namespace, res.name))  # its pod came: no TTL to watch

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
        return replace(
            the_plan, event=booked_past_capacity_note(the_plan.event, gpu_label=gpu.label, over_mib=over)
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
            await self._notices.post(res, involving(res), the_plan.event, now=now)
        elif pod is not None:
            await self._notices.post(res, on_pod(res, pod), the_plan.event, now=now)
        return True


def sightings(pods: list[Obj]) -> list[PodSighting]:
    """Pods as listed or cached, as the lifecycle sees them (those without a UID, not created yet, left
    out)."""
    return [pod_sighting(p) for p in pods if p["metadata"].get("uid")]
