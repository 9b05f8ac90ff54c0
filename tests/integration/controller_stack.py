"""The stack the controller's end-to-end modules share: API server, kwok pods, fake exporter,
Prometheus, one webhook creating reservations and one controller polling fast, and what they read
of it. Each module runs its own, since some remove and replace GPUs and stop Prometheus."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes import client

from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, LocalCluster
from vramshare_e2e.components import start_controller, start_webhook, webhook_configuration

CONTROLLER_ENV = {
    "VRAMSHARE_POLL_INTERVAL_S": "1",
    "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
    "VRAMSHARE_MAX_SAMPLE_AGE_S": "6",
    "VRAMSHARE_MISSING_GRACE_S": "4",
    "VRAMSHARE_FORGET_MISSING_AFTER_S": "12",
    "VRAMSHARE_RESERVATION_TTL_S": "6",
    "VRAMSHARE_SETTLE_S": "2",
    "VRAMSHARE_SAFETY_MARGIN_MIB": "512",
    "VRAMSHARE_LEASE_DURATION_S": "4",
    "VRAMSHARE_LEASE_RENEW_DEADLINE_S": "2.5",
    "VRAMSHARE_LEASE_RETRY_PERIOD_S": "0.5",
}


@contextmanager
def controller_stack() -> Iterator[LocalCluster]:
    """A fresh control plane with the webhook (namespace `jobs`) and `controller-1` running."""
    with LocalCluster.start() as local:
        port = start_webhook(local, name="webhook", env={"VRAMSHARE_SETTLE_S": "2"})[1]
        local.apply_objects([webhook_configuration(local, ports={"ctl": port})])
        local.create_namespace("jobs", {"vramshare-e2e/shard": "ctl"})
        start_controller(local, name="controller-1", env=CONTROLLER_ENV)
        yield local


def devices(stack: LocalCluster) -> dict[str, dict[str, Any]]:
    items = json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]
    return {d["spec"]["uuid"]: d for d in items}


def reservation(stack: LocalCluster, name: str, namespace: str = "jobs") -> dict[str, Any]:
    return json.loads(stack.kubectl("get", "gpureservation", name, "-n", namespace, "-o", "json"))


def phase_of(stack: LocalCluster, name: str) -> str | None:
    return reservation(stack, name).get("status", {}).get("phase")


def gpu_pod(name: str, mib: int, *, run: str | None = None, node: str | None = None) -> client.V1Pod:
    annotations = {"gpu-mem-mb": str(mib)}
    if run:
        annotations[RUN_DURATION_ANNOTATION] = run
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/task")],
            restart_policy="Never",
            node_selector={"kubernetes.io/hostname": node} if node else None,
        ),
    )


def events_for(core: client.CoreV1Api, namespace: str, name: str) -> list[client.CoreV1Event]:
    return [e for e in core.list_namespaced_event(namespace).items if e.involved_object.name == name]
