"""The inventory loop: one GpuDevice per GPU UUID, kept in step with DCGM.

Each poll reads DCGM from Prometheus (keeping the last inventory when it is unreachable), lists what
the API server holds, lets the pure domain judge every GPU (`observe`), writes only what changed
(`writer`, as `write_policy` says) and publishes which GPUs are gone (`GpuPresence`) for the
reservation reconciler. All state lives in the API server, so a new leader picks up where the old one
stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable

import structlog

from vramshare.controller.attribution import PodAttribution
from vramshare.controller.capacity import NodeCapacity
from vramshare.controller.delivery_preflight import DeliveryPreflight
from vramshare.controller.devices.reporting import InventoryReport, PollSteps
from vramshare.controller.devices.write_policy import WRITES_IN_FLIGHT, RefreshBudget, refresh_budget
from vramshare.controller.devices.writer import DeviceWriter
from vramshare.controller.holds import HoldKeeper
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.dcgm_series import DcgmReading
from vramshare.domain import Reservation
from vramshare.domain.freshness import MAX_UNCONFIRMED, InventoryHeartbeat, compose_heartbeat
from vramshare.domain.inventory import DeviceStatus as Judged
from vramshare.domain.inventory import (
    GpuPresence,
    Known,
    TotalDrift,
    heartbeat_candidates,
    observe,
    to_forget,
)
from vramshare.kube.client import KubeClient
from vramshare.prometheus import DcgmSource, PrometheusUnavailableError

log = structlog.get_logger("vramshare.controller")


class InventoryLoop:
    """The leader's inventory: `poll()` once, or `run()` every poll interval."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        source: DcgmSource,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
        state: ClusterState,
        clock: Callable[[], float] = time.time,
        on_heartbeat: Callable[[InventoryHeartbeat], None] = lambda heartbeat: None,
    ) -> None:
        self.kube = kube
        self.state = state
        self.on_heartbeat = on_heartbeat
        """Told each poll's heartbeat, to publish on the Lease."""
        self.heartbeat: InventoryHeartbeat | None = None
        """The last heartbeat published (see `vramshare.domain.freshness`)."""
        self.source = source
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.presence = GpuPresence()
        """Which GPUs the last poll found gone; read by the reservation reconciler."""
        self.statuses: list[Judged] = []
        """Every GPU as the last poll judged it; read by the Airflow pool sync."""
        self.polled = asyncio.Event()
        """Set after each poll (the pool sync clears it)."""
        self._drift: dict[str, TotalDrift] = {}
        self.report = InventoryReport(metrics)
        self.writer = DeviceWriter(kube=kube, state=state, settings=settings, metrics=metrics)
        self.outage: str | None = None
        self.preflight = DeliveryPreflight(kube=kube, settings=settings, state=state)
        self.capacity = NodeCapacity(kube=kube, state=state, resource=settings.memory_resource)
        self.holds = HoldKeeper(kube=kube, state=state, settings=settings, metrics=metrics)
        self.attribution = PodAttribution(kube=kube, holders_namespace=settings.namespace)

    async def _reading(self) -> DcgmReading | None:
        try:
            reading = await self.source.read()
        except (PrometheusUnavailableError, TimeoutError) as exc:
            self.metrics.prometheus_errors.inc()
            if self.outage is None:
                log.warning(
                    "Prometheus unreachable: keeping the last inventory, samples will go stale",
                    url=self.source.url,
                    error=str(exc),
                )
            self.outage = str(exc)
            return None
        if self.outage is not None:
            log.info("Prometheus reachable again", url=self.source.url)
            self.outage = None
        return reading

    async def poll(self) -> list[Judged]:
        step = PollSteps(self.metrics.poll_step_seconds)
        reading: DcgmReading | None = await self._reading()
        step.done("read")
        # From the watch caches: no LIST per poll.
        devices = list(self.state.devices.items.values())
        reservations = self.state.bookings()
        node_views = list(self.state.nodes.items.values())
        nodes = {n.name for n in node_views}
        now = self.clock()
        by_uuid = {d.spec.uuid: d for d in devices}
        known = []
        for device in devices:
            gpu = device.to_domain()
            if gpu is not None and device.status is not None and device.status.last_seen_at is not None:
                # The stored times lag by up to a refresh interval (see _why_write); this
                # leader's own memory of the last sighting is newer.
                seen = max(device.status.last_seen_at, self.writer.last_seen.get(gpu.uuid, 0.0))
                known.append(Known(gpu=gpu, last_seen_at=seen, drift=self._drift.get(gpu.uuid)))
        samples, strangers = InventoryReport.on_kubernetes_nodes(reading.samples if reading else [], nodes)
        # GPUs NVIDIA's device plugin hands out are shared only where vramshare holds them (or the node
        # is dedicated to it): see vramshare.domain.ownership.
        gpus_seen: dict[str, int] = defaultdict(int)
        for node in ({k.gpu.uuid: k.gpu.node for k in known} | {s.uuid: s.node for s in samples}).values():
            gpus_seen[node] += 1
        owned = self.holds.ownership(
            node_views, gpus_seen=gpus_seen, taken=await self.attribution.taken(samples)
        )
        statuses = observe(
            known=known,
            samples=samples,
            reservations=reservations,
            nodes=nodes,
            now=now,
            settings=self.settings.inventory,
            ownership=owned,
        )
        drifting = self.report.totals(statuses, known)
        self._drift = {j.gpu.uuid: j.drift for j in statuses if j.drift is not None}
        if reading is not None:
            self.report.unusable([*reading.unusable, *strangers, *drifting])
        delivery = self.preflight.checks()
        gone = to_forget(statuses, reservations=reservations, now=now, settings=self.settings.inventory)
        slots = asyncio.Semaphore(WRITES_IN_FLIGHT)
        budget = RefreshBudget(
            refresh_budget(
                len(statuses),
                poll_interval_s=self.settings.poll_interval_s,
                max_sample_age_s=self.settings.accounting.max_sample_age_s,
            )
        )

        def stored_sample(judged: Judged) -> float:
            recorded = by_uuid.get(judged.gpu.uuid)
            status = recorded.status if recorded is not None else None
            return status.sampled_at if status is not None else float("-inf")

        # The longest unrefreshed first: each decides whether to write before its first await, in
        # this order, so the refresh budget goes to the oldest samples.
        ordered = sorted(statuses, key=stored_sample)
        window_s = self.settings.accounting.max_sample_age_s / 4
        candidates = heartbeat_candidates(statuses, window_s=window_s)
        last = self.heartbeat
        # The heartbeat dates these: their sample times need no write of their own.
        dated = {u for u in candidates if last is not None and last.confirms(u)}
        landed: set[str] = set()
        # Bookings by GPU, only to name an overused GPU's pods: not built on the polls (nearly all)
        # that find none.
        on_gpu: dict[str, list[Reservation]] = defaultdict(list)
        if any(j.overused_mib > 0 for j in statuses):
            for r in reservations:
                on_gpu[r.gpu_uuid].append(r)

        async def keep(judged: Judged) -> None:
            recorded = by_uuid.get(judged.gpu.uuid)
            async with slots:
                if judged in gone and recorded is not None:
                    await self.writer.forget(recorded, judged, now=now)
                elif await self.writer.write_device(
                    judged,
                    recorded,
                    bookings=on_gpu.get(judged.gpu.uuid, ()),
                    now=now,
                    dated=judged.gpu.uuid in dated,
                    checks=delivery.get(judged.gpu.node),
                    budget=budget,
                ):
                    landed.add(judged.gpu.uuid)

        await self.holds.keep(owned=owned, nodes=node_views, reservations=reservations, now=now)
        step.done("judge")
        outcomes = await asyncio.gather(*(keep(j) for j in ordered), return_exceptions=True)
        step.done("write")
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:  # the others' writes stand; the next poll tries these again
            raise failed[0]
        self._publish(
            compose_heartbeat(
                confirmed={u: at for u, at in candidates.items() if u in landed},
                known=(d.spec.uuid for d in self.state.devices.items.values()),
                devices_version=self.state.devices.newest_version,
                window_s=window_s,
            )
        )
        self.presence = GpuPresence.of(statuses)
        self.statuses = statuses
        forgotten = {j.gpu.uuid for j in gone}
        await self.capacity.advertise(j.gpu for j in statuses if j.gpu.uuid not in forgotten)
        self.polled.set()
        self.report.export(statuses, reservations, now)
        step.done("publish")
        return statuses

    def _publish(self, heartbeat: InventoryHeartbeat | None) -> None:
        if heartbeat is None:
            if self.heartbeat is not None:
                log.warning(
                    "no inventory heartbeat: too many GPUs unconfirmed; sample times are refreshed by "
                    "status writes",
                    max_unconfirmed=MAX_UNCONFIRMED,
                )
            self.heartbeat = None  # the one on the Lease stays true; refresh writes take over
            self.metrics.heartbeat_gpus.clear()
            return
        self.heartbeat = heartbeat
        self.on_heartbeat(heartbeat)
        unconfirmed = len(heartbeat.unconfirmed)
        self.metrics.heartbeat_gpus.labels("confirmed").set(len(self.state.devices.items) - unconfirmed)
        self.metrics.heartbeat_gpus.labels("unconfirmed").set(unconfirmed)

    async def run(self) -> None:
        preflight = asyncio.create_task(self.preflight.run(), name="delivery-preflight")
        try:
            await self._poll_forever()
        finally:
            preflight.cancel()

    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll()
            except Exception as exc:  # the API server is briefly away: try again next round
                log.warning("inventory poll failed", error=str(exc))
            self.metrics.poll_seconds.observe(time.monotonic() - started)
            await asyncio.sleep(self.settings.poll_interval_s)
