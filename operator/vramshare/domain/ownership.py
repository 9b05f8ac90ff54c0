"""Whose GPUs these are: NVIDIA's device plugin, which the GPU Operator installs on every GPU node, hands
the same GPUs out whole to pods that request `nvidia.com/gpu`, and neither it nor the scheduler knows
vramshare's bookings. A GPU on a node that advertises `nvidia.com/gpu` is not vramshare's to share unless
the operator dedicated the node to vramshare (issue #43). Pure: what a node says in, a reason out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DEVICE_PLUGIN_RESOURCE = "nvidia.com/gpu"
"""What NVIDIA's device plugin advertises in a node's allocatable."""
DEDICATED_LABEL = "vramshare.io/dedicated"
"""The node label (value "true") by which an operator gives a node's GPUs to vramshare alone."""
GPU_OPERATOR_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"
"""The GPU Operator's own switch: "false" keeps its device plugin off the node."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGpus:
    """What a Node object says about who may hand its GPUs out."""

    name: str
    labels: Mapping[str, str]
    allocatable: Mapping[str, str]
    """Its extended resources, as status.allocatable has them."""


def _count(quantity: str | None) -> int:
    try:
        return int(str(quantity or "0").strip())
    except ValueError:
        return 1  # present but not a plain count: take it as advertised


def not_shared(nodes: Iterable[NodeGpus]) -> dict[str, str]:
    """Node -> why vramshare may not share its GPUs, for the nodes where something else hands them out."""
    out = {}
    for node in nodes:
        advertised = _count(node.allocatable.get(DEVICE_PLUGIN_RESOURCE))
        if advertised <= 0:
            continue
        if (
            node.labels.get(DEDICATED_LABEL) == "true"
            or node.labels.get(GPU_OPERATOR_PLUGIN_LABEL) == "false"
        ):
            continue
        out[node.name] = (
            f"node {node.name} advertises {DEVICE_PLUGIN_RESOURCE}: {advertised} (NVIDIA's device plugin "
            "hands its GPUs out whole, and knows nothing of vramshare's bookings); label the node "
            f"{DEDICATED_LABEL}=true, or {GPU_OPERATOR_PLUGIN_LABEL}=false, to share them"
        )
    return out
