"""How the booked GPU reaches the container: the delivery mode, a policy of its own.

Every mode sets `NVIDIA_VISIBLE_DEVICES=<UUIDs>` and `CUDA_VISIBLE_DEVICES` in every container (the
variables CUDA reads, and NVIDIA's runtime where it takes them); each adds what its runtime setup needs:

- `env`: nothing more, for nodes whose default runtime is NVIDIA's (GPU Operator before 25.10, a toolkit
  configured with `--set-as-default`).
- `runtime-class`: the pod's `runtimeClassName` (default `nvidia`), for nodes whose default runtime is
  runc and NVIDIA's runtime is the handler of that class: GPU Operator 25.10 and later, with CDI on
  (NVIDIA's runtime in CDI mode turns a bare UUID in the variable into the CDI device
  `nvidia.com/gpu=<UUID>`, found in the specs nvidia-ctk generates).
- `cdi`: the pod annotation `nvidia.cdi.k8s.io/pod: nvidia.com/gpu=<UUID>,...`, which NVIDIA's NRI
  plugin (GPU Operator 25.10+, `cdi.nriPluginEnabled`) turns into CDI device injections that containerd
  applies to every container of the pod, under any runtime, runc included. (containerd itself reads CDI
  requests only from the annotations of a container's CRI config, which the kubelet fills from device
  plugins, never from the pod's annotations.)
- `volume-mounts`: a device-list mount per GPU at `/var/run/nvidia-container-devices/<UUID>` in every
  container, for toolkits that refuse the variable from unprivileged containers
  (`accept-nvidia-visible-devices-envvar-when-unprivileged = false`, `...-as-volume-mounts = true`, as
  Bottlerocket ships). NVIDIA's runtime takes only mounts whose source is `/dev/null`, so the volume is a
  `hostPath` (privileged and baseline namespaces), or a claim on a PersistentVolume whose hostPath is
  `/dev/null` (`device_list_claim`: restricted namespaces, which forbid hostPath volumes).

Chosen per cluster (`delivery_mode`) and per namespace (label `vramshare.io/delivery`).

Whatever the mode, a pod gets no GPU it did not book through vramshare: CDI requests for NVIDIA devices
in annotations (`foreign_gpu_requests`) and device-list mounts (`foreign_device_mounts`) are removed from
every pod vramshare patches.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vramshare.kube.resources import is_object_name
from vramshare_webhook.patching import CONTAINER_LISTS, Obj, Operation, containers, pointer

DELIVERY_NAMESPACE_LABEL = "vramshare.io/delivery"
CLAIM_NAMESPACE_LABEL = "vramshare.io/device-list-claim"
"""volume-mounts: the namespace's PersistentVolumeClaim of /dev/null (overrides device_list_claim)."""
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
"""Where NVIDIA's runtime in CDI mode reads CDI requests (its `annotation-prefixes` default), from the
annotations containerd passes it (a runtime's `pod_annotations`) or a device plugin wrote."""
NRI_CDI_ANNOTATION = "nvidia.cdi.k8s.io"
"""The key NVIDIA's NRI plugin reads, as `<key>/container.<name>`, `<key>/pod` or `<key>` itself
(containerd/nri's GetEffectiveAnnotation, in that order)."""
NRI_POD_ANNOTATION = f"{NRI_CDI_ANNOTATION}/pod"
DEVICE_LIST_ROOT = "/var/run/nvidia-container-devices"
"""Where NVIDIA's runtime looks for device-list mounts (internal/config/image/cuda_image.go)."""
DEVICE_LIST_VOLUME = "vramshare-gpus"
GPU_KIND = "nvidia.com/gpu"


class DeliveryMode(StrEnum):
    ENV = "env"
    RUNTIME_CLASS = "runtime-class"
    CDI = "cdi"
    VOLUME_MOUNTS = "volume-mounts"


@dataclass(frozen=True, kw_only=True)
class Delivery:
    mode: DeliveryMode
    runtime_class: str
    device_list_claim: str = ""
    """volume-mounts: the PersistentVolumeClaim (in the pod's namespace) bound to a hostPath
    PersistentVolume of /dev/null; empty: a hostPath volume in the pod."""

    @property
    def can_queue(self) -> bool:
        """Whether a pod can wait in the queue and get its GPU when the gate lifts: only the variables
        and the runtime class can be resolved then (the variable comes from an annotation the
        controller writes); a pod's mounts and NRI requests are fixed when it is created."""
        return self.mode in (DeliveryMode.ENV, DeliveryMode.RUNTIME_CLASS)

    def patch(self, pod: Obj, gpu_uuids: Sequence[str]) -> list[Operation]:
        """What this mode adds to a GPU pod's patch beyond the variables (which every mode sets)."""
        if self.mode is DeliveryMode.RUNTIME_CLASS and not pod_runtime_class(pod):
            return [{"op": "add", "path": "/spec/runtimeClassName", "value": self.runtime_class}]
        if self.mode is DeliveryMode.CDI:
            devices = ",".join(f"{GPU_KIND}={u}" for u in gpu_uuids)
            return [
                {
                    "op": "add",
                    "path": pointer("metadata", "annotations", NRI_POD_ANNOTATION),
                    "value": devices,
                }
            ]
        if self.mode is DeliveryMode.VOLUME_MOUNTS:
            return self._mounts_patch(pod, gpu_uuids)
        return []

    def _mounts_patch(self, pod: Obj, gpu_uuids: Sequence[str]) -> list[Operation]:
        source: Obj = (
            {"persistentVolumeClaim": {"claimName": self.device_list_claim, "readOnly": True}}
            if self.device_list_claim
            else {"hostPath": {"path": "/dev/null", "type": "CharDevice"}}
        )
        volumes = [
            v
            for v in pod.get("spec", {}).get("volumes") or []
            if not (isinstance(v, dict) and v.get("name") == DEVICE_LIST_VOLUME)
        ]
        ours = device_mounts(gpu_uuids)
        ops: list[Operation] = [
            {
                "op": "add",
                "path": "/spec/volumes",
                "value": [*volumes, {"name": DEVICE_LIST_VOLUME, **source}],
            }
        ]
        for key, i, c in containers(pod):
            ops.append(
                {
                    "op": "add",
                    "path": pointer("spec", key, i, "volumeMounts"),
                    "value": [*without_device_mounts(c), *ours],
                }
            )
        return ops

    def conflict(self, pod: Obj) -> str | None:
        """Why a GPU pod cannot be delivered its GPU in this mode (None: it can)."""
        named = pod_runtime_class(pod)
        if self.mode is DeliveryMode.RUNTIME_CLASS and named and named != self.runtime_class:
            return (
                f'pod spec.runtimeClassName is "{named}": vramshare delivers GPUs through the runtime class '
                f'"{self.runtime_class}" here (delivery mode runtime-class); leave runtimeClassName unset '
                f'or set it to "{self.runtime_class}"'
            )
        if self.mode is DeliveryMode.VOLUME_MOUNTS:
            taken = [
                f"spec.{key}[{i}]"
                for key, i, c in containers(pod)
                for m in c.get("volumeMounts") or []
                if isinstance(m, dict) and m.get("name") == DEVICE_LIST_VOLUME and not is_device_mount(m)
            ]
            if taken:
                return (
                    f'{", ".join(taken)} mounts a volume named "{DEVICE_LIST_VOLUME}": vramshare adds the '
                    "volume of that name for the GPU's device list (delivery mode volume-mounts); rename "
                    "the pod's volume"
                )
        return None


def delivery_for(
    *,
    default: DeliveryMode,
    runtime_class: str,
    namespace_labels: Mapping[str, str],
    device_list_claim: str = "",
) -> Delivery | str:
    """The namespace's delivery: its labels when they name a mode (and a claim), else the defaults. A
    label naming no mode or no valid claim is the operator's error, said to the pod's creator (a str)
    rather than ignored."""
    claim = namespace_labels.get(CLAIM_NAMESPACE_LABEL, device_list_claim)
    if claim and not is_object_name(claim):
        return (
            f'namespace label "{CLAIM_NAMESPACE_LABEL}" is "{claim}": accepted values are '
            "PersistentVolumeClaim names (lower-case DNS subdomains)"
        )
    namespace_label = namespace_labels.get(DELIVERY_NAMESPACE_LABEL)
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
    return Delivery(mode=mode, runtime_class=runtime_class, device_list_claim=claim)


def pod_runtime_class(pod: Obj) -> str:
    spec = pod.get("spec")
    value = spec.get("runtimeClassName") if isinstance(spec, dict) else None
    return value if isinstance(value, str) else ""


def _names_nvidia_device(value: str) -> bool:
    """Whether a comma-separated list of CDI names names a device of an NVIDIA vendor (nvidia.com,
    management.nvidia.com, ...): `<vendor>/<class>=<device>`."""
    for device in value.split(","):
        vendor = device.strip().split("=", 1)[0].split("/", 1)[0].lower()
        if vendor == "nvidia.com" or vendor.endswith(".nvidia.com"):
            return True
    return False


def foreign_gpu_requests(annotations: dict[str, Any]) -> list[str]:
    """The annotation keys that request NVIDIA devices by CDI: any key of NVIDIA's NRI plugin, and
    `cdi.k8s.io/*` keys naming an NVIDIA device. Removed, since only vramshare hands out GPUs in the
    namespaces it manages (NVIDIA's runtime and its NRI plugin honour them before the variable)."""
    found = []
    for key, value in annotations.items():
        key = str(key)
        if (
            key == NRI_CDI_ANNOTATION
            or key.startswith(NRI_CDI_ANNOTATION + "/")
            or (
                key.startswith(CDI_ANNOTATION_PREFIX)
                and isinstance(value, str)
                and _names_nvidia_device(value)
            )
        ):
            found.append(key)
    return sorted(found)


def is_device_mount(mount: Any) -> bool:
    """Whether a volumeMount is a device-list request: a path at or under DEVICE_LIST_ROOT (normalised,
    as NVIDIA's runtime does, so `/var/run//nvidia-container-devices/../nvidia-container-devices/all`
    counts too)."""
    value = mount.get("mountPath") if isinstance(mount, dict) else None
    if not isinstance(value, str):
        return False
    # As Go's filepath.Clean: a leading "//" is "/" (posixpath keeps it).
    path = posixpath.normpath("/" + value.lstrip("/"))
    return path == DEVICE_LIST_ROOT or path.startswith(DEVICE_LIST_ROOT + "/")


def unlisted_device_paths(pod: Obj) -> list[str]:
    """Mounts whose path names nvidia-container-devices without being a device-list request as
    `is_device_mount` reads it (`/x/nvidia-container-devices`): the chart's hiding policy refuses any
    path holding that name but vramshare's own, so such a pod is refused before anything is booked for
    it (issue #42, 6), rather than booked and then refused by the API server."""
    return [
        f"{key}[{i}] ({c.get('name')}) mountPath {m.get('mountPath')}"
        for key, i, c in containers(pod)
        for m in c.get("volumeMounts") or []
        if isinstance(m, dict)
        and isinstance(m.get("mountPath"), str)
        and "nvidia-container-devices" in m["mountPath"]
        and not is_device_mount(m)
    ]


# A hostPath volume that reaches the node's GPU devices or their driver's files: the root, /dev or under
# it, or any path naming nvidia; /dev/null (volume-mounts mode's device-list volume) gives nothing. The
# API server refuses hostPaths with "..", so a path cannot climb back into /dev. The chart's hiding
# policy tests the same expression (keep the two alike).
_EVERY_GPU_HOST_PATH = re.compile(r"^/+$|^/+dev(/.*)?$|nvidia")


def sees_every_gpu(pod: Obj) -> list[str]:
    """What in the pod would show its containers every GPU of the node, whatever NVIDIA_VISIBLE_DEVICES
    says: a privileged container (the runtime gives it the node's /dev) and a hostPath volume of the
    node's devices. Such a pod's booking would account for memory it does not confine itself to, so it
    is refused before anything is booked (issue #42, 9), as the chart's hiding policy refuses it in
    managed namespaces."""
    found = [
        f"{key}[{i}] ({c.get('name')}) securityContext.privileged: true"
        for key, i, c in containers(pod, (*CONTAINER_LISTS, "ephemeralContainers"))
        if isinstance(c.get("securityContext"), dict) and c["securityContext"].get("privileged") is True
    ]
    for i, volume in enumerate(pod.get("spec", {}).get("volumes") or []):
        host_path = volume.get("hostPath") if isinstance(volume, dict) else None
        path = host_path.get("path") if isinstance(host_path, dict) else None
        if isinstance(path, str) and path != "/dev/null" and _EVERY_GPU_HOST_PATH.search(path):
            found.append(f"volumes[{i}] ({volume.get('name')}) hostPath {path}")
    return found


def device_mounts(gpu_uuids: Sequence[str]) -> list[Obj]:
    """A container's device-list mounts for these GPUs (of vramshare's volume, /dev/null)."""
    return [
        {"name": DEVICE_LIST_VOLUME, "mountPath": f"{DEVICE_LIST_ROOT}/{u}", "readOnly": True}
        for u in gpu_uuids
    ]


def without_device_mounts(container: Obj) -> list[Obj]:
    return [m for m in container.get("volumeMounts") or [] if not is_device_mount(m)]


def foreign_device_mounts(pod: Obj, lists: tuple[str, ...] | None = None) -> list[Operation]:
    """Operations removing every device-list mount from the pod's containers (those that have one)."""
    chosen = containers(pod) if lists is None else containers(pod, lists)
    return [
        {"op": "add", "path": pointer("spec", key, i, "volumeMounts"), "value": without_device_mounts(c)}
        for key, i, c in chosen
        if any(is_device_mount(m) for m in c.get("volumeMounts") or [])
    ]
