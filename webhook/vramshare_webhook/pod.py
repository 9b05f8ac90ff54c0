"""Reading a pod: pure functions over the pod as the API server sends it. `read_pod` reads once what a
decision needs (`PodFacts`); what vramshare writes back is `vramshare_webhook.pod_patch`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from vramshare.domain.request import COUNT_ANNOTATION
from vramshare.domain.scheduling import NodeRules
from vramshare.kube.pods import (
    GUARDRAILS_ANNOTATION,
    KUEUE_GATE,
    KUEUE_QUEUE_LABEL,
    MODEL_ANNOTATION,
    node_rules,
    other_gates,
    pinned_nodes,
    requested_device_resources,
)
from vramshare.kube.resources import (
    ANNOTATION_GPU_INDEX,
    ANNOTATION_GPU_UUID,
    ANNOTATION_NODE,
    ANNOTATION_PREFIX,
    ANNOTATION_RESERVATION,
    is_object_name,
)
from vramshare_webhook.delivery_modes import (
    foreign_gpu_requests,
    is_device_mount,
)
from vramshare_webhook.patching import CONTAINER_LISTS, Obj
from vramshare_webhook.patching import containers as _containers

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
HIDDEN = "void"
"""What a pod without a request is told: no GPU and nothing else injected. Not "none": NVIDIA's
runtime in CDI mode (GPU Operator 25.10+'s runtime class, or its default runtime where CDI is the
default) turns "none" into the CDI device nvidia.com/gpu=none, which the specs nvidia-ctk writes do not
name, and the container fails to start ("unresolvable CDI devices"); "void" it reads as no request at
all (internal/config/image/cuda_image.go), as the legacy hook does."""
GPU_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9-]{1,124}$", re.ASCII)
"""A GPU UUID as NVIDIA writes it (GPU-<uuid>), as found in a pod's vramshare.io/gpu-uuid."""
CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"


def shape_problem(pod: Obj) -> str | None:
    """Why `pod` is not shaped like a Pod, for the fields vramshare reads; None when it is.

    The API server only sends well-typed pods; this guards the webhook against anything else that
    reaches its port, so such input gets a 400 instead of an internal error.
    """
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    if not isinstance(meta, dict):
        return "metadata must be an object"
    if not isinstance(spec, dict):
        return "spec must be an object"
    for key in ("name", "generateName"):
        if key in meta and not isinstance(meta[key], str):
            return f"metadata.{key} must be a string"
        # A pod name is a lower-case RFC 1123 subdomain: anything else the API server refuses after
        # admission, and vramshare names its booking after it. generateName is a prefix, checked as the
        # API server does (a trailing '-' stands for the generated suffix).
        value = meta.get(key) or ""
        prefix = key == "generateName" and len(value) > 1 and value.endswith("-")
        named = value[:-1] + "a" if prefix else value
        if value and not is_object_name(named):
            return (
                f"metadata.{key} {value[:64]!r} is not a pod name: lower-case letters, digits, '-' and "
                "'.', starting and ending with a letter or digit, at most 253 characters"
            )
    for key in ("annotations", "labels"):
        value = meta.get(key)
        if value is not None and not (
            isinstance(value, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        ):
            return f"metadata.{key} must map strings to strings"
    for key in ("nodeSelector", "affinity"):
        if spec.get(key) is not None and not isinstance(spec[key], dict):
            return f"spec.{key} must be an object"
    node_affinity = (spec.get("affinity") or {}).get("nodeAffinity")
    if node_affinity is not None:
        required = (
            node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
            if isinstance(node_affinity, dict)
            else None
        )
        terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
        if (
            not isinstance(node_affinity, dict)
            or (required is not None and not isinstance(required, dict))
            or (
                terms is not None
                and not (
                    isinstance(terms, list)
                    and all(
                        isinstance(t, dict)
                        and isinstance(t.get("matchExpressions") or [], list)
                        and all(isinstance(e, dict) for e in t.get("matchExpressions") or [])
                        for t in terms
                    )
                )
            )
        ):
            return "spec.affinity.nodeAffinity must follow the NodeAffinity schema"
    if spec.get("nodeName") is not None and not isinstance(spec["nodeName"], str):
        return "spec.nodeName must be a string"
    for key in (*CONTAINER_LISTS, "ephemeralContainers"):
        listed = spec.get(key)
        if listed is None:
            continue
        if not isinstance(listed, list) or not all(isinstance(c, dict) for c in listed):
            return f"spec.{key} must be a list of objects"
        for i, c in enumerate(listed):
            env = c.get("env")
            if env is not None and not (
                isinstance(env, list)
                and all(isinstance(e, dict) and isinstance(e.get("name", ""), str) for e in env)
            ):
                return f"spec.{key}[{i}].env must be a list of objects with a string name"
            resources = c.get("resources")
            if resources is not None and not (
                isinstance(resources, dict)
                and all(isinstance(resources.get(k) or {}, dict) for k in ("limits", "requests"))
            ):
                return f"spec.{key}[{i}].resources must be an object with limits and requests objects"
    return None


def pod_annotations(pod: Obj) -> dict[str, str]:
    value = pod.get("metadata", {}).get("annotations")
    return value if isinstance(value, dict) else {}


def display_name(pod: Obj) -> str:
    """The pod's name, or its generateName prefix followed by '*' before the API server names it."""
    meta = pod.get("metadata", {})
    return str(meta.get("name") or (str(meta.get("generateName") or "pod") + "*"))


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a pod goes: the reservation behind it and the GPU it gets."""

    reservation: str
    gpu_uuid: str
    gpu_index: int
    node: str
    more: tuple[tuple[str, int], ...] = ()
    """A pod with several GPUs: the others' (UUID, index), on the same node."""

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return (self.gpu_uuid, *(u for u, _ in self.more))

    @property
    def gpu_indexes(self) -> tuple[int, ...]:
        return (self.gpu_index, *(i for _, i in self.more))


def spoofed(pod: Obj) -> list[str]:
    """What the user set that only vramshare may set (logged, then overwritten)."""
    annotations = pod_annotations(pod)
    found = [f"annotation {k}" for k in annotations if k.startswith(ANNOTATION_PREFIX)]
    found += [f"annotation {k}" for k in foreign_gpu_requests(annotations)]
    for key, i, c in _containers(pod):
        for e in c.get("env") or []:
            if isinstance(e, dict) and e.get("name") in (VISIBLE_DEVICES, CUDA_DEVICES):
                found.append(f"{key}[{i}].env {e.get('name')}")
        found += [
            f"{key}[{i}].volumeMounts {m.get('mountPath')}"
            for m in c.get("volumeMounts") or []
            if is_device_mount(m)
        ]
    return found


def literal_env(container: Obj) -> dict[str, str]:
    """The container's env variables that have a literal value."""
    return {
        str(e["name"]): str(e["value"])
        for e in container.get("env") or []
        if isinstance(e, dict) and "name" in e and isinstance(e.get("value"), str)
    }


def queued_entry_of(pod: Obj) -> str | None:
    """The queue entry an earlier pass of this pod's admission made (on reinvocation), if it names one
    and no placement."""
    a = pod_annotations(pod)
    if ANNOTATION_GPU_UUID in a:
        return None
    name = a.get(ANNOTATION_RESERVATION)
    return name if is_object_name(name) else None  # anything else is not ours: decided afresh


def claimed_marks(pod: Obj) -> list[str]:
    """The vramshare.io/* labels and annotations a pod carries (only vramshare may set them)."""
    meta = pod.get("metadata", {})
    return [
        f"{kind} {key}"
        for kind, field in (("label", "labels"), ("annotation", "annotations"))
        for key in (meta.get(field) if isinstance(meta.get(field), dict) else {})
        if str(key).startswith(ANNOTATION_PREFIX)
    ]


@dataclass(frozen=True, kw_only=True)
class PodFacts:
    """Everything a decision reads from a pod, read once (from a pod `shape_problem` accepted)."""

    display_name: str
    memory_request: str | None
    """The raw value of the memory annotation; None when the pod does not carry it."""
    device_resources: tuple[str, ...]
    """`nvidia.com/*` resources the pod requests (device-plugin pods)."""
    pinned_nodes: frozenset[str] | None
    node_rules: NodeRules
    """Its node constraints, judged against the Node objects when the webhook knows them."""
    claimed_placement: Placement | None
    """The placement the pod's vramshare.io/* annotations claim: an earlier pass, or copied by a user."""
    claimed_queue_entry: str | None
    """The queue entry they claim instead (an earlier pass in queue mode, or copied)."""
    queue_request: str | None
    """The raw value of the queue annotation; None when the pod does not carry it."""
    guardrails_request: str | None = None
    """The raw value of the annotation gpu-guardrails."""
    model_request: str | None = None
    """The GPU model the pod asks for (annotation gpu-model): exact, or a pattern with * and ?."""
    count_request: str | None = None
    """The raw value of the annotation gpu-count: how many GPUs, on one node."""
    task: str = ""
    """The task the pod runs, the same across its Airflow tries (a hold is kept for it)."""
    task_key: str = ""
    """`task` with its namespace, hashed to fit a label value."""
    overwritten: tuple[str, ...]
    """What the pod sets that only vramshare may set; a placement patch replaces it."""
    held_elsewhere: tuple[str, ...] = ()
    """Why another admission system decides when the pod may run: its scheduling gates other than
    vramshare's (Kueue's), or Kueue's queue label (Kueue's webhook may gate it after vramshare's pass)."""


AIRFLOW_TASK_LABELS = ("dag_id", "task_id", "run_id", "map_index")
"""Labels Airflow puts on the pods of the KubernetesPodOperator and the KubernetesExecutor: together
they name one task instance, whichever try the pod is for."""


def task_of(pod: Obj, *, namespace: str) -> tuple[str, str]:
    """(the task the pod runs, its key): from Airflow's labels when present, else the pod's name."""
    labels = pod.get("metadata", {}).get("labels")
    labels = labels if isinstance(labels, dict) else {}
    if labels.get("dag_id") and labels.get("task_id"):
        task = ".".join(str(labels[k]) for k in AIRFLOW_TASK_LABELS if labels.get(k))
    else:
        task = display_name(pod)
    key = hashlib.sha256(f"{namespace}\0{task}".encode()).hexdigest()[:40]
    return task, key


def read_pod(
    pod: Obj, *, annotation: str, queue_annotation: str = "gpu-queue", namespace: str = ""
) -> PodFacts:
    task, key = task_of(pod, namespace=namespace)
    return PodFacts(
        task=task,
        task_key=key,
        claimed_queue_entry=queued_entry_of(pod),
        queue_request=pod_annotations(pod).get(queue_annotation),
        model_request=pod_annotations(pod).get(MODEL_ANNOTATION),
        count_request=pod_annotations(pod).get(COUNT_ANNOTATION),
        guardrails_request=pod_annotations(pod).get(GUARDRAILS_ANNOTATION),
        display_name=display_name(pod),
        memory_request=pod_annotations(pod).get(annotation),
        device_resources=tuple(requested_device_resources(pod)),
        pinned_nodes=pinned_nodes(pod),
        node_rules=node_rules(pod),
        claimed_placement=placement_of(pod),
        overwritten=tuple(spoofed(pod)),
        held_elsewhere=tuple(held_elsewhere(pod)),
    )


def held_elsewhere(pod: Obj) -> list[str]:
    """See `PodFacts.held_elsewhere`."""
    # Read before the API server validates the pod: a name that is not a qualified name is not repeated.
    gates = other_gates(pod)
    reasons = [f"scheduling gate {g}" if _QUALIFIED.match(g) else "a scheduling gate" for g in gates[:4]]
    labels = pod.get("metadata", {}).get("labels")
    if isinstance(labels, dict) and labels.get(KUEUE_QUEUE_LABEL) and KUEUE_GATE not in gates:
        reasons.append(f"label {KUEUE_QUEUE_LABEL} (Kueue's webhook gates it)")
    return reasons


_QUALIFIED = re.compile(r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def placement_of(pod: Obj) -> Placement | None:
    """The placement recorded in a pod's annotations (on reinvocation), if complete."""
    a = pod_annotations(pod)
    try:
        uuids = a[ANNOTATION_GPU_UUID].split(",")
        indexes = [int(i) for i in a[ANNOTATION_GPU_INDEX].split(",")]
        if len(uuids) != len(indexes):
            return None
        # Copied or hand-written annotations are the user's: a value that cannot be ours (a path, a
        # query, 300 characters) is not looked up anywhere, and the pod is decided afresh.
        if not is_object_name(a[ANNOTATION_RESERVATION]) or not is_object_name(a[ANNOTATION_NODE]):
            return None
        if not all(GPU_UUID.match(u) for u in uuids):
            return None
        return Placement(
            reservation=a[ANNOTATION_RESERVATION],
            gpu_uuid=uuids[0],
            gpu_index=indexes[0],
            node=a[ANNOTATION_NODE],
            more=tuple(zip(uuids[1:], indexes[1:], strict=True)),
        )
    except (KeyError, ValueError):
        return None
