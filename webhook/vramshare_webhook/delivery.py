"""How the booked GPU reaches the container: the delivery mode, a policy of its own.

- `env`: only `NVIDIA_VISIBLE_DEVICES=<UUIDs>` (and `CUDA_VISIBLE_DEVICES`), for nodes whose default
  runtime is NVIDIA's (GPU Operator before 25.10, a toolkit configured with `--set-as-default`).
- `runtime-class`: the same variables and the pod's `runtimeClassName` (default `nvidia`), for nodes
  whose default runtime is runc and NVIDIA's runtime is the handler of that class: GPU Operator 25.10
  and later, with CDI on (NVIDIA's runtime in CDI mode turns a bare UUID in the variable into the CDI
  device `nvidia.com/gpu=<UUID>`, found in the specs nvidia-ctk generates).

Chosen per cluster (`delivery_mode`) and per namespace (label `vramshare.io/delivery`).

Whatever the mode, a pod gets no GPU it did not book through vramshare: CDI device requests in
annotations (`cdi.k8s.io/*`, which NVIDIA's runtime in CDI mode prefers over the variable) that name
NVIDIA GPUs are removed from every pod vramshare patches (`foreign_gpu_requests`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

DELIVERY_NAMESPACE_LABEL = "vramshare.io/delivery"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
"""Where CDI device requests are read from annotations (containerd, CRI-O and NVIDIA's runtime in CDI
mode, whose `annotation-prefixes` default to it)."""


class DeliveryMode(StrEnum):
    ENV = "env"
    RUNTIME_CLASS = "runtime-class"


@dataclass(frozen=True, kw_only=True)
class Delivery:
    mode: DeliveryMode
    runtime_class: str

    def patch(self, pod: dict[str, Any]) -> list[dict[str, Any]]:
        """What this mode adds to a GPU pod's patch beyond the variables (which every mode sets)."""
        if self.mode is DeliveryMode.RUNTIME_CLASS and not pod_runtime_class(pod):
            return [{"op": "add", "path": "/spec/runtimeClassName", "value": self.runtime_class}]
        return []

    def conflict(self, pod: dict[str, Any]) -> str | None:
        """Why a GPU pod cannot be delivered its GPU in this mode (None: it can)."""
        named = pod_runtime_class(pod)
        if self.mode is DeliveryMode.RUNTIME_CLASS and named and named != self.runtime_class:
            return (
                f'pod spec.runtimeClassName is "{named}": vramshare delivers GPUs through the runtime class '
                f'"{self.runtime_class}" here (delivery mode runtime-class); leave runtimeClassName unset '
                f'or set it to "{self.runtime_class}"'
            )
        return None


def delivery_for(*, default: DeliveryMode, runtime_class: str, namespace_label: str | None) -> Delivery | str:
    """The namespace's delivery: its label when it names a mode, else the default. A label naming no
    mode is the operator's error, said to the pod's creator (a str) rather than ignored."""
    mode = default
    if namespace_label is not None:
        try:
            mode = DeliveryMode(namespace_label.strip().lower())
        except ValueError:
            accepted = ", ".join(m.value for m in DeliveryMode)
            return (
                f'namespace label "{DELIVERY_NAMESPACE_LABEL}" is "{namespace_label}": accepted values are '
                f"{accepted}"
            )
    return Delivery(mode=mode, runtime_class=runtime_class)


def pod_runtime_class(pod: dict[str, Any]) -> str:
    spec = pod.get("spec")
    value = spec.get("runtimeClassName") if isinstance(spec, dict) else None
    return value if isinstance(value, str) else ""


def foreign_gpu_requests(annotations: dict[str, Any], *, kind: str = "nvidia.com/gpu") -> list[str]:
    """The annotation keys that request GPUs of `kind` by CDI: removed, since only vramshare hands out
    GPUs in the namespaces it manages (NVIDIA's runtime would honour them before the variable)."""
    found = []
    for key, value in annotations.items():
        if not str(key).startswith(CDI_ANNOTATION_PREFIX) or not isinstance(value, str):
            continue
        devices = [d.strip() for d in value.split(",")]
        if any(d.split("=", 1)[0] == kind for d in devices):
            found.append(str(key))
    return sorted(found)
