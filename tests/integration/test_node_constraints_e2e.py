"""Placement the scheduler agrees with, on the real stack with real Node objects: cordon, taints with and
without toleration, a nodeSelector on the GPU-model label, NotIn affinity, a node going NotReady. Its
own control plane, since it cordons, taints and breaks nodes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_NODE
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import (
    metric,
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

NS = "nodes"
T4 = "Tesla-T4"


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        port = start_webhook(
            local, name="webhook", env={"VRAMSHARE_SETTLE_S": "2", "VRAMSHARE_HOLD_MIN_MIB": "0"}
        )[1]
        local.apply_objects([webhook_configuration(local, ports={"nodes": port})])
        local.create_namespace(NS, {"vramshare-e2e/shard": "nodes"})
        start_controller(
            local,
            name="controller",
            env={
                "VRAMSHARE_POLL_INTERVAL_S": "1",
                "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
                "VRAMSHARE_UNSCHEDULABLE_WARNING_S": "3",
            },
        )
        wait_for_gpu_devices(local)
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


def pod(name: str, mib: int, **spec: Any) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations={"gpu-mem-mb": str(mib)}),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/task")],
            restart_policy="Never",
            **spec,
        ),
    )


def node_of_product(stack: LocalCluster, product: str) -> str:
    return next(
        n.name for n in stack.settings.fleet.nodes if n.node_labels()["nvidia.com/gpu.product"] == product
    )


def scheduled_on(core: client.CoreV1Api, name: str) -> str:
    return str(
        eventually(
            lambda: core.read_namespaced_pod(name, NS).spec.node_name, what=f"{name} scheduled", timeout_s=30
        )
    )


def on_t4(stack: LocalCluster) -> dict[str, str]:
    return {"nvidia.com/gpu.product": T4}


def test_a_cordoned_node_is_passed_over_and_taken_again_once_uncordoned(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    t4 = node_of_product(stack, T4)
    stack.kubectl("cordon", t4)
    try:
        message = eventually(
            lambda: _refusal(core, pod("cordoned", 4000, node_selector=on_t4(stack))),
            what="a refusal for the cordon",
        )
        assert f"node {t4}: cordoned (spec.unschedulable)" in message
    finally:
        stack.kubectl("uncordon", t4)
    admitted = eventually(
        lambda: _admitted(core, pod("uncordoned", 4000, node_selector=on_t4(stack))),
        what="admitted once uncordoned",
    )
    assert admitted.metadata.annotations[ANNOTATION_NODE] == t4
    assert scheduled_on(core, "uncordoned") == t4


def test_a_taint_keeps_pods_off_unless_they_tolerate_it(stack: LocalCluster, core: client.CoreV1Api) -> None:
    a100 = next(n.name for n in stack.settings.fleet.nodes if n.name != node_of_product(stack, T4))
    stack.kubectl("taint", "node", a100, "dedicated=training:NoSchedule")
    try:
        message = eventually(
            lambda: _refusal(core, pod("untolerated", 20_000)), what="a refusal for the taint"
        )
        assert f"node {a100}: taint dedicated=training:NoSchedule not tolerated" in message
        tolerating = pod(
            "tolerating",
            20_000,
            tolerations=[
                client.V1Toleration(key="dedicated", operator="Equal", value="training", effect="NoSchedule")
            ],
        )
        admitted = core.create_namespaced_pod(NS, tolerating)
        assert admitted.metadata.annotations[ANNOTATION_NODE] == a100
        assert scheduled_on(core, "tolerating") == a100  # the scheduler agrees
    finally:
        stack.kubectl("taint", "node", a100, "dedicated=training:NoSchedule-")


def test_node_selector_and_not_in_affinity_on_the_gpu_model_label(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    t4 = node_of_product(stack, T4)
    selected = core.create_namespaced_pod(NS, pod("t4-only", 2000, node_selector=on_t4(stack)))
    assert selected.metadata.annotations[ANNOTATION_NODE] == t4
    not_t4 = client.V1Affinity(
        node_affinity=client.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=client.V1NodeSelector(
                node_selector_terms=[
                    client.V1NodeSelectorTerm(
                        match_expressions=[
                            client.V1NodeSelectorRequirement(
                                key="nvidia.com/gpu.product", operator="NotIn", values=[T4]
                            )
                        ]
                    )
                ]
            )
        )
    )
    avoided = core.create_namespaced_pod(NS, pod("not-t4", 2000, affinity=not_t4))
    assert avoided.metadata.annotations[ANNOTATION_NODE] != t4
    assert scheduled_on(core, "not-t4") == avoided.metadata.annotations[ANNOTATION_NODE]
    uuids = {g.uuid for n, g in stack.settings.fleet.all_gpus() if n.name == t4}
    assert selected.metadata.annotations[ANNOTATION_GPU_UUID] in uuids


def test_a_node_gone_not_ready_is_passed_over(stack: LocalCluster, core: client.CoreV1Api) -> None:
    t4 = node_of_product(stack, T4)
    # Take the node from kwok (which would report it Ready again), then mark it NotReady as a dead
    # kubelet would be marked.
    stack.kubectl("annotate", "node", t4, "kwok.x-k8s.io/node-")
    node = json.loads(stack.kubectl("get", "node", t4, "-o", "json"))
    conditions = [
        {**c, "status": "False", "reason": "KubeletStopped"} if c["type"] == "Ready" else c
        for c in node["status"]["conditions"]
    ]
    stack.kubectl(
        "patch",
        "node",
        t4,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"conditions": conditions}}),
    )
    try:
        message = eventually(
            lambda: _refusal(core, pod("not-ready", 2000, node_selector=on_t4(stack))),
            what="a refusal for NotReady",
        )
        assert f"node {t4}: NotReady" in message
    finally:
        stack.kubectl("annotate", "node", t4, "kwok.x-k8s.io/node=fake", "--overwrite")
    eventually(
        lambda: _admitted(core, pod("ready-again", 2000, node_selector=on_t4(stack))),
        what="admitted once Ready again",
        timeout_s=60,
    )


def _refusal(core: client.CoreV1Api, body: client.V1Pod) -> str | None:
    """The refusal message, or None if the pod was admitted (then it is deleted again)."""
    try:
        core.create_namespaced_pod(NS, body)
    except client.ApiException as exc:
        if exc.status != 403:
            raise
        return str(json.loads(exc.body)["message"])
    core.delete_namespaced_pod(body.metadata.name, NS)
    return None


def _admitted(core: client.CoreV1Api, body: client.V1Pod) -> Any:
    try:
        return core.create_namespaced_pod(NS, body)
    except client.ApiException as exc:
        if exc.status != 403:
            raise
        return None


def test_a_booked_pod_that_stays_unschedulable_gets_a_warning_and_counts_in_the_metric(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    # Admitted for its GPU memory, but it also asks for more CPU than its node has: the scheduler never
    # binds it, and its booking would hold memory in silence.
    greedy = pod(
        "cpu-hungry",
        2000,
        node_selector=on_t4(stack),
    )
    greedy.spec.containers[0].resources = client.V1ResourceRequirements(requests={"cpu": "100000"})
    core.create_namespaced_pod(NS, greedy)

    def warned() -> Any:
        events = core.list_namespaced_event(NS, field_selector="involvedObject.name=cpu-hungry").items
        return next((e for e in events if e.reason == "GpuPodUnschedulable"), None)

    event = eventually(warned, what="the GpuPodUnschedulable event", timeout_s=30)
    assert event.type == "Warning"
    assert "2000 MiB are booked" in event.message
    assert "Insufficient cpu" in event.message
    port = int(stack.component("controller").env["VRAMSHARE_METRICS_PORT"])  # type: ignore[index]
    assert metric(port, "vramshare_unschedulable_gpu_pods") == 1.0
    core.delete_namespaced_pod("cpu-hungry", NS)
    eventually(lambda: metric(port, "vramshare_unschedulable_gpu_pods") == 0.0, what="the gauge back to 0")


def test_the_gpu_model_annotation_on_the_real_stack(stack: LocalCluster, core: client.CoreV1Api) -> None:
    t4 = node_of_product(stack, T4)
    picked = client.V1Pod(
        metadata=client.V1ObjectMeta(
            name="wants-t4", annotations={"gpu-mem-mb": "2000", "gpu-model": "Tesla*"}
        ),
        spec=client.V1PodSpec(containers=[client.V1Container(name="base", image="example.invalid/task")]),
    )
    admitted = core.create_namespaced_pod(NS, picked)
    assert admitted.metadata.annotations[ANNOTATION_NODE] == t4
    unknown = client.V1Pod(
        metadata=client.V1ObjectMeta(
            name="wants-h100", annotations={"gpu-mem-mb": "2000", "gpu-model": "*H100*"}
        ),
        spec=client.V1PodSpec(containers=[client.V1Container(name="base", image="example.invalid/task")]),
    )
    with pytest.raises(client.ApiException) as exc:
        core.create_namespaced_pod(NS, unknown)
    assert exc.value.status == 400
    message = json.loads(exc.value.body)["message"]
    assert 'annotation "gpu-model" is "*H100*": no GPU in the fleet has that model' in message
    assert "NVIDIA A100-SXM4-40GB, Tesla T4" in message


def test_admitted_pods_are_told_their_budget_and_mps_nodes_enforce_it(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    t4 = node_of_product(stack, T4)
    stack.kubectl("label", "node", t4, "nvidia.com/mps.capable=true")
    try:
        budgeted = eventually(
            lambda: (
                (
                    p := core.create_namespaced_pod(
                        NS, pod(f"budget-{time.monotonic_ns()}", 3000, node_selector=on_t4(stack))
                    )
                )
                and {e.name: e.value for e in p.spec.containers[0].env}.get(
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
                )
                and p
            ),
            what="the MPS limit once the webhook sees the node label",
            timeout_s=15,
        )
    finally:
        stack.kubectl("label", "node", t4, "nvidia.com/mps.capable-")
    env = {e.name: e.value for e in budgeted.spec.containers[0].env}
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    assert env["VRAMSHARE_GPU_MEMORY_MIB"] == "3000"
    assert env["VRAMSHARE_GPU_MEMORY_FRACTION"] == env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.19"  # of 15360
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_a_node_whose_hostname_label_is_not_its_name_gets_its_gpu_pods(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    """kubelets with --hostname-override, or nodes named by FQDN: the kubernetes.io/hostname label
    differs from the node's name. Pods are pinned by the node's name (matchFields), so they still land."""
    t4 = node_of_product(stack, T4)
    stack.kubectl("label", "node", t4, f"kubernetes.io/hostname={t4}.example.internal", "--overwrite")
    try:
        created = core.create_namespaced_pod(NS, pod("fqdn", 2000, node_selector=on_t4(stack)))
        assert created.metadata.annotations["vramshare.io/node"] == t4
        assert scheduled_on(core, "fqdn") == t4  # pinned by the hostname label, it never was
        terms = created.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
        (term,) = terms.node_selector_terms
        assert [(f.key, f.operator, f.values) for f in term.match_fields] == [("metadata.name", "In", [t4])]
    finally:
        stack.kubectl("label", "node", t4, f"kubernetes.io/hostname={t4}", "--overwrite")
        core.delete_namespaced_pod("fqdn", NS, grace_period_seconds=0)
