"""The exporter families of 2024-2026 served through a real Prometheus with two scrape jobs on the
one exporter, read by the real controller, decided by the real webhook: one GpuDevice per GPU with the
fleet's figures whichever family writes them, a MIG GPU shown with its instances and never handed out,
and an exporter whose node label names no node is loud and harmless."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_RESERVATION
from vramshare_e2e.bookings import shown_phase_of
from vramshare_e2e.cluster import ClusterSettings, LocalCluster
from vramshare_e2e.components import metric, start_controller, start_webhook, webhook_configuration
from vramshare_e2e.fleet import FakeGpu, FakeNode, Fleet, stable_gpu_uuid
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

MAX_AGE_S = 6
CONTROLLER_ENV = {
    "VRAMSHARE_POLL_INTERVAL_S": "1",
    "VRAMSHARE_MAX_SAMPLE_AGE_S": str(MAX_AGE_S),
    "VRAMSHARE_MISSING_GRACE_S": "30",
    "VRAMSHARE_SETTLE_S": "2",
}
A100 = stable_gpu_uuid("gpu-node-a", 0)
MIG_A100 = stable_gpu_uuid("gpu-node-a", 1)
T4 = stable_gpu_uuid("gpu-node-b", 0)


def fleet() -> Fleet:
    a100 = {"model": "NVIDIA A100-SXM4-40GB", "total_mib": 40_960, "driver_reserved_mib": 512}
    return Fleet(
        nodes=[
            FakeNode(
                name="gpu-node-a",
                gpus=[
                    FakeGpu(uuid=A100, index=0, **a100),
                    FakeGpu(
                        uuid=MIG_A100,
                        index=1,
                        mig=[
                            {"profile": "3g.20gb", "instance_id": 1, "total_mib": 19_968, "used_mib": 12},
                            {"profile": "3g.20gb", "instance_id": 2, "total_mib": 19_968, "used_mib": 8012},
                        ],
                        **a100,
                    ),
                ],
            ),
            FakeNode(
                name="gpu-node-b",
                gpus=[FakeGpu(uuid=T4, index=0, model="Tesla T4", total_mib=15_360, driver_reserved_mib=256)],
            ),
        ]
    )


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LocalCluster, int]]:
    with LocalCluster.start(settings=ClusterSettings(fleet=fleet(), scrape_jobs=2)) as local:
        port = start_webhook(local, name="webhook", env={"VRAMSHARE_SETTLE_S": "2"})[1]
        local.apply_objects([webhook_configuration(local, ports={"fam": port})])
        local.create_namespace("jobs", {"vramshare-e2e/shard": "fam"})
        metrics_port = start_controller(local, name="controller", env=CONTROLLER_ENV)[1]
        yield local, metrics_port


@pytest.fixture(scope="module")
def core(stack: tuple[LocalCluster, int]) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack[0].kubeconfig)))


def devices(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    items = json.loads(cluster.kubectl("get", "gpudevices", "-o", "json"))["items"]
    return {d["spec"]["uuid"]: d for d in items}


def phase(cluster: LocalCluster, name: str) -> str:
    """The booking's phase; "gone" once deleted (the controller deletes it once its pod is gone)."""
    found = json.loads(cluster.kubectl("get", "gpureservations", "-n", "jobs", "-o", "json"))["items"]
    return next(
        (b.get("status", {}).get("phase", "") for b in found if b["metadata"]["name"] == name), "gone"
    )


def unusable(port: int, cause: str) -> float | None:
    return metric(port, f'vramshare_dcgm_series_unusable{{cause="{cause}"}}')


def pod(name: str, mib: int) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations={"gpu-mem-mb": str(mib)}),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/task")], restart_policy="Never"
        ),
    )


def test_two_scrape_jobs_give_one_gpudevice_per_gpu_with_the_fleets_figures(
    stack: tuple[LocalCluster, int],
) -> None:
    cluster, port = stack
    # Prometheus really holds every series twice (job dcgm-exporter and dcgm-exporter-1).
    assert len(cluster.prometheus_query("DCGM_FI_DEV_FB_FREE")) == 2 * (1 + 2 + 1)
    found = eventually(lambda: (d := devices(cluster)) and len(d) == 3 and d, what="3 GpuDevices")
    assert set(found) == {A100, MIG_A100, T4}
    eventually(
        lambda: all(d.get("status", {}).get("state") == "Ready" for d in devices(cluster).values()),
        what="Ready",
    )
    found = devices(cluster)
    assert (found[A100]["status"]["totalMiB"], found[A100]["status"]["usedMiB"]) == (40_960, 0)
    assert found[T4]["status"]["totalMiB"] == 15_360
    assert found[T4]["spec"]["nodeName"] == "gpu-node-b"
    eventually(
        lambda: unusable(port, "conflicting-duplicates") == 0, what="the unusable metric", timeout_s=10
    )
    assert unusable(port, "incomplete") == 0


@pytest.mark.parametrize("flavour", ["4.6.0-4.8.3", "dcgm-4.7-bytes", "4.5.3-4.8.2"])
def test_each_exporter_family_reads_as_the_same_fleet(
    stack: tuple[LocalCluster, int], core: client.CoreV1Api, flavour: str
) -> None:
    cluster, port = stack
    cluster.exporter.set_flavour(flavour)
    used = {"4.6.0-4.8.3": 1_111, "dcgm-4.7-bytes": 2_222, "4.5.3-4.8.2": 3_333}[flavour]
    cluster.exporter.set_used(A100, used)
    started = time.monotonic()

    def settled() -> bool:
        d = devices(cluster)
        return d[A100]["status"]["usedMiB"] == used and d[A100]["status"]["state"] == "Ready"

    eventually(settled, what=f"the {flavour} figures read", timeout_s=20)
    print(f"\n{flavour}: figures read {time.monotonic() - started:.1f} s after the change")
    d = devices(cluster)
    assert d[A100]["status"]["totalMiB"] == 40_960  # the capacity metric where published, else pinned
    assert d[A100]["status"]["freeMiB"] == 40_960 - 512 - used
    assert d[A100]["spec"]["nodeName"] == "gpu-node-a"
    assert d[T4]["status"]["state"] == "Ready"
    assert d[T4]["status"]["totalMiB"] == 15_360
    assert len(d) == 3
    assert unusable(port, "conflicting-duplicates") == 0
    assert unusable(port, "total-drift") == 0
    # The webhook places by these figures: 30 000 MiB fits only the whole A100 (40 448 - used - margin).
    placed = core.create_namespaced_pod("jobs", pod(f"large-{flavour.replace('.', '-')}", 30_000))
    assert placed.metadata.annotations[ANNOTATION_GPU_UUID] == A100
    booking = placed.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: shown_phase_of(cluster.kubectl, "jobs", booking) == "Bound", what="the booking Bound")
    core.delete_namespaced_pod(placed.metadata.name, "jobs", grace_period_seconds=0)
    eventually(lambda: phase(cluster, booking) in ("Released", "gone"), what="the booking released")


def test_a_mig_gpu_is_shown_with_its_instances_and_never_handed_out(
    stack: tuple[LocalCluster, int], core: client.CoreV1Api
) -> None:
    cluster, port = stack
    cluster.exporter.set_used(A100, 0)
    eventually(lambda: devices(cluster)[A100]["status"]["usedMiB"] == 0, what="the A100 idle", timeout_s=20)
    mig = devices(cluster)[MIG_A100]["status"]
    assert mig["mig"]["summary"] == "2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2)"
    assert [(i["profile"], i["instanceID"], i["usedMiB"]) for i in mig["mig"]["instances"]] == [
        ("3g.20gb", 1, 12),
        ("3g.20gb", 2, 8012),
    ]
    assert mig["headroomMiB"] == 0
    assert (
        "MIG enabled (2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2)): not handed to pods"
        in next(c for c in mig["conditions"] if c["type"] == "Ready")["message"]
    )
    table = cluster.kubectl("get", "gpudevices")
    assert "MIG" in table.splitlines()[0]
    assert "2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2)" in table
    assert metric(port, "vramshare_mig_gpus") == 1
    # The whole A100 takes the first large pod; the MIG A100 is never the answer for the second.
    first = core.create_namespaced_pod("jobs", pod("large-1", 30_000))
    assert first.metadata.annotations[ANNOTATION_GPU_UUID] == A100
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod("jobs", pod("large-2", 30_000))
    message = json.loads(refused.value.body)["message"]
    assert (
        f"{MIG_A100} (gpu-node-a, index 1): MIG enabled (2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2))"
        in message
    )
    small = [core.create_namespaced_pod("jobs", pod(f"small-{i}", 2_000)) for i in range(6)]
    assert {p.metadata.annotations[ANNOTATION_GPU_UUID] for p in small} <= {A100, T4}
    booked = json.loads(cluster.kubectl("get", "gpureservations", "-A", "-o", "json"))["items"]
    assert booked
    assert MIG_A100 not in {r["spec"].get("gpuUUID") for r in booked}
    for p in [first, *small]:
        core.delete_namespaced_pod(p.metadata.name, "jobs", grace_period_seconds=0)


def test_an_exporter_writing_its_pod_name_as_the_node_is_loud_and_harmless(
    stack: tuple[LocalCluster, int],
) -> None:
    cluster, port = stack
    log = cluster.component("controller").log_path
    cluster.exporter.set_flavour("pod-hostname")
    try:
        eventually(
            lambda: unusable(port, "unknown-node") == 3, what="3 GPUs on an unknown node", timeout_s=20
        )
        # The GPUs are not moved to a phantom node: unreported, they age to Stale (as in an outage).
        eventually(
            lambda: {d["status"]["state"] for d in devices(cluster).values()} == {"Stale"},
            what="Stale",
            timeout_s=MAX_AGE_S + 10,
        )
        d = devices(cluster)
        assert {x["spec"]["nodeName"] for x in d.values()} == {"gpu-node-a", "gpu-node-b"}
        lines = [
            json.loads(line) for line in log.read_text().splitlines() if '"DCGM series unusable"' in line
        ]
        unknown = [x for x in lines if x["cause"] == "unknown-node"]
        assert len(unknown) == 1  # logged once, not every poll
        assert "nvidia-dcgm-exporter-" in unknown[0]["problems"][0]
        assert "set node_label" in unknown[0]["problems"][0]
    finally:
        cluster.exporter.set_flavour("4.5.3-4.8.2")
    eventually(
        lambda: {d["status"]["state"] for d in devices(cluster).values()} == {"Ready"},
        what="Ready",
        timeout_s=20,
    )
    assert unusable(port, "unknown-node") == 0
    assert "DCGM series usable again" in log.read_text()
