"""The inventory loop: one GpuDevice per GPU UUID, kept in step with DCGM.

Each poll reads DCGM from Prometheus (keeping the last inventory when it is unreachable), lists what
the API server holds, lets the pure domain judge every GPU (`observe`), writes only what changed and
publishes which GPUs are gone (`GpuPresence`) for the reservation reconciler. All state lives in the
API server, so a new leader picks up where the old one stopped.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog
from prometheus_client import Histogram

from vramshare.controller.capacity import NodeCapacity
from vramshare.controller.delivery import DeliveryPreflight
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.dcgm_series import Cause, DcgmReading, Unusable
from vramshare.domain import Reservation
from vramshare.domain.delivery_check import Check, Result
from vramshare.domain.freshness import MAX_UNCONFIRMED, InventoryHeartbeat, compose_heartbeat
from vramshare.domain.inventory import (
    DeviceState,
    GpuPresence,
    Known,
    Sample,
    TotalDrift,
    heartbeat_candidates,
    observe,
    to_forget,
)
from vramshare.domain.inventory import DeviceStatus as Judged
from vramshare.kube.client import ApiError, KubeClient
from vramshare.kube.events import Event, Involved, post_event
from vramshare.kube.objects import Condition, Delivery, DeviceSpec, DeviceStatus, GpuDevice
from vramshare.kube.resources import API_VERSION, devices_path
from vramshare.prometheus import DcgmSource, PrometheusUnavailableError

log = structlog.get_logger("vramshare.controller")

CONDITION_TYPES = ("Ready", "Stale", "Missing", "MemoryOverused")


def conditions(
    previous: Sequence[Condition], wanted: dict[str, tuple[bool, str, str]], now: float, generation: int = 0
) -> tuple[Condition, ...]:
    """Conditions with lastTransitionTime kept while a condition's status does not change, each with
    the generation it was judged for."""
    before = {c.type: c for c in previous}
    out = []
    for kind in CONDITION_TYPES:
        ok, reason, message = wanted[kind]
        old = before.get(kind)
        since = old.last_transition if old is not None and old.status == ok else now
        out.append(
            Condition(
                type=kind,
                status=ok,
                reason=reason,
                message=message,
                last_transition=since,
                observed_generation=generation,
            )
        )
    return tuple(out)


def device_status(
    judged: Judged,
    previous: DeviceStatus | None,
    *,
    now: float,
    generation: int = 0,
    delivery: Delivery | None = None,
) -> DeviceStatus:
    """What the GpuDevice's status should say about `judged`, for the device's `generation`;
    `delivery`: the preflight on its node (None: the last one written is kept)."""
    gpu, room, state = judged.gpu, judged.headroom, judged.state
    over = judged.overused_mib > 0
    wanted = {
        "Ready": (state is DeviceState.READY, state.value, judged.message),
        "Stale": (
            state is DeviceState.STALE,
            "SampleTooOld" if state is DeviceState.STALE else "SampleFresh",
            judged.message,
        ),
        "Missing": (
            state is DeviceState.MISSING,
            "NotReported" if state is DeviceState.MISSING else "Reported",
            judged.message,
        ),
        "MemoryOverused": (
            over,
            "UsageAboveReservations" if over else "UsageWithinReservations",
            f"{gpu.used_mib} MiB used, {room.reserved_mib} MiB reserved",
        ),
    }
    return DeviceStatus(
        total_mib=gpu.total_mib,
        used_mib=gpu.used_mib,
        free_mib=gpu.free_mib,
        driver_reserved_mib=gpu.driver_reserved_mib,
        mig=gpu.mig,
        reserved_mib=room.reserved_mib,
        headroom_mib=room.headroom_mib,
        sampled_at=gpu.sampled_at,
        last_seen_at=judged.last_seen_at,
        state=state.value,
        conditions=conditions(previous.conditions if previous else (), wanted, now, generation),
        observed_generation=generation,
        delivery=delivery if delivery is not None else (previous.delivery if previous else None),
    )


WRITES_IN_FLIGHT = 16
"""GpuDevice writes one poll keeps in flight at once: a fleet's GPUs are independent objects, and one
at a time a thousand-GPU fleet's poll took as long as a thousand round trips."""


def refresh_after(uuid: str, *, max_sample_age_s: float) -> float:
    """How long an unchanged GPU's stored sample time may lag: between 3/16 and 1/4 of the maximum
    sample age, fixed per GPU by its UUID. GPUs discovered together (a new node, a restart) would
    otherwise all refresh on the same poll, a burst of one write per GPU."""
    spread = int.from_bytes(hashlib.blake2s(uuid.encode(), digest_size=2).digest(), "big") / 0xFFFF
    return max_sample_age_s / 4 * (0.75 + 0.25 * spread)


class Write(enum.Enum):
    """Why a GPU's status is written this poll."""

    CHANGED = "changed"
    """Its figures, state or conditions changed (or it has no status yet): always written."""
    REFRESH = "refresh"
    """Only its sample time moved on, past its refresh interval: written within the poll's budget."""


def _why_write(desired: DeviceStatus, previous: DeviceStatus | None, *, refresh_s: float) -> Write | None:
    """Whether the status changed enough to write. A new sample with the same figures only moves
    `sampledAt`/`lastSeenAt`; those are refreshed every `refresh_s` (about a quarter of the maximum
    sample age, see `refresh_after`), not every poll. Every write moves the GPU's ledger token, and so
    makes the commits in flight on it conflict: writing only what matters keeps admissions from
    retrying for nothing. A stored sample time that lags makes decisions count more memory as not yet
    visible, never less."""
    if previous is None:
        return Write.CHANGED
    # Equal objects write equal JSON: the common case (nothing changed) needs no serialising.
    if _untimed(desired) != _untimed(previous):
        times = ("sampledAt", "lastSeenAt")
        now_wire = {k: v for k, v in desired.to_wire().items() if k not in times}
        before_wire = {k: v for k, v in previous.to_wire().items() if k not in times}
        if now_wire != before_wire:
            return Write.CHANGED
    seen_lag = (desired.last_seen_at or 0.0) - (previous.last_seen_at or 0.0)
    if desired.sampled_at - previous.sampled_at >= refresh_s or seen_lag >= refresh_s:
        return Write.REFRESH
    return None


def _untimed(status: DeviceStatus) -> DeviceStatus:
    return replace(status, sampled_at=0.0, last_seen_at=None)


def refresh_budget(gpus: int, *, poll_interval_s: float, max_sample_age_s: float) -> int:
    """How many unchanged GPUs one poll may refresh: enough for every GPU once per its shortest
    refresh interval (3/16 of the maximum sample age) at this poll interval. Without a bound, a poll
    that took longer than the refresh interval (a thousand GPUs on a busy API server) found every GPU
    due again, and rewrote the whole fleet on every poll."""
    return max(1, math.ceil(gpus * poll_interval_s / (max_sample_age_s * 3 / 16)))


def _overused(status: DeviceStatus | None) -> bool:
    condition = status.condition("MemoryOverused") if status is not None else None
    return condition is not None and condition.status


@dataclass(frozen=True, slots=True)
class _GpuSeries:
    """One GPU's series of the per-GPU gauges."""

    figures: tuple[Any, ...]
    """total, used, reserved, headroom, sample age, overused."""
    states: dict[DeviceState, Any]

    @classmethod
    def of(cls, m: ControllerMetrics, labels: tuple[str, str]) -> _GpuSeries:
        gauges = (m.total, m.used, m.reserved, m.headroom, m.sample_age, m.overused)
        return cls(
            figures=tuple(g.labels(*labels) for g in gauges),
            states={state: m.state.labels(*labels, state.value) for state in DeviceState},
        )


class _Steps:
    """Times a poll's steps one after the other into `vramshare_inventory_poll_step_seconds`."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.since = time.monotonic()

    def done(self, step: str) -> None:
        now = time.monotonic()
        self.histogram.labels(step).observe(now - self.since)
        self.since = now


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
        self._last_seen: dict[str, float] = {}
        self._drift: dict[str, TotalDrift] = {}
        self._causes_logged: set[Cause] = set()
        self.outage: str | None = None
        self.preflight = DeliveryPreflight(kube=kube, settings=settings, state=state)
        self.capacity = NodeCapacity(kube=kube, state=state, resource=settings.memory_resource)
        self._refreshes_left = 0
        """Unchanged GPUs this poll may still refresh (see `refresh_budget`)."""
        self._delivery: dict[str, tuple[Check, ...]] = {}
        """This poll's preflight, by node."""
        self._series: dict[tuple[str, str], _GpuSeries] = {}
        """Each exported GPU's gauge series, by (node, uuid)."""

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

    def _report_unusable(self, unusable: list[Unusable]) -> None:
        """Each cause in a metric every poll, and in the log once: when it first appears (with every
        GPU it concerns then) and when it is gone."""
        by_cause: dict[Cause, list[str]] = {}
        for u in unusable:
            by_cause.setdefault(u.cause, []).append(u.detail)
        self.metrics.unusable_series.clear()
        for cause in Cause:
            self.metrics.unusable_series.labels(cause.value).set(len(by_cause.get(cause, [])))
        for cause, details in by_cause.items():
            if cause not in self._causes_logged:
                self._causes_logged.add(cause)
                log.warning(
                    "DCGM series unusable", cause=cause.value, count=len(details), problems=details[:20]
                )
        for cause in sorted(self._causes_logged - set(by_cause)):
            self._causes_logged.discard(cause)
            log.info("DCGM series usable again", cause=cause.value)

    @staticmethod
    def _on_kubernetes_nodes(samples: list[Sample], nodes: set[str]) -> tuple[list[Sample], list[Unusable]]:
        """The samples on nodes that exist, and why the others are left out: a node label that names no
        Kubernetes node (an exporter that writes its pod's name there, a wrong node_label) must not
        create a GPU on a phantom node or move a known one there; a known GPU is judged as unreported
        (Stale, as in an exporter outage; Missing if its own node is gone)."""
        if not nodes:  # no Node objects at all: nothing to compare with
            return samples, []
        kept, out = [], []
        shown = ", ".join(sorted(nodes)[:5]) + (", ..." if len(nodes) > 5 else "")
        for s in samples:
            if s.node in nodes:
                kept.append(s)
                continue
            out.append(
                Unusable(
                    cause=Cause.UNKNOWN_NODE,
                    detail=f"{s.uuid}: its node label says {s.node!r}, which is not a Kubernetes node "
                    f"({shown}). Exporters before 2023 wrote their own pod's name in Hostname: relabel "
                    "the node name (e.g. from __meta_kubernetes_pod_node_name) into a label and set "
                    "node_label to it",
                )
            )
        return kept, out

    def _report_totals(self, statuses: list[Judged], known: list[Known]) -> list[Unusable]:
        """Log each rejected reading's first rejection and each new total taken; the rejections as
        unusable readings."""
        before = {k.gpu.uuid: k for k in known}
        out = []
        for j in statuses:
            previous = before.get(j.gpu.uuid)
            if j.rejected:
                out.append(Unusable(cause=Cause.TOTAL_DRIFT, detail=f"{j.gpu.uuid}: {j.rejected}"))
                if j.drift is not None and j.drift.readings == 1:
                    log.warning("DCGM reading rejected", uuid=j.gpu.uuid, node=j.gpu.node, why=j.rejected)
            elif (
                previous is not None
                and previous.drift is not None
                and previous.gpu.total_mib != j.gpu.total_mib
            ):
                log.info(
                    "GPU total changed",
                    uuid=j.gpu.uuid,
                    node=j.gpu.node,
                    total_mib=j.gpu.total_mib,
                    previous_mib=previous.gpu.total_mib,
                )
        self._drift = {j.gpu.uuid: j.drift for j in statuses if j.drift is not None}
        return out

    async def poll(self) -> list[Judged]:
        step = _Steps(self.metrics.poll_step_seconds)
        reading: DcgmReading | None = await self._reading()
        step.done("read")
        # From the watch caches: no LIST per poll.
        devices = list(self.state.devices.items.values())
        reservations = [r.to_domain() for r in self.state.reservations.items.values() if r.phase.is_active]
        nodes = {n.name for n in self.state.nodes.items.values()}
        now = self.clock()
        by_uuid = {d.spec.uuid: d for d in devices}
        known = []
        for device in devices:
            gpu = device.to_domain()
            if gpu is not None and device.status is not None and device.status.last_seen_at is not None:
                # The stored times lag by up to a refresh interval (see _why_write); this
                # leader's own memory of the last sighting is newer.
                seen = max(device.status.last_seen_at, self._last_seen.get(gpu.uuid, 0.0))
                known.append(Known(gpu=gpu, last_seen_at=seen, drift=self._drift.get(gpu.uuid)))
        samples, strangers = self._on_kubernetes_nodes(reading.samples if reading else [], nodes)
        statuses = observe(
            known=known,
            samples=samples,
            reservations=reservations,
            nodes=nodes,
            now=now,
            settings=self.settings.inventory,
        )
        drifting = self._report_totals(statuses, known)
        if reading is not None:
            self._report_unusable([*reading.unusable, *strangers, *drifting])
        self._delivery = self.preflight.checks()
        gone = to_forget(statuses, reservations=reservations, now=now, settings=self.settings.inventory)
        slots = asyncio.Semaphore(WRITES_IN_FLIGHT)
        self._refreshes_left = refresh_budget(
            len(statuses),
            poll_interval_s=self.settings.poll_interval_s,
            max_sample_age_s=self.settings.accounting.max_sample_age_s,
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
                    await self._forget(recorded, judged, now=now)
                elif await self._write_device(
                    judged,
                    recorded,
                    bookings=on_gpu.get(judged.gpu.uuid, ()),
                    now=now,
                    dated=judged.gpu.uuid in dated,
                ):
                    landed.add(judged.gpu.uuid)

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
        self._export(statuses, reservations, now)
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

    async def _forget(self, device: GpuDevice, judged: Judged, *, now: float) -> None:
        """Delete the GpuDevice of a GPU gone for good (as it was read: a precondition), with an event."""
        gpu = judged.gpu
        try:
            await self.kube.delete(
                devices_path(device.meta.name), resource_version=device.meta.resource_version
            )
        except ApiError as exc:
            if exc.not_found or exc.conflict:  # already gone, or changed: the next poll judges again
                return
            raise
        self.state.devices.drop(f"/{device.meta.name}")
        self._last_seen.pop(gpu.uuid, None)
        after = self.settings.inventory.forget_missing_after_s
        log.info(
            "GPU forgotten", uuid=gpu.uuid, node=gpu.node, missing_for_s=round(now - judged.last_seen_at)
        )
        await self._device_event(
            device,
            Event(
                type="Normal",
                reason="GpuDeviceRemoved",
                message=f"GPU {gpu.label} was not reported for {now - judged.last_seen_at:.0f} s (more than "
                f"forget_missing_after_s, {after:g} s) and nothing is booked on it: its GpuDevice is "
                "deleted. If the card comes back it is discovered again.",
            ),
            now=now,
        )

    async def _write_status(self, device: GpuDevice, desired: DeviceStatus) -> GpuDevice | None:
        """Write `desired` on the device as read, never over a newer sample: two controllers that both
        act for a moment during a handover then leave the newest sample in place, whatever order their
        writes land in. A 409 (a webhook's commit moved the resourceVersion, or another writer) is read
        again; None when the device already has a sample at least as new."""
        for _ in range(3):
            try:
                written = await self.kube.merge_patch(
                    f"{devices_path(device.meta.name)}/status",
                    {
                        "metadata": {"resourceVersion": device.meta.resource_version},
                        "status": desired.to_wire(),
                    },
                )
                return GpuDevice.from_wire(written)
            except ApiError as exc:
                if not exc.conflict:
                    raise
            device = GpuDevice.from_wire(await self.kube.get(devices_path(device.meta.name)))
            if device.status is not None and device.status.sampled_at >= desired.sampled_at:
                return None
        return None

    async def _write_device(
        self,
        judged: Judged,
        device: GpuDevice | None,
        *,
        bookings: Sequence[Reservation],
        now: float,
        dated: bool = False,
    ) -> bool:
        """Write the GPU's status if it changed (or, unless the heartbeat `dated` it, its sample time
        is due a refresh); True when the API server then holds this poll's figures for it."""
        gpu = judged.gpu
        spec = DeviceSpec(uuid=gpu.uuid, node_name=gpu.node, index=gpu.index, model=gpu.model)
        if device is None:
            new = GpuDevice.new(spec)
            try:
                created = await self.kube.create(devices_path(), new.to_wire())
            except ApiError as exc:
                if not exc.conflict:
                    raise
                created = await self.kube.get(devices_path(new.meta.name))  # the cache was behind
            device = GpuDevice.from_wire(created)
            self.state.devices.put(
                f"/{device.meta.name}", device, resource_version=device.meta.resource_version
            )
            log.info("GPU discovered", uuid=gpu.uuid, node=gpu.node, index=gpu.index, model=gpu.model)
        elif device.spec != spec and judged.state is not DeviceState.MISSING:
            # The same card moved to another index or node label; its UUID is what identifies it.
            changed = {k: v for k, v in spec.to_wire().items() if k != "uuid"}
            device = GpuDevice.from_wire(
                await self.kube.merge_patch(devices_path(device.meta.name), {"spec": changed})
            )
            # Its new generation.
            self.state.devices.put(
                f"/{device.meta.name}", device, resource_version=device.meta.resource_version
            )
        previous = device.status
        checks = self._delivery.get(gpu.node)
        delivery = Delivery.of(self.settings.delivery_mode, checks) if checks else None
        desired = device_status(
            judged, previous, now=now, generation=device.meta.generation, delivery=delivery
        )
        self._last_seen[gpu.uuid] = judged.last_seen_at
        refresh_s = refresh_after(gpu.uuid, max_sample_age_s=self.settings.accounting.max_sample_age_s)
        why = _why_write(desired, previous, refresh_s=refresh_s)
        if why is None:
            return True
        if why is Write.REFRESH:  # only the times moved: the stored figures are this poll's
            if dated or self._refreshes_left <= 0:
                return True  # dated by the heartbeat, or refreshed next poll (the oldest go first)
            self._refreshes_left -= 1
        self.metrics.device_status_writes.labels(why.value).inc()
        written = await self._write_status(device, desired)
        if written is None:
            return False
        self.state.devices.put(
            f"/{device.meta.name}", written, resource_version=written.meta.resource_version
        )
        if previous is None or previous.state != desired.state:
            log.info(
                "GPU state changed",
                uuid=gpu.uuid,
                node=gpu.node,
                state=desired.state,
                previous=previous.state if previous else None,
                message=judged.message,
            )
        await self._report_delivery(device, previous, desired, now=now)
        was_over = _overused(previous)
        if judged.overused_mib > 0 and not was_over:
            # Pods, not holds: a hold keeps memory for a task that does not run yet.
            running = [r for r in bookings if r.is_active and not r.held_for]
            pods = sorted(f"{r.namespace}/{r.pod}" for r in running)
            message = (
                f"GPU {gpu.label} uses {gpu.used_mib} MiB, {judged.overused_mib} MiB more than its pods' "
                f"reservations ({sum(r.mib for r in running)} MiB) plus the margin; pods on it: "
                f"{', '.join(pods) or 'none booked (a process vramshare does not know)'}"
            )
            log.warning(
                "GPU memory overused",
                uuid=gpu.uuid,
                node=gpu.node,
                overused_mib=judged.overused_mib,
                pods=pods,
            )
            await self._device_event(
                device, Event(type="Warning", reason="MemoryOverused", message=message), now=now
            )
        elif judged.overused_mib == 0 and was_over:
            log.info("GPU memory back within reservations", uuid=gpu.uuid, node=gpu.node)
        return True

    async def _report_delivery(
        self, device: GpuDevice, previous: DeviceStatus | None, desired: DeviceStatus, *, now: float
    ) -> None:
        """A Warning event (and log) when the configured mode turns out unable to deliver this GPU."""
        after, before = desired.delivery, previous.delivery if previous else None
        if after is None or after.result != Result.CANNOT.value:
            return
        if before is not None and (before.mode, before.result, before.message) == (
            after.mode,
            after.result,
            after.message,
        ):
            return
        log.warning(
            "delivery mode cannot deliver",
            uuid=device.spec.uuid,
            node=device.spec.node_name,
            mode=after.mode,
            why=after.message,
        )
        await self._device_event(
            device,
            Event(
                type="Warning",
                reason="DeliveryModeCannotDeliver",
                message=f"delivery mode {after.mode} cannot give pods GPU {device.spec.uuid} on node "
                f"{device.spec.node_name}: {after.message}",
            ),
            now=now,
        )

    async def _device_event(self, device: GpuDevice, event: Event, *, now: float) -> None:
        """An event about a GpuDevice (cluster-scoped, so recorded in the default namespace)."""
        await post_event(
            self.kube,
            namespace="default",
            involved=Involved(
                api_version=API_VERSION, kind="GpuDevice", name=device.meta.name, uid=device.meta.uid
            ),
            event=event,
            now=now,
            reporter=self.settings.identity,
        )

    def _export(self, statuses: list[Judged], reservations: list[Reservation], now: float) -> None:
        m = self.metrics
        gauges = (m.total, m.used, m.reserved, m.headroom, m.sample_age, m.overused)
        exported = {}
        for s in statuses:
            labels = (s.gpu.node, s.gpu.uuid)
            # Each GPU's series looked up once, not every poll: labels() validates and hashes its
            # arguments, and a thousand GPUs' nine series cost a third of a second a poll.
            series = self._series.pop(labels, None) or _GpuSeries.of(m, labels)
            exported[labels] = series
            values = (
                s.gpu.total_mib,
                s.gpu.used_mib,
                s.headroom.reserved_mib,
                s.headroom.headroom_mib,
                max(0.0, now - s.gpu.sampled_at),
                s.overused_mib,
            )
            for child, value in zip(series.figures, values, strict=True):
                child.set(value)
            for state, child in series.states.items():
                child.set(1 if s.state is state else 0)
        for labels in self._series:  # GPUs gone since the last poll
            for gauge in gauges:
                gauge.remove(*labels)
            for state in DeviceState:
                m.state.remove(*labels, state.value)
        self._series = exported
        m.mig_gpus.set(sum(1 for s in statuses if s.gpu.mig_enabled))
        counts = Counter(r.phase.value for r in reservations)
        m.reservations.clear()
        for phase, n in counts.items():
            m.reservations.labels(phase).set(n)

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
