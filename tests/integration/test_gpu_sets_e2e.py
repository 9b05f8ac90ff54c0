"""Several GPUs per pod on the real stack: API server, scheduler, kwok pods, fake exporter, Prometheus,
two webhook replicas over TLS (one per namespace, so their commits race on the same GPUs), the
controller, and a labelling webhook plus a sidecar injector after vramshare (so the API server
reinvokes it). A set is booked on one node, all or nothing, one GpuReservation per GPU; its pod sees
every GPU; the set is released together; a set no node can take is refused naming the closest node.
Its own control plane, since it fills whole nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_NODE, ANNOTATION_RESERVATION
from vramshare_e2e.admission_parts import SIDECAR, start_mutating_webhook
from vramshare_e2e.bookings import shown_phase_of
from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, LocalCluster
from vramshare_e2e.components import (
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

SHARDS = ("sets-one", "sets-two")
MARGIN = 512
ENV = {"VRAMSHARE_SETTLE_S": "2", "VRAMSHARE_SAFETY_MARGIN_MIB": str(MARGIN), "VRAMSHARE_HOLD_MIN_MIB": "0"}


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        ports = {ns: start_webhook(local, name=f"webhook-{ns}", env=ENV)[1] for ns in SHARDS}
        local.apply_objects([webhook_configuration(local, ports=ports)])
        start_mutating_webhook(local, mode="label")
        start_mutating_webhook(local, mode="sidecar")
        for ns in SHARDS:
            local.create_namespace(
                ns,
                {"vramshare-e2e/shard": ns, "e2e.vramshare.io/label": "on", "e2e.vramshare.io/sidecar": "on"},
            )
        start_controller(
            local,
            name="controller",
            env={**ENV, "VRAMSHARE_POLL_INTERVAL_S": "1", "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1"},
        )
        wait_for_gpu_devices(local)
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


def set_pod(name: str, mib: int, count: int, *, run: str | None = None) -> client.V1Pod:
    annotations = {"gpu-mem-mb": str(mib), "gpu-count": str(count)}
    if run:
        annotations[RUN_DURATION_ANNOTATION] = run
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/task")],
            restart_policy="Never",
        ),
    )


def reservations(stack: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    return json.loads(stack.kubectl("get", "gpureservations", "-n", namespace, "-o", "json"))["items"]  # type: ignore[no-any-return]


def members(stack: LocalCluster, namespace: str, label: str) -> list[dict[str, Any]]:
    return [
        r
        for r in reservations(stack, namespace)
        if r["metadata"]["labels"].get("vramshare.io/reservation-set", r["metadata"]["name"]) == label
    ]


def env_of(container: client.V1Container) -> dict[str, str]:
    return {e.name: e.value for e in container.env or [] if e.value is not None}


def test_a_pod_with_two_gpus_gets_both_on_one_node_and_releases_them_together(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    ns = SHARDS[0]
    # 30000 MiB each: only the A100 node has two such GPUs.
    pod = core.create_namespaced_pod(ns, set_pod("ddp-train", 30_000, 2, run="5s"))
    annotations = pod.metadata.annotations
    a100 = stack.settings.fleet.nodes[0]
    uuids = annotations[ANNOTATION_GPU_UUID].split(",")
    assert sorted(uuids) == sorted(g.uuid for g in a100.gpus)
    assert annotations[ANNOTATION_NODE] == a100.name
    # Every container, the injected sidecar included, sees both GPUs, numbered from 0.
    assert [c.name for c in pod.spec.containers] == ["base", SIDECAR]
    for container in pod.spec.containers:
        env = env_of(container)
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    label = annotations[ANNOTATION_RESERVATION]
    booked = members(stack, ns, label)
    assert sorted(r["spec"]["gpuUUID"] for r in booked) == sorted(uuids)  # one per GPU, nothing more
    assert {r["spec"]["gpuCount"] for r in booked} == {2}
    eventually(
        lambda: (
            {shown_phase_of(stack.kubectl, ns, r["metadata"]["name"]) for r in members(stack, ns, label)}
            == {"Bound"}
        ),
        what="both bookings Bound (to the one pod that carries the set's label and both GPUs)",
    )
    assert eventually(lambda: core.read_namespaced_pod("ddp-train", ns).spec.node_name, what="scheduled") == (
        a100.name
    )
    # kubectl shows the set plainly: two rows for the pod, each saying it has 2 GPUs.
    table = stack.kubectl("get", "gpureservations", "-n", ns)
    rows = [line.split() for line in table.splitlines()[1:] if "ddp-train" in line]
    header = table.splitlines()[0].split()
    assert len(rows) == 2
    assert {row[header.index("GPUS")] for row in rows} == {"2"}
    status = subprocess.run(
        [sys.executable, "-m", "vramshare.status", "status", "--kubeconfig", str(stack.kubeconfig)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert any("ddp-train" in line and "2x30000" in line for line in status.splitlines()), status
    eventually(
        lambda: {r["status"].get("phase") for r in members(stack, ns, label)} == {"Released"},
        what="both bookings Released when the pod finishes",
        timeout_s=30,
    )


def test_a_set_no_node_can_take_is_refused_naming_the_closest_node(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    a100 = stack.settings.fleet.nodes[0]
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod(SHARDS[0], set_pod("too-wide", 20_000, 3))
    message = json.loads(refused.value.body)["message"]
    assert "no node has 3 GPUs with 20000 MiB of headroom each for pod sets-one/too-wide" in message
    assert f"the closest is node {a100.name}, where 2 of the 3 GPUs needed have room" in message
    assert not [r for r in reservations(stack, SHARDS[0]) if r["spec"]["podName"] == "too-wide"]
    with pytest.raises(client.ApiException) as bad:
        core.create_namespaced_pod(SHARDS[0], set_pod("bad-count", 1_000, 0))
    assert bad.value.status == 400
    assert "annotation \"gpu-count\" has value '0'" in json.loads(bad.value.body)["message"]


def test_racing_sets_on_two_replicas_are_booked_whole_or_not_at_all(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    # Three GPUs of 6000 MiB: only the T4 node (three cards) can take a set, and each card holds two
    # such bookings, so exactly two of the eight pods fit; both replicas race for the same cards.
    t4 = stack.settings.fleet.nodes[1]
    outcomes: dict[str, str] = {}

    def create(ns: str, name: str) -> None:
        try:
            core.create_namespaced_pod(ns, set_pod(name, 6_000, 3))
            outcomes[name] = "admitted"
        except client.ApiException as exc:
            outcomes[name] = json.loads(exc.body)["message"]

    threads = [
        threading.Thread(target=create, args=(ns, f"race-{ns}-{i}")) for ns in SHARDS for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted = [n for n, o in outcomes.items() if o == "admitted"]
    assert len(admitted) == 2, outcomes
    refused = [o for o in outcomes.values() if o != "admitted"]
    assert all("no node has 3 GPUs with 6000 MiB" in o for o in refused), refused
    active = [
        r
        for ns in SHARDS
        for r in reservations(stack, ns)
        if r["spec"]["podName"].startswith("race-")
        and r["metadata"]["labels"]["vramshare.io/active"] != "false"
    ]
    # Whole sets only: three bookings per admitted pod, none for a refused one, none withdrawn late.
    per_pod = Counter(r["spec"]["podName"] for r in active)
    assert per_pod == dict.fromkeys(admitted, 3), per_pod
    per_gpu = Counter(r["spec"]["gpuUUID"] for r in active)
    assert per_gpu == {g.uuid: 2 for g in t4.gpus}, per_gpu
