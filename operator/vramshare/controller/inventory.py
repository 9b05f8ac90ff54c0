"""Keeping one GpuDevice per GPU UUID in step with DCGM, and sweeping reservations through their
lifecycle.

Each poll: read DCGM from Prometheus (keeping the last inventory when it is unreachable), list what
the API server holds, let the pure domain judge every GPU (`observe`) and every reservation (`plan`),
and write only what changed. All state lives in the API server, so a new leader picks up where the
old one stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import structlog

from vramshare.controller.lifecycle import PodEvent, PodInfo, apply, plan, post_event
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.domain.inventory import DeviceState, DeviceStatus, Known, observe
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.resources import (
    API_VERSION,
    LABEL_RESERVATION,
    device_name,
    devices_path,
    format_time,
    format_time_precise,
    gpu_from_device,
    parse_time,
    reservation_from_object,
    reservations_path,
)
from vramshare.prometheus import DcgmReading, DcgmSource, PrometheusUnavailableError

log = structlog.get_logger("vramshare.controller")

CONDITION_TYPES = ("Ready", "Stale", "Missing", "MemoryOverused")


def conditions(previous: list[Obj], wanted: dict[str, tuple[bool, str, str]], now: float) -> list[Obj]:
    """Conditions with lastTransitionTime kept while a condition's status does not change."""
    before = {c.get("type"): c for c in previous}
    out = []
    for kind in CONDITION_TYPES:
        ok, reason, message = wanted[kind]
        status = "True" if ok else "False"
        old = before.get(kind)
        since = old["lastTransitionTime"] if old and old.get("status") == status else format_time(now)
        out.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": since,
            }
        )
    return out


def device_status(status: DeviceStatus, previous: Obj, *, now: float) -> Obj:
    gpu, room = status.gpu, status.headroom
    over = status.overused_mib > 0
    wanted = {
        "Ready": (status.state is DeviceState.READY, status.state.value, status.message),
        "Stale": (
            status.state is DeviceState.STALE,
            "SampleTooOld" if status.state is DeviceState.STALE else "SampleFresh",
            status.message,
        ),
        "Missing": (
            status.state is DeviceState.MISSING,
            "NotReported" if status.state is DeviceState.MISSING else "Reported",
            status.message,
        ),
        "MemoryOverused": (
            over,
            "UsageAboveReservations" if over else "UsageWithinReservations",
            f"{gpu.used_mib} MiB used, {room.reserved_mib} MiB reserved",
        ),
    }
    return {
        "totalMiB": gpu.total_mib,
        "usedMiB": gpu.used_mib,
        "freeMiB": gpu.free_mib,
        "driverReservedMiB": gpu.driver_reserved_mib,
        "reservedMiB": room.reserved_mib,
        "headroomMiB": room.headroom_mib,
        "sampledAt": format_time_precise(gpu.sampled_at),
        "lastSeenAt": format_time_precise(status.last_seen_at),
        "state": status.state.value,
        "conditions": conditions(previous.get("conditions") or [], wanted, now),
    }


def _same(a: Obj, b: Obj) -> bool:
    def strip(s: Obj) -> Obj:
        return {k: v for k, v in s.items() if k != "observedGeneration"}

    return strip(a) == strip(b)


class Controller:
    """The leader's work loops. Handlers for pod events call `reconcile_pod()`."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        source: DcgmSource,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.source = source
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.missing_gpus: set[str] = set()
        self.known_gpus: set[str] = set()
        self.outage: str | None = None
        self.polls = 0

    # -- inventory ---------------------------------------------------------------------------------

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
        for problem in reading.skipped:
            log.warning("DCGM series skipped", problem=problem)
        return reading

    async def poll_inventory(self) -> list[DeviceStatus]:
        reading = await self._reading()
        devices = (await self.kube.list(devices_path())).get("items", [])
        reservations = [
            reservation_from_object(o) for o in (await self.kube.list(reservations_path())).get("items", [])
        ]
        nodes = {n["metadata"]["name"] for n in (await self.kube.list("/api/v1/nodes")).get("items", [])}
        now = self.clock()
        by_uuid = {d["spec"]["uuid"]: d for d in devices}
        known = []
        for obj in devices:
            gpu = gpu_from_device(obj)
            last_seen = parse_time((obj.get("status") or {}).get("lastSeenAt"))
            if gpu is not None and last_seen is not None:
                known.append(Known(gpu=gpu, last_seen_at=last_seen))
        statuses = observe(
            known=known,
            samples=reading.samples if reading else [],
            reservations=reservations,
            nodes=nodes,
            now=now,
            settings=self.settings.inventory,
        )
        for status in statuses:
            await self._write_device(status, by_uuid.get(status.gpu.uuid), reservations=reservations, now=now)
        self.missing_gpus = {s.gpu.uuid for s in statuses if s.state is DeviceState.MISSING}
        self.known_gpus = {s.gpu.uuid for s in statuses}
        self._export(statuses, reservations, now)
        self.polls += 1
        return statuses

    async def _write_device(
        self, status: DeviceStatus, obj: Obj | None, *, reservations: list[Any], now: float
    ) -> None:
        gpu = status.gpu
        name = device_name(gpu.uuid)
        spec = {"uuid": gpu.uuid, "nodeName": gpu.node, "index": gpu.index, "model": gpu.model}
        if obj is None:
            obj = await self.kube.create(
                devices_path(),
                {"apiVersion": API_VERSION, "kind": "GpuDevice", "metadata": {"name": name}, "spec": spec},
            )
            log.info("GPU discovered", uuid=gpu.uuid, node=gpu.node, index=gpu.index, model=gpu.model)
        elif {k: obj["spec"].get(k) for k in spec} != spec and status.state is not DeviceState.MISSING:
            # The same card moved to another index or node label; its UUID is what identifies it.
            await self.kube.merge_patch(
                devices_path(name), {"spec": {k: v for k, v in spec.items() if k != "uuid"}}
            )
        previous = obj.get("status") or {}
        desired = device_status(status, previous, now=now)
        if _same(desired, previous):
            return
        await self.kube.merge_patch(f"{devices_path(name)}/status", {"status": desired})
        if previous.get("state") != desired["state"]:
            log.info(
                "GPU state changed",
                uuid=gpu.uuid,
                node=gpu.node,
                state=desired["state"],
                previous=previous.get("state"),
                message=status.message,
            )
        was_over = any(
            c.get("type") == "MemoryOverused" and c.get("status") == "True"
            for c in previous.get("conditions") or []
        )
        if status.overused_mib > 0 and not was_over:
            pods = sorted(
                f"{r.namespace}/{r.pod}" for r in reservations if r.is_active and r.gpu_uuid == gpu.uuid
            )
            message = (
                f"GPU {gpu.label} uses {gpu.used_mib} MiB, {status.overused_mib} MiB more than its "
                f"reservations ({status.headroom.reserved_mib} MiB) plus the margin; pods on it: "
                f"{', '.join(pods) or 'none booked (a process vramshare does not know)'}"
            )
            log.warning(
                "GPU memory overused",
                uuid=gpu.uuid,
                node=gpu.node,
                overused_mib=status.overused_mib,
                pods=pods,
            )
            await post_event(
                self.kube,
                namespace="default",
                involved={
                    "apiVersion": API_VERSION,
                    "kind": "GpuDevice",
                    "name": name,
                    "uid": obj["metadata"]["uid"],
                },
                event=PodEvent(type="Warning", reason="MemoryOverused", message=message),
                now=now,
                reporter=self.settings.identity,
            )
        elif status.overused_mib == 0 and was_over:
            log.info("GPU memory back within reservations", uuid=gpu.uuid, node=gpu.node)

    def _export(self, statuses: list[DeviceStatus], reservations: list[Any], now: float) -> None:
        m = self.metrics
        for g in (m.total, m.used, m.reserved, m.headroom, m.sample_age, m.overused, m.state):
            g.clear()
        for s in statuses:
            labels = (s.gpu.node, s.gpu.uuid)
            m.total.labels(*labels).set(s.gpu.total_mib)
            m.used.labels(*labels).set(s.gpu.used_mib)
            m.reserved.labels(*labels).set(s.headroom.reserved_mib)
            m.headroom.labels(*labels).set(s.headroom.headroom_mib)
            m.sample_age.labels(*labels).set(max(0.0, now - s.gpu.sampled_at))
            m.overused.labels(*labels).set(s.overused_mib)
            for state in DeviceState:
                m.state.labels(*labels, state.value).set(1 if s.state is state else 0)
        counts = Counter(r.phase.value for r in reservations)
        m.reservations.clear()
        for phase, n in counts.items():
            m.reservations.labels(phase).set(n)

    # -- reservations ----------------------------------------------------------------------------

    async def sweep_reservations(self) -> int:
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
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            pod = by_reservation.get(key)
            if await self._reconcile(obj, PodInfo.from_pod(pod) if pod is not None else None):
                changed += 1
        return changed

    async def reconcile_pod(self, pod: Obj, *, deleted: bool) -> None:
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
        await self._reconcile(obj, None if deleted else PodInfo.from_pod(pod))

    async def _reconcile(self, obj: Obj, pod: PodInfo | None) -> bool:
        gpu_uuid = obj["spec"]["gpuUUID"]
        # A GPU with no GpuDevice at all (deleted by hand) counts as missing once the inventory has run.
        gpu_missing = gpu_uuid in self.missing_gpus or (self.polls > 0 and gpu_uuid not in self.known_gpus)
        now = self.clock()
        the_plan = plan(
            obj=obj,
            pod=pod,
            gpu_missing=gpu_missing,
            now=now,
            ttl_s=self.settings.reservation_ttl_s,
            retention_s=self.settings.retention_s,
        )
        if the_plan.empty:
            return False
        await apply(self.kube, obj=obj, pod=pod, the_plan=the_plan, now=now, reporter=self.settings.identity)
        phase = the_plan.status.get("phase")
        if phase or the_plan.delete:
            log.info(
                "reservation",
                reservation=f"{obj['metadata']['namespace']}/{obj['metadata']['name']}",
                phase=phase,
                reason=the_plan.status.get("reason"),
                deleted=the_plan.delete,
                gpu=gpu_uuid,
                pod=pod.name if pod else None,
            )
        return True

    # -- loops -------------------------------------------------------------------------------------

    async def run_inventory(self) -> None:
        while True:
            try:
                await self.poll_inventory()
            except Exception as exc:  # the API server is briefly away: try again next round
                log.warning("inventory poll failed", error=str(exc))
            await asyncio.sleep(self.settings.poll_interval_s)

    async def run_sweeps(self) -> None:
        while True:
            try:
                await self.sweep_reservations()
            except Exception as exc:
                log.warning("reservation sweep failed", error=str(exc))
            await asyncio.sleep(self.settings.lifecycle_interval_s)
