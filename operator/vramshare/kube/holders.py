"""Holder pods on the wire (`vramshare.domain.holds`): the pod the controller creates to hold one GPU
through NVIDIA's device plugin, and what it reads back from one."""

from __future__ import annotations

from vramshare.domain.holds import Holder, HolderState
from vramshare.kube.client import Obj
from vramshare.kube.resources import parse_time

HOLDER_COMPONENT = "gpu-holder"
LABEL_COMPONENT = "app.kubernetes.io/component"
HOLDER_SELECTOR = f"{LABEL_COMPONENT}={HOLDER_COMPONENT}"
# Not under vramshare.io/: the chart's pinning policy reserves that prefix to pods vramshare admits.
LABEL_HOLDER_NODE = "holder.vramshare.io/node"
"""The node a holder was made for (the scheduler is told to put it there and nowhere else)."""
ANNOTATION_HELD_GPU = "holder.vramshare.io/gpu"
"""Written by the holder on itself: the UUID of the GPU NVML shows in its container."""
ANNOTATION_RELEASE = "holder.vramshare.io/release-requested-at"
"""Written by the controller (Unix seconds): give the GPU back. Its GPU leaves sharing first; the pod is
deleted once nothing can be booked there."""
HOLDER_PREFIX = "vramshare-hold-"
HOLDER_COMMAND = "vramshare-holder"


def holder_from_wire(pod: Obj) -> Holder:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    node = (meta.get("labels") or {}).get(LABEL_HOLDER_NODE, "")
    annotations = meta.get("annotations") or {}
    uuid = str(annotations.get(ANNOTATION_HELD_GPU, ""))
    try:
        release_at = float(annotations.get(ANNOTATION_RELEASE, "") or 0.0)
    except ValueError:
        release_at = 0.0
    phase = status.get("phase", "Pending")
    if (
        meta.get("deletionTimestamp")
        or phase in ("Succeeded", "Failed")
        or spec.get("nodeName", node) != node
    ):
        state = HolderState.LEAVING
    # The device plugin's allocation is the pod's: a restarting container still holds the GPU.
    elif phase == "Running" and uuid.startswith("GPU-"):
        state = HolderState.RELEASING if release_at > 0 else HolderState.HOLDING
    else:
        state = HolderState.ACQUIRING
    return Holder(
        name=str(meta.get("name", "")),
        node=node,
        gpu_uuid=uuid,
        state=state,
        created_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        release_requested_at=release_at,
    )


def holder_pod(
    *,
    node: str,
    image: str,
    service_account: str,
    priority_class: str,
    runtime_class: str,
    pull_policy: str = "IfNotPresent",
    host_network: bool = False,
    api_server: str = "",
) -> Obj:
    """A pod that holds one GPU of `node` through the device plugin, as long as it runs."""
    spec: Obj = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                }
            }
        },
        # GPU nodes are often tainted for GPU pods only; a holder is one.
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 5,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "holder",
                "image": image,
                "imagePullPolicy": pull_policy,
                "command": [HOLDER_COMMAND],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    *(
                        [
                            {"name": "KUBERNETES_SERVICE_HOST", "value": api_server.rpartition(":")[0]},
                            {"name": "KUBERNETES_SERVICE_PORT", "value": api_server.rpartition(":")[2]},
                        ]
                        if api_server
                        else []
                    ),
                ],
                "resources": {
                    "requests": {"cpu": "5m", "memory": "48Mi", "nvidia.com/gpu": "1"},
                    "limits": {"memory": "128Mi", "nvidia.com/gpu": "1"},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    if priority_class:
        spec["priorityClassName"] = priority_class
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if host_network:
        spec["hostNetwork"] = True
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": HOLDER_PREFIX,
            "labels": {
                "app.kubernetes.io/name": "vramshare",
                LABEL_COMPONENT: HOLDER_COMPONENT,
                LABEL_HOLDER_NODE: node,
            },
        },
        "spec": spec,
    }
