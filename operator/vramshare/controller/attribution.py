"""DCGM's pod attribution (issue #43): dcgm-exporter, with its Kubernetes mapping on (the GPU Operator's
default), names on each GPU's series the pods the kubelet's pod-resources API says a device plugin gave
that GPU. A pod so named that is a device-plugin pod on that GPU's node, and not one of vramshare's
holders, has the GPU whole: vramshare does not share it, whatever the node's labels or the mode, with
an event when that starts (the inventory's GpuNotShared).

The series' plain `pod`/`namespace` may instead name the exporter's own pod (the scrape's target
labels): checking the pod itself, which requests no nvidia.com/* device, sets that case aside. Each
verdict is kept for `VERDICT_TTL_S`; at most `CHECKS_PER_POLL` pods are read each poll."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vramshare.domain.inventory import Sample
from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare.kube.holders import HOLDER_COMPONENT, LABEL_COMPONENT
from vramshare.kube.pods import requested_device_resources
from vramshare.kube.resources import is_object_name, pod_path

VERDICT_TTL_S = 30.0
CHECKS_PER_POLL = 20


@dataclass(frozen=True, slots=True)
class _Verdict:
    until: float
    node: str
    """The node the pod runs on, when it is a device-plugin pod that is not a holder; else ""."""


def device_plugin_node(pod: Obj, *, holders_namespace: str) -> str:
    """The node of a pod holding NVIDIA devices from a device plugin, other than vramshare's holders."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if (
        meta.get("namespace") == holders_namespace
        and (meta.get("labels") or {}).get(LABEL_COMPONENT) == HOLDER_COMPONENT
    ):
        return ""
    return str(spec.get("nodeName") or "") if requested_device_resources(pod) else ""


class PodAttribution:
    def __init__(
        self, *, kube: KubeClient, holders_namespace: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kube = kube
        self.holders_namespace = holders_namespace
        self.clock = clock
        self._verdicts: dict[tuple[str, str], _Verdict] = {}

    async def taken(self, samples: Iterable[Sample]) -> dict[str, str]:
        """UUID -> why it is taken by a pod DCGM attributes it to."""
        now, checks, out = self.clock(), 0, {}
        for sample in samples:
            for namespace, name in sample.pods:
                if not (is_object_name(namespace) and is_object_name(name)):
                    continue  # a label is not a name to send back to the API server
                verdict = self._verdicts.get((namespace, name))
                if verdict is None or verdict.until <= now:
                    if checks >= CHECKS_PER_POLL:
                        continue  # judged on a later poll
                    checks += 1
                    verdict = _Verdict(until=now + VERDICT_TTL_S, node=await self._node(namespace, name))
                    self._verdicts[(namespace, name)] = verdict
                if verdict.node and verdict.node == sample.node:
                    out[sample.uuid] = (
                        f"taken by pod {namespace}/{name}: DCGM attributes the GPU to it, and it got the GPU "
                        "whole from a device plugin (it is neither a vramshare holder nor a task)"
                    )
        self._verdicts = {k: v for k, v in self._verdicts.items() if v.until > now}
        return out

    async def _node(self, namespace: str, name: str) -> str:
        try:
            pod = await self.kube.get(pod_path(namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return ""
            raise
        return device_plugin_node(pod, holders_namespace=self.holders_namespace)
