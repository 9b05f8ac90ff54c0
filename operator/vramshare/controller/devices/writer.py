"""The inventory's writes: a GpuDevice created for a GPU discovered, its spec moved with the card, its
status written as the write policy says, it deleted once the GPU is gone for good, and the events
that go with them."""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from vramshare.controller.devices.status import device_status, overused
from vramshare.controller.devices.write_policy import (
    RefreshBudget,
    Write,
    defer_booking_figures,
    refresh_after,
    why_write,
)
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain import Reservation
from vramshare.domain.delivery_judgement import Check, Result
from vramshare.domain.inventory import (
    DeviceState,
)
from vramshare.domain.inventory import DeviceStatus as Judged
from vramshare.kube.client import ApiError, KubeClient
from vramshare.kube.events import Event, Involved, post_event
from vramshare.kube.objects import Delivery, DeviceSpec, DeviceStatus, GpuDevice
from vramshare.kube.resources import ANNOTATION_LEDGER, API_VERSION, devices_path

log = structlog.get_logger("vramshare.controller")


class DeviceWriter:
    """Writes GpuDevices (see the module docstring)."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        state: ClusterState,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
    ) -> None:
        self.kube = kube
        self.state = state
        self.settings = settings
        self.metrics = metrics
        self.last_seen: dict[str, float] = {}
        """GPU UUID -> when this leader last saw it (newer than the stored times, which lag)."""
        self.marks: dict[str, str] = {}
        """GPU UUID -> its ledger mark at the last poll: one that moved since says webhooks commit on it."""
        self.figures_waiting: dict[str, float] = {}
        """GPU UUID -> since when a write of its booking figures alone has waited (`Write.BOOKINGS`)."""

    async def forget(self, device: GpuDevice, judged: Judged, *, now: float) -> None:
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
        self.last_seen.pop(gpu.uuid, None)
        self.marks.pop(gpu.uuid, None)
        self.figures_waiting.pop(gpu.uuid, None)
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

    async def write_device(
        self,
        judged: Judged,
        device: GpuDevice | None,
        *,
        bookings: Sequence[Reservation],
        now: float,
        dated: bool = False,
        checks: tuple[Check, ...] | None = None,
        budget: RefreshBudget,
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
        delivery = Delivery.of(self.settings.delivery_mode, checks) if checks else None
        desired = device_status(
            judged, previous, now=now, generation=device.meta.generation, delivery=delivery
        )
        self.last_seen[gpu.uuid] = judged.last_seen_at
        refresh_s = refresh_after(gpu.uuid, max_sample_age_s=self.settings.accounting.max_sample_age_s)
        why = why_write(desired, previous, refresh_s=refresh_s)
        mark = device.meta.annotations.get(ANNOTATION_LEDGER, "")
        committing = self.marks.get(gpu.uuid, mark) != mark
        self.marks[gpu.uuid] = mark
        if why is None:
            return True
        if why is Write.BOOKINGS:
            # Its sample is this poll's; only the bookings' figures wait (see defer_booking_figures).
            since = self.figures_waiting.get(gpu.uuid)
            waited = None if since is None else now - since
            if defer_booking_figures(committing=committing, deferred_s=waited):
                self.figures_waiting.setdefault(gpu.uuid, now)
                return True
        # Only the times moved: the stored figures are this poll's. Dated by the heartbeat, or refreshed
        # next poll (the oldest go first).
        if why is Write.REFRESH and (dated or not budget.take()):
            return True
        self.metrics.device_status_writes.labels(why.value).inc()
        written = await self._write_status(device, desired)
        if written is None:
            return False
        self.figures_waiting.pop(gpu.uuid, None)
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
        if judged.state is DeviceState.NOT_SHARED and (previous is None or previous.state != desired.state):
            log.warning("GPU not shared", uuid=gpu.uuid, node=gpu.node, why=judged.message)
            await self._device_event(
                device, Event(type="Warning", reason="GpuNotShared", message=judged.message), now=now
            )
        was_over = overused(previous)
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
        await post_device_event(self.kube, device, event, now=now, reporter=self.settings.identity)


async def post_device_event(
    kube: KubeClient, device: GpuDevice, event: Event, *, now: float, reporter: str
) -> None:
    """An event about a GpuDevice (cluster-scoped, so recorded in the default namespace)."""
    await post_event(
        kube,
        namespace="default",
        involved=Involved(
            api_version=API_VERSION, kind="GpuDevice", name=device.meta.name, uid=device.meta.uid
        ),
        event=event,
        now=now,
        reporter=reporter,
    )
