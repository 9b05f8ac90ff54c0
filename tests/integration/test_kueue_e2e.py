"""vramshare beside a real Kueue (its manager built from sigs.k8s.io/kueue, its own pod webhooks, a
ClusterQueue whose quota is GPU memory): a pod Kueue holds books nothing while it waits in Kueue's
queue, and is placed by vramshare once Kueue admits it; the ClusterQueue's quota on
vramshare.io/gpu-mem-mib caps the LocalQueue. With the API server, scheduler, kwok pods, fake
exporter, Prometheus, the webhook over TLS and the controller. Its own control plane."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from vramshare.kube.pods import KUEUE_GATE, QUEUE_GATE
from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_RESERVATION, MEMORY_RESOURCE
from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, LocalCluster
from vramshare_e2e.components import (
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)
from vramshare_e2e.kueue import SELECTOR_LABEL, gpu_memory_queue, start_kueue
from vramshare_e2e.process import eventually
from vramshare_webhook.memory_resource import quantity

pytestmark = pytest.mark.cluster

NS = "kueue-jobs"
QUOTA_MIB = 8000
ENV = {"VRAMSHARE_SETTLE_S": "2", "VRAMSHARE_SAFETY_MARGIN_MIB": "512"}


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        port = start_webhook(local, name="webhook", env=ENV)[1]
        local.apply_objects([webhook_configuration(local, ports={"k": port})])
        local.create_namespace(NS, {"vramshare-e2e/shard": "k", SELECTOR_LABEL: "on"})
        start_controller(
            local,
            name="controller",
            env={
                **ENV,
                "VRAMSHARE_POLL_INTERVAL_S": "1",
                "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
                "VRAMSHARE_QUEUE_INTERVAL_S": "1",
            },
        )
        wait_for_gpu_devices(local)
        start_kueue(local)
        gpu_memory_queue(local, namespace=NS, resource=MEMORY_RESOURCE, quota_mib=QUOTA_MIB)
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


def kueue_pod(name: str, mib: int, *, run: str) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name,
            labels={"kueue.x-k8s.io/queue-name": "gpu"},
            annotations={"gpu-mem-mb": str(mib), RUN_DURATION_ANNOTATION: run},
        ),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="task", image="example.invalid/task")], restart_policy="Never"
        ),
    )


def gates(core: client.CoreV1Api, name: str) -> list[str]:
    return [g.name for g in core.read_namespaced_pod(name, NS).spec.scheduling_gates or []]


def booking(stack: LocalCluster, entry: str) -> dict[str, Any]:
    return json.loads(stack.kubectl("get", "gpureservation", entry, "-n", NS, "-o", "json"))  # type: ignore[no-any-return]


def test_a_pod_kueue_holds_books_nothing_until_kueue_admits_it(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    names = ["first", "second", "third"]
    entries = {}
    for name in names:  # 3 x 4000 MiB against a ClusterQueue quota of 8000: Kueue admits two
        pod = core.create_namespaced_pod(NS, kueue_pod(name, 4000, run="8s"))
        assert KUEUE_GATE in [g.name for g in pod.spec.scheduling_gates]
        assert QUEUE_GATE in [g.name for g in pod.spec.scheduling_gates]
        assert quantity(pod.spec.containers[0].resources.requests[MEMORY_RESOURCE]) == 4000  # Kueue counts it
        entries[name] = pod.metadata.annotations[ANNOTATION_RESERVATION]
    # Kueue admits two workloads and lifts its gate; vramshare then books and places them.

    def placed() -> list[str]:
        return [n for n in names if not gates(core, n)]

    first_two = eventually(
        lambda: len(placed()) == 2 and placed(), what="two pods admitted and placed", timeout_s=60
    )
    (waiting,) = set(names) - set(first_two)
    for name in first_two:
        pod = core.read_namespaced_pod(name, NS)
        assert pod.metadata.annotations[ANNOTATION_GPU_UUID]
        assert (
            booking(stack, entries[name])["spec"]["gpuUUID"] == pod.metadata.annotations[ANNOTATION_GPU_UUID]
        )
    # The third waits in Kueue's queue: both gates, and its entry books nothing, for as long as it waits.
    for _ in range(6):
        assert KUEUE_GATE in gates(core, waiting)
        entry = booking(stack, entries[waiting])
        assert "gpuUUID" not in entry["spec"], entry
        assert entry["status"]["phase"] == "Queued"
        time.sleep(0.5)
    workloads = json.loads(stack.kubectl("get", "workloads", "-n", NS, "-o", "json"))["items"]
    states = {
        w["metadata"]["name"]: {c["type"]: c["status"] for c in w.get("status", {}).get("conditions", [])}
        for w in workloads
    }
    print(f"\nKueue's workloads and their conditions: {states}")
    # Kueue's own view agrees: the third's quota is not reserved (8000 MiB are the first two's).
    assert sum(1 for conditions in states.values() if conditions.get("Admitted") == "True") == 2
    # The first two finish; Kueue admits the third (lifts its gate), and vramshare places it then.
    lifted = eventually(
        lambda: KUEUE_GATE not in gates(core, waiting) and time.monotonic(),
        what="Kueue admitted the third",
        timeout_s=90,
        interval_s=0.1,
    )
    eventually(lambda: not gates(core, waiting), what="the third placed", timeout_s=30, interval_s=0.1)
    placed_after = time.monotonic() - lifted
    pod = core.read_namespaced_pod(waiting, NS)
    assert (
        booking(stack, entries[waiting])["spec"]["gpuUUID"] == pod.metadata.annotations[ANNOTATION_GPU_UUID]
    )
    print(f"the third placed by vramshare {placed_after:.1f} s after Kueue lifted its gate")
