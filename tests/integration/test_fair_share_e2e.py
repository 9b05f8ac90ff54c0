"""Fair share in queue mode on the real stack (API server, scheduler, kwok pods, fake exporter,
Prometheus, the webhook over TLS, the controller), on one 40 GB GPU: which waiting pod the controller
places first is decided by its namespace's weighted share of GPU memory held (the namespace label
vramshare.io/queue-weight), not by age alone. The memory-seconds ratio under a flood is measured by
the simulation in tests/unit/domain/test_queue.py, on the same planner."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from vramshare.kube.pods import QUEUE_GATE
from vramshare.kube.resources import LABEL_QUEUE_WEIGHT, LABEL_RESERVATION
from vramshare_e2e.bookings import phases_of
from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, ClusterSettings, LocalCluster
from vramshare_e2e.components import (
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)
from vramshare_e2e.fleet import FakeGpu, FakeNode, Fleet, stable_gpu_uuid
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

MARGIN = 512
ENV = {"VRAMSHARE_SETTLE_S": "2", "VRAMSHARE_SAFETY_MARGIN_MIB": str(MARGIN)}
ROOM = 40_960 - 512 - MARGIN  # what the GPU can book: total - driver reserved - margin


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    gpu = FakeGpu(
        uuid=stable_gpu_uuid("gpu-node-a", 0),
        index=0,
        model="NVIDIA A100-SXM4-40GB",
        total_mib=40_960,
        driver_reserved_mib=512,
    )
    fleet = Fleet(nodes=[FakeNode(name="gpu-node-a", gpus=[gpu])])
    with LocalCluster.start(settings=ClusterSettings(fleet=fleet)) as local:
        port = start_webhook(local, name="webhook", env=ENV)[1]
        local.apply_objects([webhook_configuration(local, ports={"f": port})])
        for ns in ("light", "heavy", "other"):
            local.create_namespace(ns, {"vramshare-e2e/shard": "f", "vramshare.io/queue": "true"})
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
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


def pod(name: str, mib: int, *, run: str = "600s") -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name, annotations={"gpu-mem-mb": str(mib), RUN_DURATION_ANNOTATION: run}
        ),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="task", image="example.invalid/task")], restart_policy="Never"
        ),
    )


def gated(core: client.CoreV1Api, ns: str, name: str) -> bool:
    return QUEUE_GATE in [g.name for g in core.read_namespaced_pod(name, ns).spec.scheduling_gates or []]


def bound(stack: LocalCluster) -> int:
    """Bookings whose pod exists, as `vramshare status` shows them."""
    items = json.loads(stack.kubectl("get", "gpureservations", "-A", "-o", "json"))["items"]
    pods = json.loads(stack.kubectl("get", "pods", "-A", "-l", LABEL_RESERVATION, "-o", "json"))["items"]
    return sum(1 for phase in phases_of(items, pods).values() if phase == "Bound")


def waiting_in_queue(stack: LocalCluster) -> set[str]:
    """The namespaces whose waiter the controller has seen queued (it has a queue position)."""
    items = json.loads(stack.kubectl("get", "gpureservations", "-A", "-o", "json"))["items"]
    return {
        r["metadata"]["namespace"]
        for r in items
        if r["spec"]["podName"] == "waiter" and r.get("status", {}).get("queuePosition") is not None
    }


def first_placed(stack: LocalCluster, core: client.CoreV1Api, *, heavy_weight: str | None) -> str:
    """Both namespaces hold 14000 MiB and have one 7000 MiB pod waiting, light's the older; 7000 MiB
    free up, room for one of them. Which namespace's waiting pod is placed?"""
    if heavy_weight is None:
        stack.kubectl("label", "namespace", "heavy", f"{LABEL_QUEUE_WEIGHT}-")
    else:
        stack.kubectl("label", "namespace", "heavy", f"{LABEL_QUEUE_WEIGHT}={heavy_weight}", "--overwrite")
    for ns in ("light", "heavy"):
        for i in range(2):
            core.create_namespaced_pod(ns, pod(f"held-{i}", 7000))
    core.create_namespaced_pod("light", pod("freed", 7000))  # ends first: its memory is what frees
    core.create_namespaced_pod("other", pod("filler", ROOM - 5 * 7000))
    eventually(lambda: bound(stack) == 6, what="the GPU full and every booking bound", timeout_s=30)
    core.create_namespaced_pod("light", pod("waiter", 7000))
    time.sleep(1.1)  # queue order is by creationTimestamp, which has a resolution of one second
    core.create_namespaced_pod("heavy", pod("waiter", 7000))
    assert gated(core, "light", "waiter")
    assert gated(core, "heavy", "waiter")
    eventually(lambda: waiting_in_queue(stack) == {"light", "heavy"}, what="both waiters in the queue")
    core.delete_namespaced_pod("freed", "light")
    winner = eventually(
        lambda: next((ns for ns in ("light", "heavy") if not gated(core, ns, "waiter")), None),
        what="one waiter placed",
        timeout_s=30,
    )
    assert all(gated(core, ns, "waiter") for ns in ("light", "heavy") if ns != winner)  # only one fits
    for ns in ("light", "heavy", "other"):
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
    eventually(lambda: bound(stack) == 0, what="every booking released", timeout_s=60)
    eventually(
        lambda: not any(core.list_namespaced_pod(ns).items for ns in ("light", "heavy", "other")),
        what="pods gone",
        timeout_s=60,
    )
    return winner


def test_the_weighted_share_decides_who_is_placed_first(stack: LocalCluster, core: client.CoreV1Api) -> None:
    # Equal weights: each would hold 21000 MiB with its waiter placed: a tie, so the older pod, light's.
    assert first_placed(stack, core, heavy_weight=None) == "light"
    # Weight 3: heavy's 21000 MiB count as 7000 against light's 21000: heavy's younger pod goes first.
    assert first_placed(stack, core, heavy_weight="3") == "heavy"
