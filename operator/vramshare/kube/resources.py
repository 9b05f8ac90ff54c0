"""vramshare's names on the wire: API group and paths, labels and annotations, time formats.

The typed objects built from these live in `vramshare.kube.objects`.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any
from urllib.parse import quote

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
"""On queue placements and holds: "false" from creation until the commit's precondition held, then
"true". A booking the webhook makes for a pod has no such label: the webhook lets the pod be created
only once the commit held, so the pod is its record, and a write per admission is saved. Deciders count
every active booking (a pending one may still win); observers of the ledger count a pod's booking once
its pod exists (Bound), and a placement or hold once labelled."""
LABEL_ACTIVE = "vramshare.io/active"
"""On reservations: "true" while Reserved or Bound, "false" once ended (set by the controller), so the
webhook lists only the live ledger, not the history kept for the retention period."""
LABEL_HELD_FOR = "vramshare.io/held-for"
"""On holds (phase Held): the key of the task the memory is kept for (a hash of its Airflow identity)."""
LABEL_GRANTED_TO = "vramshare.io/granted-to"
"""On grants (phase Granted, `vramshare.domain.grants`): a hash of the webhook replica that holds it (its
name is in the annotation vramshare.io/granted-to-replica and in spec.podName)."""
ANNOTATION_GRANTED_TO = "vramshare.io/granted-to-replica"
ANNOTATION_GRANT_LASTS = "vramshare.io/grant-lasts-s"
"""On grants: how long the grant lasts unrenewed (seconds); the controller ends it after that and a
margin."""
ANNOTATION_GRANT_RENEWED = "vramshare.io/grant-renewed"
"""On grants: a count its holder moves on every renewal (any change is a renewal to the controller)."""
LABEL_SET = "vramshare.io/reservation-set"
"""On the reservations of a pod with several GPUs (one per GPU): the name the pod's
`vramshare.io/reservation` label carries, which is the first one's name."""
LABEL_GPU = "vramshare.io/gpu"
"""On reservations: the GpuDevice name, so the ledger of one GPU can be listed by label."""
LABEL_QUEUED = "vramshare.io/queued"
"""On queue entries: "true". Their pods exist (behind the gate) from the start, so once placed they
are not pending bookings (see `vramshare.domain.tenancy`)."""
LABEL_QUEUE_WEIGHT = "vramshare.io/queue-weight"
"""On namespaces: its weight in the queue's fair share (a number above 0, at most 1000; 1 without it)."""
MEMORY_RESOURCE = "vramshare.io/gpu-mem-mib"
"""The extended resource vramshare requests for each pod it admits (its MiB, all GPUs together) and
advertises in each GPU node's capacity: ResourceQuota, the scheduler and Kueue count GPU memory by it."""
ANNOTATION_REINVOKED = "vramshare.io/reinvoked-by"
"""On reservations: the request UID of the one reinvocation that took the booking up."""
FINALIZER_POD_GONE = "vramshare.io/pod-terminated"
"""On every booking made for a pod (not on holds, which have none): a deleted booking keeps counting
until its pod has terminated. Deleting a namespace deletes its GpuReservations at once (before 1.33),
and foreground deletion of a pod deletes them through an ownerReference (bookings of vramshare before
issue #31, which wrote one), both while the pod may still be terminating and holding GPU memory; the
controller removes this finalizer once the booking has ended (its pod gone or finished, or never seen
within the TTL)."""
ANNOTATION_LEDGER = "vramshare.io/last-reservation"
LABEL_HEARTBEAT_LEASE = "vramshare.io/inventory-heartbeat"
"""On the controller's Lease once it carries the inventory heartbeat (see vramshare.kube.heartbeat)."""
"""On GpuDevices: bumped by every committed reservation; the optimistic-concurrency token."""

Obj = dict[str, Any]


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_object_name(value: object) -> bool:
    """Whether `value` can name a Kubernetes object (a DNS-1123 subdomain: at most 253 characters of
    lower-case letters, digits, '-' and '.'). Names read from users' objects (annotations, labels) are
    checked with this before they are used, e.g. in an API path."""
    return isinstance(value, str) and 0 < len(value) <= 253 and bool(_DNS_SUBDOMAIN.match(value))


_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def is_service_name(value: object) -> bool:
    """Whether `value` can name a Service (a DNS-1035 label: at most 63 characters of lower-case
    letters, digits and '-', starting with a letter)."""
    return isinstance(value, str) and bool(_DNS_LABEL.match(value))


_RESOURCE_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def is_extended_resource_name(value: object) -> bool:
    """Whether `value` can name an extended resource: `<domain>/<name>`, the domain a DNS subdomain
    outside kubernetes.io, the name at most 63 characters, and no `requests.` prefix."""
    if not isinstance(value, str) or value.count("/") != 1 or value.startswith("requests."):
        return False
    domain, name = value.split("/")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return False
    return is_object_name(domain) and bool(_RESOURCE_NAME.match(name))


def _segment(value: str) -> str:
    """One path segment, quoted: whatever a name holds, it cannot reach another path or a query (nor
    climb one: "." and ".." are dot segments that URL libraries resolve, so their dots are encoded)."""
    if value in (".", ".."):
        return value.replace(".", "%2E")
    return quote(value, safe="")


def reservations_path(namespace: str | None = None, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}"
    path = (
        f"{base}/namespaces/{_segment(namespace)}/{RESERVATIONS}" if namespace else f"{base}/{RESERVATIONS}"
    )
    return f"{path}/{_segment(name)}" if name else path


def pods_path(namespace: str) -> str:
    """The namespace's pods (a namespace read from a booking or an event is quoted like a name)."""
    return f"/api/v1/namespaces/{_segment(namespace)}/pods"


def pod_path(namespace: str, name: str) -> str:
    return f"{pods_path(namespace)}/{_segment(name)}"


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{_segment(namespace)}/events"


def devices_path(name: str | None = None) -> str:
    path = f"/apis/{GROUP}/{VERSION}/{DEVICES}"
    return f"{path}/{_segment(name)}" if name else path


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
