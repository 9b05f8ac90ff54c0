"""Nodes where NVIDIA's device plugin hands the GPUs out whole (issue #43, "know what is not yours"): the
real API server, kwok nodes whose status advertises nvidia.com/gpu as the device plugin makes the kubelet
do, the controller and the webhook. Their GPUs are NotShared, with no headroom, a Warning event and a
refusal that says why, until the operator dedicates the node to vramshare with a label."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from vramshare.domain.ownership import DEDICATED_LABEL
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import start_controller, start_webhook, webhook_configuration
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

NODE = "gpu-node-a"  # the two A100 40 GB


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        port = start_webhook(local, name="webhook", env={"VRAMSHARE_SETTLE_S": "2"})[1]
        local.apply_objects([webhook_configuration(local, ports={"dp": port})])
        local.create_namespace("jobs", {"vramshare-e2e/shard": "dp"})
        start_controller(local, name="controller", env={"VRAMSHARE_POLL_INTERVAL_S": "1"})
        yield local


def states(stack: LocalCluster) -> dict[str, tuple[str, str]]:
    """node/index -> (state, the Ready condition's message)."""
    out = {}
    for d in json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]:
        status = d.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
        out[f"{d['spec']['nodeName']}/{d['spec']['index']}"] = (
            status.get("state", ""),
            ready.get("message", ""),
        )
    return out


def advertise(stack: LocalCluster, gpus: int) -> None:
    """What NVIDIA's device plugin makes the kubelet write: nvidia.com/gpu in capacity and allocatable."""
    patch = {
        "status": {"capacity": {"nvidia.com/gpu": str(gpus)}, "allocatable": {"nvidia.com/gpu": str(gpus)}}
    }
    stack.kubectl("patch", "node", NODE, "--subresource=status", "--type=merge", "-p", json.dumps(patch))


def large_pod(name: str) -> client.V1Pod:
    """30 000 MiB: only the A100s of gpu-node-a have that much."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations={"gpu-mem-mb": "30000"}),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="example.invalid/x")]),
    )


def test_gpus_the_device_plugin_hands_out_are_not_shared_until_the_node_is_dedicated(
    stack: LocalCluster,
) -> None:
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))
    eventually(lambda: states(stack).get(f"{NODE}/0", ("",))[0] == "Ready", what="the A100s Ready")
    advertise(stack, 2)
    eventually(
        lambda: all(states(stack)[f"{NODE}/{i}"][0] == "NotShared" for i in (0, 1)),
        what="the A100s NotShared once the node advertises nvidia.com/gpu",
        timeout_s=30,
    )
    _, message = states(stack)[f"{NODE}/0"]
    assert f"node {NODE} advertises nvidia.com/gpu: 2" in message
    assert f"{DEDICATED_LABEL}=true" in message
    headrooms = json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]
    assert {d["status"]["headroomMiB"] for d in headrooms if d["spec"]["nodeName"] == NODE} == {0}
    events = json.loads(stack.kubectl("get", "events", "-A", "-o", "json"))["items"]
    assert any(e["reason"] == "GpuNotShared" and e["type"] == "Warning" for e in events)
    # The T4s of the other node still take small pods; nothing takes the A100s.
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod("jobs", large_pod("large-refused"))
    body: Any = json.loads(refused.value.body)
    assert f"not shared: node {NODE} advertises nvidia.com/gpu" in body["message"], body["message"]

    stack.kubectl("label", "node", NODE, f"{DEDICATED_LABEL}=true")
    eventually(
        lambda: all(states(stack)[f"{NODE}/{i}"][0] == "Ready" for i in (0, 1)),
        what="the A100s Ready again once the node is dedicated to vramshare",
        timeout_s=30,
    )
    placed = eventually(
        lambda: _create(core, large_pod("large-placed")),
        what="the large pod admitted on an A100",
        timeout_s=30,
    )
    assert placed.spec.affinity is not None
    print(f"\n[device plugin] GPUs on a node advertising nvidia.com/gpu: NotShared ({message})")


def _create(core: client.CoreV1Api, pod: client.V1Pod) -> Any:
    try:
        return core.create_namespaced_pod("jobs", pod)
    except ApiException:
        return None


def test_a_gpu_a_dra_driver_publishes_is_not_shared_until_its_slice_goes(stack: LocalCluster) -> None:
    """A ResourceSlice as NVIDIA's DRA driver publishes one (driver gpu.nvidia.com, each GPU's uuid
    attribute), on the real API server: that GPU is NotShared, whatever its node's labels, until the
    slice is gone."""
    node, index = "gpu-node-b", 0
    uuid = next(
        d["spec"]["uuid"]
        for d in json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]
        if d["spec"]["nodeName"] == node and d["spec"]["index"] == index
    )
    eventually(lambda: states(stack)[f"{node}/{index}"][0] == "Ready", what="the T4 Ready")
    published = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu.nvidia.com-0"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {
                        "type": {"string": "gpu"},
                        "uuid": {"string": uuid},
                        "productName": {"string": "Tesla T4"},
                    },
                }
            ],
        },
    }
    stack.apply_objects([published])
    eventually(
        lambda: states(stack)[f"{node}/{index}"][0] == "NotShared",
        what="the published T4 NotShared",
        timeout_s=30,
    )
    message = states(stack)[f"{node}/{index}"][1]
    assert message.startswith("published for Dynamic Resource Allocation by driver gpu.nvidia.com"), message
    assert states(stack)[f"{node}/1"][0] == "Ready"  # its neighbour, not published, is still shared
    stack.kubectl("delete", "resourceslice", f"{node}-gpu.nvidia.com-0")
    eventually(
        lambda: states(stack)[f"{node}/{index}"][0] == "Ready",
        what="the T4 shared again once its slice is gone",
        timeout_s=30,
    )


def test_a_gpu_dcgm_attributes_to_a_device_plugin_pod_is_taken_whatever_the_node_says(
    stack: LocalCluster,
) -> None:
    """dcgm-exporter names the pod a device plugin gave a GPU (its Kubernetes mapping): where that pod
    exists on the GPU's node asking for nvidia.com/gpu, the GPU is not shared, even on a node dedicated
    to vramshare; a series naming a pod that asks for no device (the exporter's own) changes nothing."""
    node, index = "gpu-node-b", 1
    uuid = next(
        d["spec"]["uuid"]
        for d in json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]
        if d["spec"]["nodeName"] == node and d["spec"]["index"] == index
    )
    stack.kubectl("label", "node", node, f"{DEDICATED_LABEL}=true", "--overwrite")
    for name, resources in (("trainer", {"nvidia.com/gpu": "1"}), ("exporter", {"cpu": "10m"})):
        stack.apply_objects(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": "default"},
                    "spec": {
                        "nodeName": node,
                        "containers": [
                            {"name": "main", "image": "example.invalid/x", "resources": {"limits": resources}}
                        ],
                    },
                }
            ]
        )
    stack.exporter.set_pods(uuid, ["default/exporter"])
    eventually(lambda: states(stack)[f"{node}/{index}"][0] == "Ready", what="the T4 Ready", timeout_s=30)
    time.sleep(3)  # polls that read the attribution to the exporter's pod
    assert states(stack)[f"{node}/{index}"][0] == "Ready"
    stack.exporter.set_pods(uuid, ["default/trainer"])
    eventually(
        lambda: states(stack)[f"{node}/{index}"][0] == "NotShared",
        what="the GPU DCGM attributes to the trainer NotShared",
        timeout_s=30,
    )
    assert states(stack)[f"{node}/{index}"][1].startswith("taken by pod default/trainer: DCGM attributes")
    events = json.loads(stack.kubectl("get", "events", "-A", "-o", "json"))["items"]
    assert any(e["reason"] == "GpuNotShared" and "default/trainer" in e["message"] for e in events)
    stack.exporter.set_pods(uuid, [])
    eventually(
        lambda: states(stack)[f"{node}/{index}"][0] == "Ready",
        what="the GPU shared again once DCGM attributes it to no one",
        timeout_s=30,
    )
