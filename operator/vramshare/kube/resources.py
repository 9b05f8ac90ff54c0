"""vramshare's names on the wire: API group and paths, labels and annotations, time formats.

The typed objects built from these live in `vramshare.kube.objects`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

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
LABEL_HELD_FOR = "vramshare.io/held-for"
"""On holds (phase Held): the key of the task the memory is kept for (a hash of its Airflow identity)."""
LABEL_SET = "vramshare.io/reservation-set"
"""On the reservations of a pod with several GPUs (one per GPU): the name the pod's
`vramshare.io/reservation` label carries, which is the first one's name."""
LABEL_GPU = "vramshare.io/gpu"
"""On reservations: the GpuDevice name, so the ledger of one GPU can be listed by label."""
ANNOTATION_REINVOKED = "vramshare.io/reinvoked-by"
"""On reservations: the request UID of the one reinvocation that took the booking up."""
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
