"""vramshare's custom resources on the wire: API paths, and conversion to and from domain models.

Pure functions over plain dicts, so they are unit-tested without an API server.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from vramshare.domain import Gpu, Reservation, ReservationPhase

GROUP = "vramshare.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RESERVATIONS = "gpureservations"
DEVICES = "gpudevices"

ANNOTATION_RESERVATION = "vramshare.io/reservation"
ANNOTATION_GPU_UUID = "vramshare.io/gpu-uuid"
ANNOTATION_GPU_INDEX = "vramshare.io/gpu-index"
ANNOTATION_NODE = "vramshare.io/node"
ANNOTATION_PREFIX = "vramshare.io/"
LABEL_RESERVATION = "vramshare.io/reservation"
"""On admitted pods: the reservation's name, so the controller can list GPU pods by label."""
LABEL_COMMITTED = "vramshare.io/committed"
"""On reservations: "false" from creation until the commit's precondition held, then "true". Deciders
count both (a pending reservation may still win); observers of the ledger count only committed ones."""
LABEL_ACTIVE = "vramshare.io/active"
"""On reservations: "true" while Reserved or Bound, "false" once ended (set by the controller), so the
webhook lists only the live ledger, not the history kept for the retention period."""
LABEL_GPU = "vramshare.io/gpu"
"""On reservations: the GpuDevice name, so the ledger of one GPU can be listed by label."""
ANNOTATION_LEDGER = "vramshare.io/last-reservation"
"""On GpuDevices: bumped by every committed reservation; the optimistic-concurrency token."""

Obj = dict[str, Any]


def reservations_path(namespace: str | None = None, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}"
    path = f"{base}/namespaces/{namespace}/{RESERVATIONS}" if namespace else f"{base}/{RESERVATIONS}"
    return f"{path}/{name}" if name else path


def devices_path(name: str | None = None) -> str:
    path = f"/apis/{GROUP}/{VERSION}/{DEVICES}"
    return f"{path}/{name}" if name else path


def device_name(uuid: str) -> str:
    """GpuDevice objects are named after the GPU's UUID, in the lower case object names need."""
    return uuid.lower()


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def format_time(value: float) -> str:
    return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_time_precise(value: float) -> str:
    """RFC 3339 with microseconds, for sample timestamps (sub-second age matters in tests)."""
    return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def gpu_from_device(obj: Obj) -> Gpu | None:
    """The domain's view of a GpuDevice, or None when it has no sample yet."""
    spec, status = obj.get("spec", {}), obj.get("status", {})
    sampled_at = parse_time(status.get("sampledAt"))
    if sampled_at is None or "totalMiB" not in status:
        return None
    return Gpu(
        uuid=spec["uuid"],
        node=spec["nodeName"],
        index=int(spec["index"]),
        model=spec.get("model", ""),
        total_mib=int(status["totalMiB"]),
        used_mib=int(status.get("usedMiB", 0)),
        free_mib=int(status.get("freeMiB", 0)),
        sampled_at=sampled_at,
        healthy=status.get("state") != "Unhealthy",
        missing=status.get("state") == "Missing",
    )


def reservation_from_object(obj: Obj) -> Reservation:
    meta, spec, status = obj["metadata"], obj["spec"], obj.get("status", {})
    return Reservation(
        name=meta["name"],
        namespace=meta["namespace"],
        pod=spec["podName"],
        mib=int(spec["memoryMiB"]),
        node=spec["nodeName"],
        gpu_uuid=spec["gpuUUID"],
        gpu_index=int(spec["gpuIndex"]),
        # The webhook cannot write status on create: no phase yet means just Reserved.
        phase=ReservationPhase(status.get("phase", ReservationPhase.RESERVED.value)),
        reserved_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        pod_running_since=parse_time(status.get("podRunningSince")),
        finished_at=parse_time(status.get("finishedAt")),
    )


def reservation_object(*, name: str, namespace: str, pod: str, mib: int, gpu: Gpu, admission_uid: str) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": "GpuReservation",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                LABEL_GPU: device_name(gpu.uuid),
                LABEL_COMMITTED: "false",
                LABEL_ACTIVE: "true",
                "app.kubernetes.io/managed-by": "vramshare",
            },
        },
        "spec": {
            "podName": pod,
            "memoryMiB": mib,
            "nodeName": gpu.node,
            "gpuUUID": gpu.uuid,
            "gpuIndex": gpu.index,
            "admissionUID": admission_uid,
        },
    }
