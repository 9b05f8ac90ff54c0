"""The leader's holders (`vramshare.domain.holds`): each inventory poll, which GPUs vramshare holds
through NVIDIA's device plugin (read by the ownership judgement), then holders created where a node has
too few idle held GPUs and deleted where one has been idle too long; a held GPU with bookings whose
holder went is reported (Warning event on its GpuDevice, a metric, the log)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import structlog

from vramshare.controller.devices.writer import post_device_event
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain import Reservation
from vramshare.domain.holds import Holder, HolderState, HoldNode, held, lost, plan_holds
from vramshare.domain.inventory import DeviceState
from vramshare.domain.ownership import DevicePluginGpus, NodeGpus, Ownership, ownership
from vramshare.domain.scheduling import NodeView
from vramshare.kube.client import ApiError, KubeClient
from vramshare.kube.dra import dra_reason
from vramshare.kube.events import Event
from vramshare.kube.holders import ANNOTATION_RELEASE, holder_pod
from vramshare.kube.resources import device_name, pod_path, pods_path

log = structlog.get_logger("vramshare.controller")


class HoldKeeper:
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
        self.idle_since: dict[str, float] = {}
        """Held GPU -> when it was last seen booked (or first seen held): this leader's memory; a new
        leader starts each clock again, so it gives back later, never sooner."""
        self._held: dict[str, Holder] = {}

    @property
    def holders(self) -> list[Holder]:
        return list(self.state.holders.items.values())

    def ownership(
        self, nodes: Iterable[NodeView], *, gpus_seen: dict[str, int], taken: Mapping[str, str] | None = None
    ) -> Ownership:
        """`taken`: GPU -> the pod DCGM attributes it to (`vramshare.controller.attribution`)."""
        return ownership(
            (NodeGpus(name=n.name, labels=n.labels, allocatable=n.extended) for n in nodes),
            mode=self.settings.device_plugin_gpus,
            holders=self.holders,
            gpus_seen=gpus_seen,
            can_hold=bool(self.settings.holder_image),
            elsewhere={
                **(taken or {}),
                **{uuid: dra_reason(gpu) for uuid, gpu in self.state.dra_gpus().items()},
            },
        )

    async def keep(
        self,
        *,
        owned: Ownership,
        nodes: Sequence[NodeView],
        reservations: Sequence[Reservation],
        now: float,
    ) -> None:
        holders = self.holders
        counts = Counter(h.state.value for h in holders)
        for state in HolderState:
            self.metrics.holders.labels(state.value).set(counts.get(state.value, 0))
        booked = {r.gpu_uuid for r in reservations if r.is_active}
        holding = held(holders)
        for uuid in holding:
            if uuid in booked or uuid not in self.idle_since:
                self.idle_since[uuid] = now
        for uuid in set(self.idle_since) - set(holding):
            del self.idle_since[uuid]
        # Releasing holders still hold: only a holder gone (or never holding) loses its GPU.
        present = {
            h.gpu_uuid: h for h in holders if h.state is HolderState.RELEASING and h.gpu_uuid
        } | holding
        for holder in lost(self._held, present, booked):
            await self._report_lost(holder, reservations, now=now)
        self._held = present
        if self.settings.device_plugin_gpus is not DevicePluginGpus.HOLD or not self.settings.holder_image:
            return
        by_name = {n.name: n for n in nodes}
        plan = plan_holds(
            nodes=(
                HoldNode(
                    name=name,
                    advertised=NodeGpus(name=name, labels={}, allocatable=by_name[name].extended).advertised,
                    schedulable=by_name[name].ready and not by_name[name].unschedulable,
                )
                for name in owned.holdable
                if name in by_name
            ),
            holders=holders,
            booked=booked,
            idle_since=self.idle_since,
            now=now,
            settings=self.settings.holds,
            out_of_sharing={
                d.spec.uuid
                for d in self.state.devices.items.values()
                if d.status is not None and d.status.state == DeviceState.NOT_SHARED.value
            },
        )
        for node, count in sorted(plan.acquire.items()):
            for _ in range(count):
                await self._acquire(node)
        for name in plan.release:
            await self._mark(name, release_at=now)
        for name in plan.keep:
            await self._mark(name, release_at=None)
        for name in plan.give_back:
            await self._give_back(name)

    async def _acquire(self, node: str) -> None:
        pod = holder_pod(
            node=node,
            image=self.settings.holder_image,
            service_account=self.settings.holder_service_account,
            priority_class=self.settings.holder_priority_class,
            runtime_class=self.settings.holder_runtime_class,
            pull_policy=self.settings.holder_image_pull_policy,
            host_network=self.settings.holder_host_network,
            api_server=self.settings.holder_api_server,
        )
        try:
            created = await self.kube.create(pods_path(self.settings.namespace), pod)
        except ApiError as exc:  # a quota, a policy: said once a poll until it passes
            log.warning("cannot create a GPU holder", node=node, status=exc.status, error=exc.message)
            return
        self.metrics.holds_acquired.inc()
        log.info(
            "acquiring a GPU through NVIDIA's device plugin", node=node, holder=created["metadata"]["name"]
        )

    async def _mark(self, name: str, *, release_at: float | None) -> None:
        """Ask a holder to give its GPU back (its GPU leaves sharing at the next poll's write, and a
        commit racing that write conflicts: see vramshare.kube.ledger.commit), or, with None, to hold on
        (a booking landed first)."""
        value = None if release_at is None else f"{release_at:.3f}"
        try:
            await self.kube.merge_patch(
                pod_path(self.settings.namespace, name),
                {"metadata": {"annotations": {ANNOTATION_RELEASE: value}}},
            )
        except ApiError as exc:
            if not exc.not_found:
                raise
            return
        log.info("GPU hold to be given back" if value else "GPU hold kept: booked meanwhile", holder=name)

    async def _give_back(self, name: str) -> None:
        try:
            await self.kube.delete(pod_path(self.settings.namespace, name))
        except ApiError as exc:
            if not exc.not_found:
                raise
        self.metrics.holds_released.inc()
        log.info(
            "GPU given back to NVIDIA's device plugin: idle",
            holder=name,
            idle_release_s=self.settings.holders_idle_release_s,
        )

    async def _report_lost(self, holder: Holder, reservations: Sequence[Reservation], *, now: float) -> None:
        on_gpu = sorted(
            f"{r.namespace}/{r.pod}" for r in reservations if r.is_active and r.gpu_uuid == holder.gpu_uuid
        )
        message = (
            f"vramshare no longer holds GPU {holder.gpu_uuid} on node {holder.node}: its holder pod "
            f"{self.settings.namespace}/{holder.name} went (deleted, evicted, preempted or its node "
            f"drained), so NVIDIA's device plugin may hand the GPU out whole. No new booking goes there; "
            f"the {len(on_gpu)} booked keep theirs until they end: {', '.join(on_gpu[:10])}"
        )
        self.metrics.holds_lost.inc()
        log.warning(
            "GPU hold lost", uuid=holder.gpu_uuid, node=holder.node, holder=holder.name, bookings=on_gpu
        )
        device = self.state.devices.items.get(f"/{device_name(holder.gpu_uuid)}")
        if device is None:
            return
        await post_device_event(
            self.kube,
            device,
            Event(type="Warning", reason="GpuHoldLost", message=message),
            now=now,
            reporter=self.settings.identity,
        )
