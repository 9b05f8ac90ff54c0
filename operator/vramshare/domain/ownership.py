"""Whose GPUs these are: NVIDIA's device plugin, which the GPU Operator installs on every GPU node, hands
the same GPUs out whole to pods that request `nvidia.com/gpu`, and neither it nor the scheduler knows
vramshare's bookings (issue #43). On a node that advertises `nvidia.com/gpu`:

- dedicated to vramshare by the operator (`vramshare.io/dedicated=true`, or the GPU Operator's
  `nvidia.com/gpu.deploy.device-plugin=false`): every GPU is vramshare's;
- handing each GPU to several pods (time-slicing or MPS replicas): none is shared, held or not;
- otherwise, in mode `hold` (the default), vramshare shares the GPUs it holds (`vramshare.domain.holds`)
  and no other; in mode `exclude`, none.

Pure: what the nodes and holders say in, a reason per GPU out ("" where vramshare may share it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from vramshare.domain.holds import Holder, HolderState, held

DEVICE_PLUGIN_RESOURCE = "nvidia.com/gpu"
"""What NVIDIA's device plugin advertises in a node's allocatable."""
DEDICATED_LABEL = "vramshare.io/dedicated"
"""The node label (value "true") by which an operator gives a node's GPUs to vramshare alone."""
GPU_OPERATOR_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"
"""The GPU Operator's own switch: "false" keeps its device plugin off the node."""
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
"""GPU feature discovery's label: how many pods the plugin hands each GPU to (time-slicing, MPS)."""
SHARING_STRATEGY_LABEL = "nvidia.com/gpu.sharing-strategy"
"""GPU feature discovery's label: none, time-slicing or mps."""


class DevicePluginGpus(StrEnum):
    """What vramshare does with GPUs NVIDIA's device plugin hands out (setting device_plugin_gpus)."""

    HOLD = "hold"
    """Share those it holds through the plugin (holder pods)."""
    EXCLUDE = "exclude"
    """Share none: only nodes dedicated to vramshare."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGpus:
    """What a Node object says about who may hand its GPUs out."""

    name: str
    labels: Mapping[str, str]
    allocatable: Mapping[str, str]
    """Its extended resources, as status.allocatable has them."""

    @property
    def advertised(self) -> int:
        return _count(self.allocatable.get(DEVICE_PLUGIN_RESOURCE))

    @property
    def dedicated(self) -> bool:
        return (
            self.labels.get(DEDICATED_LABEL) == "true"
            or self.labels.get(GPU_OPERATOR_PLUGIN_LABEL) == "false"
        )


def _count(quantity: str | None) -> int:
    try:
        return int(str(quantity or "0").strip())
    except ValueError:
        return 1  # present but not a plain count: take it as advertised


@dataclass(frozen=True, slots=True, kw_only=True)
class Ownership:
    """Why each GPU is not vramshare's to share, if it is not."""

    nodes: Mapping[str, str] = field(default_factory=dict)
    """Node -> why none of its GPUs is shared."""
    unheld: Mapping[str, str] = field(default_factory=dict)
    """Node -> why one of its GPUs that vramshare does not hold is not shared (mode hold)."""
    held: frozenset[str] = frozenset()
    """The GPUs vramshare holds through the device plugin."""
    releasing: Mapping[str, str] = field(default_factory=dict)
    """GPU -> why it is out of sharing while its holder gives it back."""
    elsewhere: Mapping[str, str] = field(default_factory=dict)
    """GPU -> why something else may hand it out whatever its node says (a DRA driver publishes it)."""

    def reason(self, *, node: str, uuid: str) -> str:
        if uuid in self.elsewhere:
            return self.elsewhere[uuid]
        if node in self.nodes:
            return self.nodes[node]
        if uuid in self.releasing:
            return self.releasing[uuid]
        if node in self.unheld and uuid not in self.held:
            return self.unheld[node]
        return ""

    @property
    def holdable(self) -> frozenset[str]:
        """The nodes where vramshare shares what it holds."""
        return frozenset(self.unheld)


def _replicas(node: NodeGpus, gpus_seen: int) -> int:
    """How many pods the plugin hands each GPU to: GPU feature discovery's label, else what the node
    advertises against the GPUs DCGM sees on it."""
    labelled = _count(node.labels.get(REPLICAS_LABEL)) if REPLICAS_LABEL in node.labels else 1
    if node.labels.get(SHARING_STRATEGY_LABEL) in ("time-slicing", "mps"):
        labelled = max(labelled, 2)
    counted = node.advertised // gpus_seen if gpus_seen > 0 and node.advertised > gpus_seen else 1
    return max(labelled, counted)


def ownership(
    nodes: Iterable[NodeGpus],
    *,
    mode: DevicePluginGpus = DevicePluginGpus.EXCLUDE,
    holders: Iterable[Holder] = (),
    gpus_seen: Mapping[str, int] | None = None,
    can_hold: bool = True,
    elsewhere: Mapping[str, str] | None = None,
) -> Ownership:
    """`gpus_seen`: node -> how many GPUs DCGM reports there; `can_hold`: holders can be made (mode
    hold with a holder image set); `elsewhere`: GPU -> why another allocator hands it out (DRA)."""
    gpus_seen = gpus_seen or {}
    holders = list(holders)
    not_shared: dict[str, str] = {}
    unheld: dict[str, str] = {}
    for node in nodes:
        advertised = node.advertised
        if advertised <= 0 or node.dedicated:
            continue
        plugin = (
            f"node {node.name} advertises {DEVICE_PLUGIN_RESOURCE}: {advertised} (NVIDIA's device plugin "
            "hands its GPUs out whole, and knows nothing of vramshare's bookings)"
        )
        dedicate = (
            f"label the node {DEDICATED_LABEL}=true, or {GPU_OPERATOR_PLUGIN_LABEL}=false, to give it to "
            "vramshare"
        )
        replicas = _replicas(node, gpus_seen.get(node.name, 0))
        if replicas > 1:
            not_shared[node.name] = (
                f"node {node.name}'s device plugin hands each GPU to {replicas} pods (time-slicing or MPS "
                "replicas): vramshare shares no such GPU, held or not, since a replica's pod may use all "
                f"of its memory; {dedicate}"
            )
        elif mode is DevicePluginGpus.EXCLUDE:
            not_shared[node.name] = f"{plugin}; {dedicate} (device_plugin_gpus is exclude)"
        elif not can_hold:
            not_shared[node.name] = f"{plugin}; vramshare holds none: holder_image is not set; {dedicate}"
        else:
            acquiring = sorted(
                h.name for h in holders if h.node == node.name and h.state is HolderState.ACQUIRING
            )
            now = (
                f"acquiring one now (holder pod {', '.join(acquiring)})"
                if acquiring
                else "it holds another when those it holds are booked"
            )
            unheld[node.name] = (
                f"not held: {plugin}; vramshare shares the GPUs of this node it holds through the plugin, "
                f"and {now}"
            )
    releasing = {
        h.gpu_uuid: (
            f"being given back to NVIDIA's device plugin: nothing was booked on it beyond the idle held "
            f"GPUs each node keeps (holder pod {h.name} goes once no booking can land here)"
        )
        for h in holders
        if h.state is HolderState.RELEASING and h.gpu_uuid and h.node in unheld
    }
    return Ownership(
        nodes=not_shared,
        unheld=unheld,
        held=frozenset(held(holders)),
        releasing=releasing,
        elsewhere=dict(elsewhere or {}),
    )


def not_shared(nodes: Iterable[NodeGpus]) -> dict[str, str]:
    """Node -> why vramshare may not share its GPUs, where it holds none (mode exclude)."""
    return dict(ownership(nodes).nodes)
