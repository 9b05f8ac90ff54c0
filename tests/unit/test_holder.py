"""The holder pod on the wire and its process's one decision (issue #43): a holder holds once it runs
with the UUID NVML showed it written on itself, and holds nothing while leaving or placed elsewhere."""

from __future__ import annotations

import pytest

from vramshare.controller.attribution import device_plugin_node
from vramshare.domain.holds import HolderState
from vramshare.domain.ownership import ownership
from vramshare.holder import NoSingleGpuError, the_gpu
from vramshare.kube.dra import dra_reason, slice_gpus
from vramshare.kube.holders import ANNOTATION_HELD_GPU, LABEL_HOLDER_NODE, holder_from_wire, holder_pod


def pod(
    *, phase: str = "Running", uuid: str | None = "GPU-1", node: str = "n1", deleting: bool = False
) -> dict[str, object]:
    made = holder_pod(
        node="n1", image="vramshare:1", service_account="sa", priority_class="pc", runtime_class="nvidia"
    )
    meta = dict(made["metadata"], name="vramshare-hold-abc", creationTimestamp="2026-12-06T00:00:00Z")
    if uuid is not None:
        meta["annotations"] = {ANNOTATION_HELD_GPU: uuid}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-06T00:01:00Z"
    return {**made, "metadata": meta, "spec": {**made["spec"], "nodeName": node}, "status": {"phase": phase}}


def test_the_holder_pod_asks_the_device_plugin_for_one_gpu_on_its_node_only() -> None:
    made = holder_pod(
        node="n1", image="vramshare:1", service_account="sa", priority_class="pc", runtime_class="nvidia"
    )
    container = made["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert made["metadata"]["labels"][LABEL_HOLDER_NODE] == "n1"
    terms = made["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]
    assert made["spec"]["runtimeClassName"] == "nvidia"
    assert made["spec"]["priorityClassName"] == "pc"


@pytest.mark.parametrize(
    ("kwargs", "state"),
    [
        ({}, HolderState.HOLDING),
        ({"uuid": None}, HolderState.ACQUIRING),
        ({"phase": "Pending", "uuid": None}, HolderState.ACQUIRING),
        ({"uuid": "not-a-uuid"}, HolderState.ACQUIRING),
        ({"deleting": True}, HolderState.LEAVING),
        ({"phase": "Failed"}, HolderState.LEAVING),
        ({"node": "n2"}, HolderState.LEAVING),
    ],
)
def test_a_holder_holds_only_running_on_its_node_with_its_gpu_written(
    kwargs: dict[str, object], state: HolderState
) -> None:
    read = holder_from_wire(pod(**kwargs))  # type: ignore[arg-type]
    assert read.state is state
    assert read.node == "n1"
    assert read.name == "vramshare-hold-abc"


def test_the_holder_holds_exactly_one_gpu_or_says_what_it_saw() -> None:
    assert the_gpu(["GPU-1"]) == "GPU-1"
    with pytest.raises(NoSingleGpuError, match="NVML shows 2 GPUs here"):
        the_gpu(["GPU-1", "GPU-2"])
    with pytest.raises(NoSingleGpuError, match="shows 0 GPUs here \\(none\\)"):
        the_gpu([])
    with pytest.raises(NoSingleGpuError):
        the_gpu(["MIG-1"])


def test_a_gpu_a_dra_driver_publishes_is_read_from_its_resource_slice() -> None:
    """As NVIDIA's gpu-kubelet-plugin publishes them (driver gpu.nvidia.com, attribute uuid)."""
    published = {
        "metadata": {"name": "node-a-gpu.nvidia.com-x7k"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "devices": [
                {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-1"}}},
                {"name": "mig-0", "attributes": {"uuid": {"string": "MIG-9"}}},
                {"name": "other", "attributes": {"example.com/uuid": {"string": "GPU-2"}, "x": {"int": 1}}},
            ],
        },
    }
    gpus = slice_gpus(published)
    assert [g.uuid for g in gpus] == ["GPU-1", "GPU-2"]
    assert gpus[0].driver == "gpu.nvidia.com"
    owned = ownership([], elsewhere={g.uuid: dra_reason(g) for g in gpus})
    assert owned.reason(node="node-a", uuid="GPU-1").startswith(
        "published for Dynamic Resource Allocation by driver gpu.nvidia.com "
        "(ResourceSlice node-a-gpu.nvidia.com-x7k)"
    )
    assert owned.reason(node="node-a", uuid="GPU-3") == ""


def test_only_a_device_plugin_pod_that_is_not_a_holder_takes_a_gpu_dcgm_attributes_to_it() -> None:
    def pod(namespace: str, *, resources: dict[str, str], component: str | None = None) -> dict[str, object]:
        labels = {"app.kubernetes.io/component": component} if component else {}
        return {
            "metadata": {"namespace": namespace, "labels": labels},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": resources}}]},
        }

    assert device_plugin_node(pod("ml", resources={"nvidia.com/gpu": "1"}), holders_namespace="vs") == "n1"
    assert (
        device_plugin_node(pod("ml", resources={"nvidia.com/mig-1g.10gb": "1"}), holders_namespace="vs")
        == "n1"
    )
    # The exporter's own pod (a scrape's target labels) asks for no device.
    assert device_plugin_node(pod("gpu-operator", resources={"cpu": "1"}), holders_namespace="vs") == ""
    # vramshare's holder is vramshare's.
    holder_pod_seen = pod("vs", resources={"nvidia.com/gpu": "1"}, component="gpu-holder")
    assert device_plugin_node(holder_pod_seen, holders_namespace="vs") == ""
    # The same labels elsewhere are a tenant's pod.
    assert (
        device_plugin_node(
            pod("ml", resources={"nvidia.com/gpu": "1"}, component="gpu-holder"), holders_namespace="vs"
        )
        == "n1"
    )
