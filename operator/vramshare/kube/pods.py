"""Pod spec edits that both the webhook and the controller make: pure functions over the pod as the
API server sends it.

The webhook pins an admitted pod to its GPU's node at creation; in queue mode the controller does the
same later, on the gated pod (Kubernetes allows adding node affinity to a pod that still has
scheduling gates), and then lifts its gate.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from vramshare.domain.scheduling import NodeRules, NodeView, Requirement, Taint, Term, Toleration
from vramshare.kube.resources import (
    ANNOTATION_GPU_INDEX,
    ANNOTATION_GPU_UUID,
    ANNOTATION_NODE,
    ANNOTATION_RESERVATION,
)

Obj = dict[str, Any]

HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_NAME_FIELD = "metadata.name"
"""What vramshare pins a pod's node by (`matchFields`): the node's name, which is what the GPU's
GpuDevice names. The `kubernetes.io/hostname` label differs from it where kubelets run with
--hostname-override or nodes are named by FQDN."""
MODEL_ANNOTATION = "gpu-model"
"""The pod annotation asking for a GPU model as DCGM reports it: exact, or a pattern with * and ?."""
QUEUE_GATE = "vramshare.io/gpu-memory"
GUARDRAILS_ANNOTATION = "gpu-guardrails"
GUARDRAILS_NAMESPACE_LABEL = "vramshare.io/guardrails"
MPS_LABEL = "nvidia.com/mps.capable"
"""Node label (GPU feature discovery) of nodes running the CUDA MPS control daemon."""
ANNOTATION_FRACTION = "vramshare.io/gpu-memory-fraction"
ANNOTATION_MPS_LIMIT = "vramshare.io/mps-memory-limit"
ANNOTATED_GUARDRAILS = {
    "VRAMSHARE_GPU_MEMORY_FRACTION": ANNOTATION_FRACTION,
    "XLA_PYTHON_CLIENT_MEM_FRACTION": ANNOTATION_FRACTION,
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ANNOTATION_MPS_LIMIT,
}
"""In queue mode: the budget variables that depend on the GPU, read from what the controller writes."""
"""The scheduling gate a queued pod waits behind until the controller has booked a GPU for it."""


def pinned_nodes(pod: Obj) -> frozenset[str] | None:
    """The nodes the pod is already confined to, if it is; None when it may go anywhere.

    From `spec.nodeName`, a `kubernetes.io/hostname` nodeSelector, and a required node affinity whose
    every term allows node names (`matchFields` on metadata.name, as vramshare pins) or hostnames with
    `In` (terms are ORed: their names add up). Several of these together intersect. Other constraints
    (zones, labels) are left to the scheduler.
    """
    spec = pod.get("spec", {})
    allowed: list[frozenset[str]] = []
    if spec.get("nodeName"):
        allowed.append(frozenset([str(spec["nodeName"])]))
    selector = spec.get("nodeSelector") or {}
    if selector.get(HOSTNAME_LABEL):
        allowed.append(frozenset([str(selector[HOSTNAME_LABEL])]))
    terms = _required_terms(spec)
    union: set[str] = set()
    for term in terms:
        hosts = [
            frozenset(str(v) for v in e.get("values") or [])
            for e in term.get("matchExpressions") or []
            if e.get("key") == HOSTNAME_LABEL and e.get("operator") == "In"
        ] + [
            frozenset(str(v) for v in e.get("values") or [])
            for e in term.get("matchFields") or []
            if e.get("key") == NODE_NAME_FIELD and e.get("operator") == "In"
        ]
        if not hosts:
            union = set()
            break  # this term allows any host: the affinity does not confine the pod
        union |= frozenset.intersection(*hosts)
    else:
        if terms:
            allowed.append(frozenset(union))
    return frozenset.intersection(*allowed) if allowed else None


def _required_terms(spec: Obj) -> list[Obj]:
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    return [t for t in required.get("nodeSelectorTerms") or [] if isinstance(t, dict)]


def affinity_on(spec: Obj, node: str) -> Obj:
    affinity = copy.deepcopy(spec.get("affinity") or {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    ours = {"key": NODE_NAME_FIELD, "operator": "In", "values": [node]}
    terms = [t for t in required.get("nodeSelectorTerms") or [] if isinstance(t, dict)]
    if not terms:
        terms = [{}]
    # Terms are ORed, requirements inside a term ANDed: the GPU's node must hold in every term. A term
    # that already has it (a reinvocation sees the first pass's patch) is left as it is.
    for term in terms:
        fields = term.get("matchFields") or []
        if ours not in fields:
            term["matchFields"] = [*fields, ours]
    required["nodeSelectorTerms"] = terms
    return affinity


def placement_annotations(
    *, reservation: str, gpu_uuid: str, gpu_index: int | str, node: str
) -> dict[str, str]:
    """The annotations that record a pod's placement (its environment reads the GPU from them). A pod
    with several GPUs gets their UUIDs and indexes as comma-separated lists, in the same order."""
    return {
        ANNOTATION_RESERVATION: reservation,
        ANNOTATION_GPU_UUID: gpu_uuid,
        ANNOTATION_GPU_INDEX: str(gpu_index),
        ANNOTATION_NODE: node,
    }


KUEUE_GATE = "kueue.x-k8s.io/admission"
"""The scheduling gate Kueue's pod integration puts on the pods it queues, lifted when it admits them."""
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label that puts a pod in a Kueue LocalQueue (Kueue's webhook then gates it)."""


PLACEMENT_WITHDRAWN = "vramshare.io/placement-withdrawn"
"""On a gated pod: `<entry>@<generation>`, the placement a leader took back. Written, conditional on
the pod as read, before the entry is unplaced; a release of that placement still on its way from an
earlier leader (conditional on the same pod version) then fails, and is not retried."""


def placement_id(entry_name: str, generation: int) -> str:
    """Which placement of a queue entry: its name and the generation its spec had when placed."""
    return f"{entry_name}@{generation}"


def gated(pod: Obj) -> bool:
    """Whether the pod still waits behind vramshare's scheduling gate."""
    return any(g.get("name") == QUEUE_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def other_gates(pod: Obj) -> list[str]:
    """The pod's scheduling gates other than vramshare's: someone else (Kueue) still holds it."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return [str(g.get("name")) for g in gates if isinstance(g, dict) and g.get("name") != QUEUE_GATE]


def release_patch(pod: Obj, *, annotations: dict[str, str], node: str) -> Obj:
    """The merge patch that places a gated pod: vramshare's annotations (its environment reads the GPU
    from them), the node affinity to the GPU's node, and the gate lifted. The pod's resourceVersion is
    the precondition, so the patch applies to the pod as it was read."""
    spec = pod.get("spec") or {}
    gates = [g for g in spec.get("schedulingGates") or [] if g.get("name") != QUEUE_GATE]
    return {
        "metadata": {"resourceVersion": pod["metadata"]["resourceVersion"], "annotations": annotations},
        "spec": {"affinity": affinity_on(spec, node), "schedulingGates": gates or None},
    }


def _strings(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def _requirements(items: object) -> tuple[Requirement, ...]:
    return tuple(
        Requirement(
            key=str(e.get("key", "")), operator=str(e.get("operator", "")), values=_strings(e.get("values"))
        )
        for e in (items if isinstance(items, list) else [])
        if isinstance(e, dict)
    )


def node_rules(pod: Obj) -> NodeRules:
    """The pod's node constraints, read leniently (the API server has validated real pods)."""
    spec = pod.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    selector = spec.get("nodeSelector")
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    terms = None
    if isinstance(required, dict):
        terms = tuple(
            Term(
                expressions=_requirements(t.get("matchExpressions")),
                fields=_requirements(t.get("matchFields")),
            )
            for t in required.get("nodeSelectorTerms") or []
            if isinstance(t, dict)
        )
    tolerations = tuple(
        Toleration(
            key=str(t.get("key") or ""),
            operator=str(t.get("operator") or "Equal"),
            value=str(t.get("value") or ""),
            effect=str(t.get("effect") or ""),
        )
        for t in spec.get("tolerations") or []
        if isinstance(t, dict)
    )
    return NodeRules(
        node_name=str(spec["nodeName"]) if spec.get("nodeName") else None,
        node_selector={str(k): str(v) for k, v in selector.items()} if isinstance(selector, dict) else {},
        terms=terms,
        tolerations=tolerations,
    )


def node_view(node: Obj) -> NodeView:
    """What the scheduler's filters read of a Node object."""
    meta, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
    ready = next(
        (c.get("status") == "True" for c in status.get("conditions") or [] if c.get("type") == "Ready"), True
    )
    return NodeView(
        name=meta["name"],
        labels=dict(meta.get("labels") or {}),
        taints=tuple(
            Taint(key=t.get("key", ""), value=t.get("value", "") or "", effect=t.get("effect", ""))
            for t in spec.get("taints") or []
        ),
        unschedulable=bool(spec.get("unschedulable")),
        ready=ready,
        runtime_handlers=(
            tuple(str(h.get("name") or "") for h in status["runtimeHandlers"] if isinstance(h, dict))
            if isinstance(status.get("runtimeHandlers"), list)
            else None
        ),
        extended={str(k): str(v) for k, v in (status.get("allocatable") or {}).items() if "/" in str(k)},
    )


def requested_device_resources(pod: Obj) -> list[str]:
    """`nvidia.com/*` resources any container requests: such pods belong to the device plugin. A
    quantity of zero asks for no device (the plugin gives the container none), so it does not count:
    such a pod is hidden like any other, or a CUDA image in it would see every GPU."""
    found = set()
    spec = pod.get("spec") or {}
    containers = [c for key in ("initContainers", "containers") for c in spec.get(key) or []]
    for c in (c for c in containers if isinstance(c, dict)):
        resources = c.get("resources") or {}
        for section in ("limits", "requests"):
            for name, quantity in (resources.get(section) or {}).items():
                if str(name).startswith("nvidia.com/") and not _zero(quantity):
                    found.add(str(name))
    return sorted(found)


_QUANTITY = re.compile(r"[+]?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+|[kMGTPE]i?|[mun])?", re.ASCII)


def _zero(quantity: object) -> bool:
    """Whether a resource quantity as the API server sends it ("0", "0m", "0.0", 0) is zero."""
    if isinstance(quantity, int | float) and not isinstance(quantity, bool):
        return quantity == 0
    match = _QUANTITY.fullmatch(str(quantity).strip())
    return match is not None and float(match.group(1)) == 0
