"""What the reservation reconciler tells people, as events (and gauges), and what it tells only once:
an impostor pod carrying a booking's label, a deleted booking that waits for its pod, a booked pod that
stays unschedulable. Each is said once per booking (and pod), until the booking is gone."""

from __future__ import annotations

from collections.abc import Set

import structlog

from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.reservations.wording import (
    deletion_waits,
    involving,
    not_yours,
    on_pod,
    unschedulable,
)
from vramshare.controller.settings import ControllerSettings
from vramshare.domain import PodSighting
from vramshare.domain.lifecycle import stuck_unschedulable
from vramshare.kube.client import KubeClient
from vramshare.kube.events import Event, Involved, post_event
from vramshare.kube.objects import GpuReservation

log = structlog.get_logger("vramshare.controller")


class Notices:
    def __init__(self, *, kube: KubeClient, settings: ControllerSettings, metrics: ControllerMetrics) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self._announced: set[tuple[str, str]] = set()
        """(reservation, impostor pod UID or "deletion") pairs already reported, so each gets one event."""
        self._stuck: dict[str, str] = {}
        """Reservation key -> UID of its pod that has been unschedulable too long (warned once)."""

    def keep_only(self, keys: Set[str]) -> None:
        """Forget what was said of bookings that no longer exist (a pod stuck with them: deleted too)."""
        self._announced = {note for note in self._announced if note[0] in keys}
        gone = self._stuck.keys() - keys
        if gone:
            for key in gone:
                del self._stuck[key]
            self.metrics.unschedulable_pods.set(len(set(self._stuck.values())))

    async def if_unschedulable(self, res: GpuReservation, pod: PodSighting | None, *, now: float) -> None:
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
        log.warning("booked pod unschedulable", reservation=res.key, pod=pod.name, node=res.spec.node_name)
        await self.post(res, on_pod(res, pod), unschedulable(res, pod, after_s=after_s), now=now)

    async def deletion_wait(self, res: GpuReservation, pod: PodSighting | None, *, now: float) -> None:
        """Say once why a deleted GpuReservation (and so its namespace, if that is being deleted) is
        still there: its pod may still hold the memory."""
        key = (res.key, "deletion")
        if key in self._announced:
            return
        self._announced.add(key)
        log.info("deleted booking waits for its pod", reservation=res.key, pod=pod.name if pod else None)
        await self.post(res, involving(res), deletion_waits(res, pod), now=now)

    async def impostor(self, res: GpuReservation, impostor: PodSighting, *, now: float) -> None:
        key = (res.key, impostor.uid)
        if key in self._announced:
            return
        self._announced.add(key)
        log.warning("impostor pod ignored", reservation=res.key, pod=impostor.name)
        self.metrics.impostor_pods.inc()
        await self.post(res, on_pod(res, impostor), not_yours(res, impostor), now=now)

    async def post(self, res: GpuReservation, involved: Involved, event: Event, *, now: float) -> None:
        await post_event(
            self.kube,
            namespace=res.namespace,
            involved=involved,
            event=event,
            now=now,
            reporter=self.settings.identity,
        )
