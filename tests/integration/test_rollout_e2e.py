"""A rolling restart of the webhook under load: two replicas behind a Service-like balancer (new
connections go to replicas whose /readyz answers 200, as endpoints do), 300 GPU pods created steadily,
and each replica restarted in turn with SIGTERM, as a Deployment's rolling update does. With
`failurePolicy: Fail` every dropped answer would be a failed pod creation; the drain (not ready at
once, answering meanwhile, closing connections after their answer, finishing what is in flight) makes
it 0. Its own control plane."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from kubernetes import client, config

from vramshare.kube.resources import ANNOTATION_GPU_UUID
from vramshare_e2e.admission_parts import start_endpoints
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import (
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

NS = "rollout"
PODS = 300
ENV = {"VRAMSHARE_SETTLE_S": "2", "VRAMSHARE_SHUTDOWN_DELAY_S": "1", "VRAMSHARE_HOLD_MIN_MIB": "0"}


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        ports = [start_webhook(local, name=f"webhook-{i}", env=ENV)[1] for i in (1, 2)]
        service = start_endpoints(local, backends=ports)
        local.apply_objects([webhook_configuration(local, ports={NS: service})])
        local.create_namespace(NS, {"vramshare-e2e/shard": NS})
        start_controller(local, name="controller", env={"VRAMSHARE_POLL_INTERVAL_S": "1"})
        wait_for_gpu_devices(local)
        yield local


def test_a_rolling_restart_of_both_replicas_under_load_fails_no_pod_creation(stack: LocalCluster) -> None:
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    done = threading.Event()

    def create(i: int) -> None:
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=f"task-{i:03d}", annotations={"gpu-mem-mb": "64"}),
            spec=client.V1PodSpec(
                containers=[client.V1Container(name="base", image="example.invalid/task")],
                restart_policy="Never",
            ),
        )
        try:
            made = core.create_namespaced_pod(NS, pod)
            outcomes["pinned" if made.metadata.annotations.get(ANNOTATION_GPU_UUID) else "not pinned"] += 1
        except client.ApiException as exc:
            outcomes[f"HTTP {exc.status}"] += 1
            failures.append(json.loads(exc.body).get("message", exc.body)[:300] if exc.body else str(exc))

    def load() -> None:
        with ThreadPoolExecutor(max_workers=8) as pool:
            for i in range(PODS):
                pool.submit(create, i)
                time.sleep(0.07)  # about 14 creations a second: the load spans the whole rollout
        done.set()

    loader = threading.Thread(target=load)
    started = time.monotonic()
    loader.start()
    restarts = []
    for name in ("webhook-1", "webhook-2"):  # one at a time, as maxUnavailable: 1 does
        time.sleep(2)
        replica = stack.component(name)
        stopping = time.monotonic()
        replica.stop()  # SIGTERM, and wait for it to exit
        restarts.append(time.monotonic() - stopping)
        assert "draining" in replica.log_path.read_text()
        stack.start_component(name)  # the new pod: ready once its caches are synced
    loader.join()
    took = time.monotonic() - started
    assert done.is_set()
    print(
        f"\n{PODS} creations over {took:.0f} s across a rolling restart of both replicas "
        f"(each drained and exited in {', '.join(f'{s:.1f} s' for s in restarts)}): {dict(outcomes)}"
    )
    assert outcomes == {"pinned": PODS}, failures[:5]
    # Both replicas answered: the load really went through the restarts.
    answered = [
        stack.component(n).log_path.read_text().count('"outcome": "admitted"')
        + stack.component(n).log_path.read_text().count("outcome=admitted")
        for n in ("webhook-1", "webhook-2")
    ]
    assert all(answered), answered
    eventually(
        lambda: (
            len(json.loads(stack.kubectl("get", "gpureservations", "-n", NS, "-o", "json"))["items"]) == PODS
        ),
        what="one reservation per pod",
    )
