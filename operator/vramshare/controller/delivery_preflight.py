"""The delivery preflight's reads: RuntimeClasses and the GPU Operator's ClusterPolicy, every
`delivery_check_interval_s`; the nodes come from the watch cache. The judgement is pure
(vramshare.domain.delivery_judgement); the inventory loop writes it into each GpuDevice's status."""

from __future__ import annotations

import asyncio

import structlog

from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain.delivery_judgement import (
    Check,
    GpuOperatorView,
    NodeRuntimeView,
    RuntimeClassView,
    check_node,
)
from vramshare.kube.client import ApiError, KubeClient, Obj

log = structlog.get_logger("vramshare.controller")

RUNTIME_CLASSES = "/apis/node.k8s.io/v1/runtimeclasses"
CLUSTER_POLICIES = "/apis/nvidia.com/v1/clusterpolicies"
"""The GPU Operator's ClusterPolicy (nvidia.com/v1): absent where the GPU Operator is not installed."""


def runtime_class_view(obj: Obj) -> RuntimeClassView:
    scheduling = obj.get("scheduling") or {}
    selector = scheduling.get("nodeSelector") if isinstance(scheduling, dict) else None
    return RuntimeClassView(
        name=str(obj["metadata"]["name"]),
        handler=str(obj.get("handler", "")),
        node_selector={str(k): str(v) for k, v in (selector or {}).items()},
    )


def gpu_operator_view(obj: Obj) -> GpuOperatorView:
    cdi = (obj.get("spec") or {}).get("cdi") or {}

    def flag(name: str) -> bool | None:
        value = cdi.get(name) if isinstance(cdi, dict) else None
        return value if isinstance(value, bool) else None

    return GpuOperatorView(
        name=str(obj["metadata"]["name"]),
        cdi_enabled=flag("enabled"),
        nri_plugin_enabled=flag("nriPluginEnabled"),
    )


class DeliveryPreflight:
    def __init__(self, *, kube: KubeClient, settings: ControllerSettings, state: ClusterState) -> None:
        self.kube = kube
        self.settings = settings
        self.state = state
        self.runtime_classes: list[RuntimeClassView] = []
        self.gpu_operator: GpuOperatorView | None = None
        self.read = False
        """Whether the first refresh succeeded (until then no node is judged)."""
        self._unreadable: set[str] = set()

    async def _list(self, path: str) -> list[Obj] | None:
        """The collection's items; [] where the API does not exist (404); None where it cannot be read
        (logged once per path)."""
        try:
            answer = await self.kube.list(path)
        except ApiError as exc:
            if exc.status == 404:
                return []
            if path not in self._unreadable:
                self._unreadable.add(path)
                log.warning("delivery preflight cannot read", path=path, error=str(exc))
            return None
        self._unreadable.discard(path)
        return list(answer.get("items") or [])

    async def refresh(self) -> None:
        classes, policies = await asyncio.gather(self._list(RUNTIME_CLASSES), self._list(CLUSTER_POLICIES))
        if classes is not None:
            self.runtime_classes = [runtime_class_view(c) for c in classes]
        if policies is not None:
            # One ClusterPolicy is what the GPU Operator supports; with several, the first by name.
            views = sorted((gpu_operator_view(p) for p in policies), key=lambda v: v.name)
            self.gpu_operator = views[0] if views else None
        self.read = self.read or (classes is not None and policies is not None)

    def checks(self) -> dict[str, tuple[Check, ...]]:
        """Every mode's result on each known node; empty before the first read."""
        if not self.read:
            return {}
        return {
            node.name: check_node(
                node=NodeRuntimeView(
                    name=node.name, labels=node.labels, runtime_handlers=node.runtime_handlers
                ),
                runtime_class=self.settings.runtime_class_name,
                runtime_classes=self.runtime_classes,
                gpu_operator=self.gpu_operator,
            )
            for node in self.state.nodes.items.values()
        }

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a preflight must never stop the controller
                log.exception("delivery preflight failed")
            await asyncio.sleep(self.settings.delivery_check_interval_s)
