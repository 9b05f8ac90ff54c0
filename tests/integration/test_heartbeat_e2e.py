"""The inventory heartbeat against the real stack (issue #31): unchanged GPUs stay fresh for the
webhook with no status write of their own, a GPU whose exporter goes silent is not dated by it, and
without a controller the webhook's GPUs go stale as before. Controller and webhook share a 6 s maximum
sample age, so a GPU would be stale within seconds if nothing dated it."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from vramshare.kube.heartbeat import ANNOTATION_HEARTBEAT
from vramshare.kube.resources import ANNOTATION_GPU_UUID, parse_time
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import start_controller, start_webhook, webhook_configuration
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

MAX_AGE_S = 6
SHARED = {"VRAMSHARE_MAX_SAMPLE_AGE_S": str(MAX_AGE_S), "VRAMSHARE_SETTLE_S": "2"}
CONTROLLER_ENV = {
    **SHARED,
    "VRAMSHARE_POLL_INTERVAL_S": "1",
}


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        port = start_webhook(local, name="webhook", env=SHARED)[1]
        local.apply_objects([webhook_configuration(local, ports={"hb": port})])
        local.create_namespace("jobs", {"vramshare-e2e/shard": "hb"})
        start_controller(local, name="controller", env=CONTROLLER_ENV)
        eventually(
            lambda: len(devices(local)) == len(local.settings.fleet.all_gpus()),
            what="the GPU inventory",
            timeout_s=30,
        )
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> Any:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


def devices(stack: LocalCluster) -> dict[str, dict[str, Any]]:
    items = json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]
    return {d["spec"]["uuid"]: d for d in items}


def heartbeat(stack: LocalCluster) -> dict[str, Any] | None:
    lease = json.loads(stack.kubectl("get", "lease", "vramshare-controller", "-n", "default", "-o", "json"))
    raw = (lease["metadata"].get("annotations") or {}).get(ANNOTATION_HEARTBEAT)
    return json.loads(raw) if raw else None


def status_writes(stack: LocalCluster, why: str) -> float:
    port = stack.component("controller").env["VRAMSHARE_METRICS_PORT"]  # type: ignore[index]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^vramshare_gpudevice_status_writes_total\{{why="{why}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def gpu_pod(name: str, mib: int) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations={"gpu-mem-mb": str(mib)}),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/task")],
            restart_policy="Never",
        ),
    )


def test_unchanged_gpus_stay_fresh_for_the_webhook_without_status_writes(
    stack: LocalCluster, core: Any
) -> None:
    eventually(lambda: heartbeat(stack), what="the heartbeat on the controller's Lease", timeout_s=20)

    def quiet() -> bool:  # the first polls still write (e.g. the delivery preflight's first result)
        before = status_writes(stack, "changed")
        time.sleep(3)
        return status_writes(stack, "changed") == before

    eventually(quiet, what="the inventory to stop changing", timeout_s=60)
    refreshes = status_writes(stack, "refresh")
    stored = {u: d["status"]["sampledAt"] for u, d in devices(stack).items()}
    time.sleep(3 * MAX_AGE_S)  # the exporter's figures do not change: nothing to write
    after = devices(stack)
    unchanged = [u for u, d in after.items() if d["status"]["sampledAt"] == stored[u]]
    beat = heartbeat(stack)
    assert beat is not None
    age = time.time() - (parse_time(beat["sampledAt"]) or 0.0)
    oldest = time.time() - min(parse_time(d["status"]["sampledAt"]) or 0.0 for d in after.values())
    print(
        f"\n[heartbeat] {3 * MAX_AGE_S} s with idle GPUs: {status_writes(stack, 'refresh') - refreshes:.0f} "
        f"refresh writes, {len(unchanged)}/{len(after)} GpuDevices not rewritten (oldest stored sample "
        f"{oldest:.0f} s old, max age {MAX_AGE_S} s); heartbeat sample {age:.1f} s old"
    )
    assert status_writes(stack, "refresh") == refreshes
    assert len(unchanged) == len(after)
    assert oldest > MAX_AGE_S  # stale by the stored times alone...
    assert age < MAX_AGE_S
    assert beat["unconfirmed"] == []
    pod = core.create_namespaced_pod("jobs", gpu_pod("dated", 1000))  # ...yet admitted
    assert pod.metadata.annotations[ANNOTATION_GPU_UUID]
    core.delete_namespaced_pod("dated", "jobs")


def test_a_silent_gpu_is_left_out_of_the_heartbeat_and_not_chosen(stack: LocalCluster, core: Any) -> None:
    gpus = [g.uuid for _, g in stack.settings.fleet.all_gpus()]
    keep, silent = gpus[0], gpus[1:]
    for uuid in silent:
        stack.exporter.set_silent(uuid, True)
    try:
        eventually(
            lambda: (b := heartbeat(stack)) is not None and set(silent) <= set(b["unconfirmed"]),
            what="the silent GPUs unconfirmed by the heartbeat",
            timeout_s=3 * MAX_AGE_S,
        )
        time.sleep(MAX_AGE_S)  # past their last sample's age
        placed = [
            core.create_namespaced_pod("jobs", gpu_pod(f"after-silence-{i}", 500)).metadata.annotations[
                ANNOTATION_GPU_UUID
            ]
            for i in range(3)
        ]
        assert set(placed) == {keep}, placed
    finally:
        for uuid in silent:
            stack.exporter.set_silent(uuid, False)
        stack.kubectl("delete", "pods", "--all", "-n", "jobs", "--wait=false")


def test_without_the_controller_the_webhooks_gpus_go_stale(stack: LocalCluster, core: Any) -> None:
    """The heartbeat is a statement the leader keeps renewing: when it stops, GPUs age as before."""
    eventually(
        lambda: (b := heartbeat(stack)) is not None and b["unconfirmed"] == [],
        what="every GPU confirmed again",
        timeout_s=4 * MAX_AGE_S,
    )
    stack.stop_component("controller")
    try:
        time.sleep(2 * MAX_AGE_S)
        with pytest.raises(ApiException) as refused:
            core.create_namespaced_pod("jobs", gpu_pod("no-controller", 1000))
        assert refused.value.status == 403
        print(f"\n[heartbeat] with the controller stopped: {json.loads(refused.value.body)['message'][:300]}")
    finally:
        stack.start_component("controller")
