"""Whether a delivery mode can hand a node's GPUs to pods: a preflight from what the cluster shows.

vramshare cannot look inside a node's container runtime. It reads what the cluster publishes about it:
the RuntimeClasses, the handlers each kubelet reports (`status.runtimeHandlers`), the GPU Operator's
ClusterPolicy (`spec.cdi.enabled`, `spec.cdi.nriPluginEnabled`), and labels an operator sets on nodes
where nothing else tells (`vramshare.io/default-runtime`, `vramshare.io/nri-plugin`,
`vramshare.io/device-list-mounts`). Each mode gets one of three results, with a message that says what
was read and what to do:

- Delivers: the evidence says the mode gives pods their GPU on this node;
- CannotDeliver: it says pods would run without their GPU (or not start), e.g. `env` where the GPU
  Operator 25.10+ left runc the default runtime;
- Unknown: nothing published says either way.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

MODES = ("env", "runtime-class", "cdi", "volume-mounts")
"""The webhook's delivery modes (vramshare_webhook.delivery_modes.DeliveryMode), in the order shown."""
DEFAULT_RUNTIME_LABEL = "vramshare.io/default-runtime"
NRI_PLUGIN_LABEL = "vramshare.io/nri-plugin"
DEVICE_LIST_MOUNTS_LABEL = "vramshare.io/device-list-mounts"


class Result(StrEnum):
    DELIVERS = "Delivers"
    CANNOT = "CannotDeliver"
    UNKNOWN = "Unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeClassView:
    name: str
    handler: str
    node_selector: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuOperatorView:
    """The GPU Operator's ClusterPolicy, as far as delivery goes (None: the field is not set)."""

    name: str
    cdi_enabled: bool | None
    nri_plugin_enabled: bool | None


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRuntimeView:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    runtime_handlers: tuple[str, ...] | None = None
    """The handlers its kubelet reports (status.runtimeHandlers; "" is the default); None: not reported."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    mode: str
    result: Result
    message: str


def check_node(
    *,
    node: NodeRuntimeView,
    runtime_class: str,
    runtime_classes: Sequence[RuntimeClassView],
    gpu_operator: GpuOperatorView | None,
) -> tuple[Check, ...]:
    """Every mode's result on `node` (`runtime_class`: the class the runtime-class mode sets)."""
    return (
        _env(node, gpu_operator),
        _runtime_class(node, runtime_class, runtime_classes),
        _cdi(node, gpu_operator),
        _volume_mounts(node),
    )


def _env(node: NodeRuntimeView, operator: GpuOperatorView | None) -> Check:
    declared = node.labels.get(DEFAULT_RUNTIME_LABEL)
    if declared is not None:
        if declared.strip().lower() == "nvidia":
            return Check(
                mode="env",
                result=Result.DELIVERS,
                message=f"node label {DEFAULT_RUNTIME_LABEL}=nvidia: NVIDIA's runtime is the default runtime",
            )
        return Check(
            mode="env",
            result=Result.CANNOT,
            message=f"node label {DEFAULT_RUNTIME_LABEL}={declared}: the default runtime is not NVIDIA's, "
            "so NVIDIA_VISIBLE_DEVICES alone gives pods no GPU; use delivery mode runtime-class",
        )
    if operator is not None and operator.cdi_enabled:
        return Check(
            mode="env",
            result=Result.CANNOT,
            message=f"the GPU Operator's ClusterPolicy {operator.name} has spec.cdi.enabled: true: since "
            "GPU Operator 25.10 NVIDIA's runtime is then not the default runtime, and runc ignores "
            "NVIDIA_VISIBLE_DEVICES (pods get no GPU); use delivery mode runtime-class",
        )
    if operator is not None:
        return Check(
            mode="env",
            result=Result.DELIVERS,
            message=f"the GPU Operator's ClusterPolicy {operator.name} has CDI off: its toolkit makes "
            "NVIDIA's runtime the default runtime",
        )
    return Check(
        mode="env",
        result=Result.UNKNOWN,
        message="nothing tells whether NVIDIA's runtime is this node's default runtime (no GPU Operator "
        f"ClusterPolicy); label the node {DEFAULT_RUNTIME_LABEL}=nvidia, or =runc",
    )


def _runtime_class(node: NodeRuntimeView, name: str, classes: Sequence[RuntimeClassView]) -> Check:
    found = next((c for c in classes if c.name == name), None)
    if found is None:
        return Check(
            mode="runtime-class",
            result=Result.CANNOT,
            message=f'RuntimeClass "{name}" does not exist, so pods naming it are refused (the GPU Operator '
            "creates it; or set runtime_class_name to the class whose handler is NVIDIA's runtime)",
        )
    off = {k: v for k, v in found.node_selector.items() if node.labels.get(k) != v}
    if off:
        wanted = ",".join(f"{k}={v}" for k, v in sorted(off.items()))
        return Check(
            mode="runtime-class",
            result=Result.CANNOT,
            message=f'RuntimeClass "{name}" schedules its pods only onto nodes labelled {wanted}; this '
            "node is not",
        )
    if node.runtime_handlers is None:
        return Check(
            mode="runtime-class",
            result=Result.UNKNOWN,
            message=f'RuntimeClass "{name}" exists (handler "{found.handler}"), but the node does not '
            "report its runtime's handlers (status.runtimeHandlers, kubelet 1.30+)",
        )
    if found.handler not in node.runtime_handlers:
        shown = ", ".join(h or '"" (the default)' for h in node.runtime_handlers) or "none"
        return Check(
            mode="runtime-class",
            result=Result.CANNOT,
            message=f'the node\'s container runtime has no handler "{found.handler}" (RuntimeClass '
            f'"{name}"), only {shown}: pods naming the class fail to start',
        )
    return Check(
        mode="runtime-class",
        result=Result.DELIVERS,
        message=f'RuntimeClass "{name}" runs pods with the node\'s handler "{found.handler}"',
    )


def _cdi(node: NodeRuntimeView, operator: GpuOperatorView | None) -> Check:
    if node.labels.get(NRI_PLUGIN_LABEL, "").strip().lower() == "true":
        return Check(
            mode="cdi",
            result=Result.DELIVERS,
            message=f"node label {NRI_PLUGIN_LABEL}=true: NVIDIA's NRI plugin injects the annotated devices",
        )
    if operator is not None:
        if operator.nri_plugin_enabled and operator.cdi_enabled is not False:
            return Check(
                mode="cdi",
                result=Result.DELIVERS,
                message=f"the GPU Operator's ClusterPolicy {operator.name} has spec.cdi.nriPluginEnabled: "
                "true: its NRI plugin injects the devices a pod's nvidia.cdi.k8s.io annotations name",
            )
        return Check(
            mode="cdi",
            result=Result.CANNOT,
            message=f"the GPU Operator's ClusterPolicy {operator.name} does not enable the NRI plugin "
            "(spec.cdi.nriPluginEnabled), so nothing reads the nvidia.cdi.k8s.io annotations; enable it "
            "or use delivery mode runtime-class",
        )
    return Check(
        mode="cdi",
        result=Result.UNKNOWN,
        message="nothing tells whether NVIDIA's NRI plugin runs on this node (no GPU Operator "
        f"ClusterPolicy); label the node {NRI_PLUGIN_LABEL}=true where it does",
    )


def _volume_mounts(node: NodeRuntimeView) -> Check:
    if node.labels.get(DEVICE_LIST_MOUNTS_LABEL, "").strip().lower() == "true":
        return Check(
            mode="volume-mounts",
            result=Result.DELIVERS,
            message=f"node label {DEVICE_LIST_MOUNTS_LABEL}=true: NVIDIA's runtime takes device-list mounts",
        )
    return Check(
        mode="volume-mounts",
        result=Result.UNKNOWN,
        message="the toolkit's accept-nvidia-visible-devices-as-volume-mounts is not published; label "
        f"the node {DEVICE_LIST_MOUNTS_LABEL}=true where it is set (Bottlerocket sets it)",
    )
