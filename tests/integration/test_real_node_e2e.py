"""A real node beside the kwok ones: kubelet, containerd 2 and runc on this machine, registered to the
local API server, its GPUs fake (in the fake exporter's fleet under the node's name). vramshare's
webhook and controller admit and place a GPU pod on it, and the container *runs*: it prints the
environment it really got, read back through the API server's pod log. A pod without a request in a
managed namespace runs with NVIDIA_VISIBLE_DEVICES=none although its image sets `all`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_RESERVATION
from vramshare_e2e.cluster import ClusterSettings, LocalCluster, eventually
from vramshare_e2e.components import start_controller, start_webhook, webhook_configuration
from vramshare_e2e.fleet import FakeGpu, FakeNode, Fleet, stable_gpu_uuid
from vramshare_e2e.node import TASK_IMAGE, RealNode

pytestmark = pytest.mark.cluster

REAL = "127.0.0.2"
H100 = stable_gpu_uuid(REAL, 0)
A100 = stable_gpu_uuid("gpu-node-a", 0)
CONTROLLER_ENV = {"VRAMSHARE_POLL_INTERVAL_S": "1", "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1"}


def fleet() -> Fleet:
    return Fleet(
        nodes=[
            FakeNode(
                name="gpu-node-a",
                gpus=[
                    FakeGpu(
                        uuid=A100,
                        index=0,
                        model="NVIDIA A100-SXM4-40GB",
                        total_mib=40_960,
                        driver_reserved_mib=512,
                    )
                ],
            ),
            FakeNode(
                name=REAL,
                real=True,
                gpus=[
                    FakeGpu(
                        uuid=H100,
                        index=0,
                        model="NVIDIA H100 80GB HBM3",
                        total_mib=81_559,
                        driver_reserved_mib=512,
                    )
                ],
            ),
        ]
    )


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LocalCluster, RealNode]]:
    with LocalCluster.start(settings=ClusterSettings(fleet=fleet())) as local:
        node = RealNode.create(local, 2)
        took = node.start()
        print(f"\nreal node {node.name} Ready {took:.1f} s after containerd started")
        port = start_webhook(local, name="webhook")[1]
        local.apply_objects([webhook_configuration(local, ports={"real": port})])
        local.kubectl("create", "namespace", "jobs")
        local.kubectl("label", "namespace", "jobs", "vramshare-e2e/shard=real", "vramshare.io/managed=true")
        start_controller(local, name="controller", env=CONTROLLER_ENV)
        yield local, node


@pytest.fixture(scope="module")
def core(stack: tuple[LocalCluster, RealNode]) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack[0].kubeconfig)))


def task_pod(name: str, *, mib: int | None, script: str, node: str | None = None) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations={"gpu-mem-mb": str(mib)} if mib else None),
        spec=client.V1PodSpec(
            restart_policy="Never",
            node_selector={"kubernetes.io/hostname": node} if node else None,
            containers=[
                client.V1Container(
                    name="task", image=TASK_IMAGE, image_pull_policy="Never", command=["sh", "-c", script]
                )
            ],
        ),
    )


def finished(core: client.CoreV1Api, name: str) -> client.V1Pod | None:
    pod = core.read_namespaced_pod(name, "jobs")
    return pod if pod.status.phase in ("Succeeded", "Failed") else None


def logged_env(core: client.CoreV1Api, name: str) -> dict[str, str]:
    text = core.read_namespaced_pod_log(name, "jobs")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def reservation_phase(cluster: LocalCluster, name: str) -> str:
    found = json.loads(cluster.kubectl("get", "gpureservations", "-n", "jobs", "-o", "json"))["items"]
    return next(
        (r.get("status", {}).get("phase", "") for r in found if r["metadata"]["name"] == name), "gone"
    )


def test_the_real_node_registers_beside_the_kwok_nodes_and_its_gpus_are_known(
    stack: tuple[LocalCluster, RealNode],
) -> None:
    cluster, _ = stack
    nodes = {
        n["metadata"]["name"]: n for n in json.loads(cluster.kubectl("get", "nodes", "-o", "json"))["items"]
    }
    assert set(nodes) == {"gpu-node-a", REAL}
    real = nodes[REAL]
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
    assert real["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert "kwok.x-k8s.io/node" not in real["metadata"].get("annotations", {})
    device: dict[str, Any] = eventually(
        lambda: next(
            (
                d
                for d in json.loads(cluster.kubectl("get", "gpudevices", "-o", "json"))["items"]
                if d["spec"]["uuid"] == H100 and d.get("status", {}).get("state") == "Ready"
            ),
            None,
        ),
        what="the real node's GPU Ready",
    )
    assert device["spec"]["nodeName"] == REAL


def test_a_gpu_pod_runs_on_the_real_node_with_the_gpu_it_was_given(
    stack: tuple[LocalCluster, RealNode], core: client.CoreV1Api
) -> None:
    cluster, _ = stack
    script = "env | grep -E '^(NVIDIA_|CUDA_|VRAMSHARE_|TF_|XLA_)' | sort; sleep 2"
    started = time.monotonic()
    created = core.create_namespaced_pod("jobs", task_pod("train", mib=50_000, script=script))
    assert created.metadata.annotations[ANNOTATION_GPU_UUID] == H100  # only the H100 has 50 000 MiB
    booking = created.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: reservation_phase(cluster, booking) == "Bound", what="the booking Bound")
    pod = eventually(lambda: finished(core, "train"), what="the container to run and exit", timeout_s=90)
    print(f"\nGPU pod admitted, scheduled, run and exited in {time.monotonic() - started:.1f} s")
    assert pod.spec.node_name == REAL
    assert pod.status.phase == "Succeeded"
    env = logged_env(core, "train")
    assert env["NVIDIA_VISIBLE_DEVICES"] == H100
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["VRAMSHARE_GPU_MEMORY_MIB"] == "50000"
    assert "VRAMSHARE_GPU_MEMORY_FRACTION" in env
    eventually(
        lambda: reservation_phase(cluster, booking) in ("Released", "gone"),
        what="the booking released when the container exited",
        timeout_s=30,
    )


def test_a_pod_without_a_request_runs_seeing_no_gpu_though_its_image_says_all(
    stack: tuple[LocalCluster, RealNode], core: client.CoreV1Api
) -> None:
    script = "echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"
    core.create_namespaced_pod("jobs", task_pod("cpu-only", mib=None, script=script, node=REAL))
    pod = eventually(lambda: finished(core, "cpu-only"), what="the CPU pod to run", timeout_s=90)
    assert pod.status.phase == "Succeeded"
    assert logged_env(core, "cpu-only") == {"NVIDIA_VISIBLE_DEVICES": "none"}
