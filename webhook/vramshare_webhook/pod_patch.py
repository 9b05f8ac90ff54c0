"""What vramshare writes into a pod: pure functions from the pod as the API server sends it to a JSON Patch.

The patch pins a pod to its GPU: `NVIDIA_VISIBLE_DEVICES=<UUID>` and `CUDA_VISIBLE_DEVICES=0` in every
container and init container (replacing values the user set, never duplicating an entry), a required
node affinity to the GPU's node ANDed into every existing term (a pod with several GPUs on one node gets
their UUIDs as a list and `CUDA_VISIBLE_DEVICES=0,...,N-1`), and vramshare's annotations (which
replace any `vramshare.io/*` annotation the user wrote) plus the label `vramshare.io/reservation`, by
which the controller lists GPU pods. Whole lists and maps are replaced in one operation each, which is
simpler to get right than editing entries in place. A pod without a request is hidden from the GPUs
(`hide_gpus_patch`), and debug containers see the pod's GPUs or none (`ephemeral_patch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from vramshare.kube.pods import (
    ANNOTATED_GUARDRAILS,
    QUEUE_GATE,
    affinity_on,
    placement_annotations,
)
from vramshare.kube.resources import (
    ANNOTATION_GPU_UUID,
    ANNOTATION_PREFIX,
    ANNOTATION_RESERVATION,
    LABEL_RESERVATION,
)
from vramshare_webhook.delivery_modes import (
    device_mounts,
    foreign_device_mounts,
    foreign_gpu_requests,
    is_device_mount,
)
from vramshare_webhook.patching import Obj, Operation, pointer
from vramshare_webhook.patching import containers as _containers
from vramshare_webhook.pod import CUDA_DEVICES, HIDDEN, VISIBLE_DEVICES, Placement, pod_annotations


def _with_env(container: Obj, values: dict[str, str]) -> list[Obj]:
    return _with_env_entries(container, [{"name": k, "value": v} for k, v in values.items()])


def _with_env_entries(container: Obj, entries: list[Obj]) -> list[Obj]:
    """The container's env with `entries` replacing any of the same names (never duplicated)."""
    names = {e["name"] for e in entries}
    kept = [e for e in container.get("env") or [] if not (isinstance(e, dict) and e.get("name") in names)]
    return kept + entries


def placement_patch(
    pod: Obj, placement: Placement, *, guardrails: Callable[[Obj], dict[str, str]] | None = None
) -> list[Operation]:
    """The JSON Patch that puts `pod` on `placement`'s GPU; `guardrails` gives each container's budget
    variables (see `vramshare.domain.guardrails`)."""
    ops: list[Operation] = []
    # CUDA numbers the visible devices from 0, in the order NVIDIA_VISIBLE_DEVICES lists them.
    env = {
        VISIBLE_DEVICES: ",".join(placement.gpu_uuids),
        CUDA_DEVICES: ",".join(str(i) for i in range(len(placement.gpu_uuids))),
    }
    for key, i, c in _containers(pod):
        values = {**(guardrails(c) if guardrails is not None else {}), **env}
        ops.append({"op": "add", "path": pointer("spec", key, i, "env"), "value": _with_env(c, values)})
    ops.append(
        {
            "op": "add",
            "path": pointer("spec", "affinity"),
            "value": affinity_on(pod.get("spec", {}), placement.node),
        }
    )
    ours = placement_annotations(
        reservation=placement.reservation,
        gpu_uuid=",".join(placement.gpu_uuids),
        gpu_index=",".join(str(i) for i in placement.gpu_indexes),
        node=placement.node,
    )
    # Device-list mounts the pod brought would add GPUs beyond the booked ones (the delivery mode
    # volume-mounts adds its own after these).
    ops += foreign_device_mounts(pod)
    # vramshare's queue gate on a pod admitted directly is the user's copy: nobody would lift it.
    gates = pod.get("spec", {}).get("schedulingGates") or []
    if any(isinstance(g, dict) and g.get("name") == QUEUE_GATE for g in gates):
        kept = [g for g in gates if not (isinstance(g, dict) and g.get("name") == QUEUE_GATE)]
        ops.append({"op": "add", "path": pointer("spec", "schedulingGates"), "value": kept})
    return ops + _marking(pod, annotations=ours, reservation=placement.reservation)


def _marking(pod: Obj, *, annotations: dict[str, str], reservation: str) -> list[Operation]:
    """vramshare's annotations (replacing every vramshare.io/* one the pod has) and the reservation
    label, by which the controller lists GPU pods."""
    # A CDI request for NVIDIA GPUs would add devices beyond the booked ones: only vramshare's stay.
    current = pod_annotations(pod)
    foreign = set(foreign_gpu_requests(current))
    kept = {k: v for k, v in current.items() if not k.startswith(ANNOTATION_PREFIX) and k not in foreign}
    labels = pod.get("metadata", {}).get("labels")
    labels = {
        k: v
        for k, v in (labels if isinstance(labels, dict) else {}).items()
        if not k.startswith(ANNOTATION_PREFIX)
    }
    return [
        {"op": "add", "path": pointer("metadata", "annotations"), "value": {**kept, **annotations}},
        {
            "op": "add",
            "path": pointer("metadata", "labels"),
            "value": {**labels, LABEL_RESERVATION: reservation},
        },
    ]


def _from_annotation(name: str, annotation: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}}}


def queue_patch(
    pod: Obj, *, reservation: str, guardrails: Callable[[Obj], dict[str, str]] | None = None
) -> list[Operation]:
    """The JSON Patch that makes `pod` wait in the queue: vramshare's scheduling gate, and an environment
    that the kubelet resolves from the pod's annotations when the container starts, after the
    controller has written the chosen GPU there and lifted the gate. With `guardrails` (the budget
    known before the GPU is: the booked MiB), the fractions and the MPS limit come from annotations the
    controller writes with the placement; a container that sets them itself keeps its own."""
    ops: list[Operation] = []
    for key, i, c in _containers(pod):
        env: list[Obj] = [
            _from_annotation(VISIBLE_DEVICES, ANNOTATION_GPU_UUID),
            {"name": CUDA_DEVICES, "value": "0"},
        ]
        if guardrails is not None:
            own = {str(e.get("name")) for e in c.get("env") or [] if isinstance(e, dict)}
            env += [{"name": k, "value": v} for k, v in guardrails(c).items()]
            env += [
                _from_annotation(name, annotation)
                for name, annotation in ANNOTATED_GUARDRAILS.items()
                if name not in own
            ]
        ops.append({"op": "add", "path": pointer("spec", key, i, "env"), "value": _with_env_entries(c, env)})
    gates = [
        g
        for g in pod.get("spec", {}).get("schedulingGates") or []
        if isinstance(g, dict) and g.get("name") != QUEUE_GATE
    ]
    ops.append(
        {"op": "add", "path": pointer("spec", "schedulingGates"), "value": [*gates, {"name": QUEUE_GATE}]}
    )
    ops += foreign_device_mounts(pod)
    return ops + _marking(pod, annotations={ANNOTATION_RESERVATION: reservation}, reservation=reservation)


def hide_gpus_patch(pod: Obj) -> list[Operation]:
    """For pods without a GPU request: `NVIDIA_VISIBLE_DEVICES=void` (`HIDDEN`), so CUDA images
    (which default to `all`) see no GPU at all, whatever runtime class runs them; no CDI request for
    NVIDIA devices in an annotation (NVIDIA's runtime in CDI mode and its NRI plugin honour those before
    the variable); no device-list mount (a hardened toolkit honours those instead of the variable); and
    no vramshare.io/* labels or annotations (`strip_patch`)."""
    return (
        [
            {
                "op": "add",
                "path": pointer("spec", key, i, "env"),
                "value": _with_env(c, {VISIBLE_DEVICES: HIDDEN}),
            }
            for key, i, c in _containers(pod)
        ]
        + foreign_device_mounts(pod)
        + strip_patch(pod, also=foreign_gpu_requests(pod_annotations(pod)))
    )


def strip_patch(pod: Obj, *, also: Iterable[str] = ()) -> list[Operation]:
    """The pod's labels and annotations without any vramshare.io/* key, nor the annotations in `also`
    (none when it has none): a pod vramshare did not admit must not look like one to the controller."""
    meta = pod.get("metadata", {})
    dropped = set(also)
    ops: list[Operation] = []
    for field in ("labels", "annotations"):
        values = meta.get(field)

        def gone(key: object, field: str = field) -> bool:
            return str(key).startswith(ANNOTATION_PREFIX) or (field == "annotations" and key in dropped)

        if isinstance(values, dict) and any(gone(k) for k in values):
            kept = {k: v for k, v in values.items() if not gone(k)}
            ops.append({"op": "add", "path": pointer("metadata", field), "value": kept})
    return ops


def ephemeral_patch(pod: Obj, *, gpus: Sequence[str] = (), device_lists: bool = False) -> list[Operation]:
    """For debug containers added to a running pod (`kubectl debug`): `gpus`, the pod's own GPUs as its
    booking confirms them (see `vramshare_webhook.admission.debug`), or none at all. With
    `device_lists` (delivery mode volume-mounts: the pod has vramshare's volume) they get the same
    device-list mounts as the pod's containers; otherwise they may bring none."""
    env = (
        {VISIBLE_DEVICES: ",".join(gpus), CUDA_DEVICES: ",".join(str(i) for i in range(len(gpus)))}
        if gpus
        else {VISIBLE_DEVICES: HIDDEN}
    )
    listed = bool(gpus) and device_lists
    ops: list[Operation] = []
    for i, c in enumerate(pod.get("spec", {}).get("ephemeralContainers") or []):
        if not isinstance(c, dict):
            continue
        ops.append(
            {
                "op": "add",
                "path": pointer("spec", "ephemeralContainers", i, "env"),
                "value": _with_env(c, env),
            }
        )
        mounts = [m for m in c.get("volumeMounts") or [] if not is_device_mount(m)]
        if listed:
            mounts += device_mounts(gpus)
        if mounts != (c.get("volumeMounts") or []):
            ops.append(
                {
                    "op": "add",
                    "path": pointer("spec", "ephemeralContainers", i, "volumeMounts"),
                    "value": mounts,
                }
            )
    return ops
