"""A real Apache Airflow 3 against vramshare on the local control plane.

Airflow (and its cncf-kubernetes provider) runs from its own cached virtualenv: `airflow dags test`
runs DAGs whose KubernetesPodOperator tasks create pods through the real webhook over TLS; the
KubernetesExecutor's own pod-launch code creates worker pods; the controller keeps Kaapana's pool in
step through a real `airflow api-server`. Pods finish through kwok. Its own control plane.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from vramshare.kube.resources import ANNOTATION_RESERVATION
from vramshare_e2e.airflow import (
    PASSWORD,
    USER,
    Airflow,
    latest_task_instances,
    pool_slots,
    prepare,
    start_api_server,
)
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import (
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent / "airflow"
POOL = "NODE_GPU_COUNT"
POLL_S = 1.0
WEBHOOK = "af.gpu-mem.vramshare.io"


@dataclass
class Stack:
    cluster: LocalCluster
    airflow: Airflow
    api_port: int
    core: client.CoreV1Api


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("airflow")
    with LocalCluster.start() as local:
        airflow = prepare(local, home=home)
        shutil.copy(HERE / "dags.py", home / "dags" / "vramshare_dags.py")
        api_port = start_api_server(local, airflow)
        password_file = home / "pool-password"
        password_file.write_text(PASSWORD + "\n")
        # Short Retry-After so the 429 test waits seconds; no holds, so each test starts from a clean
        # ledger (holds have their own tests).
        port = start_webhook(
            local,
            name="webhook",
            env={
                "VRAMSHARE_SETTLE_S": "2",
                "VRAMSHARE_RETRY_AFTER_S": "2",
                "VRAMSHARE_RETRY_AFTER_MIN_S": "1",
                "VRAMSHARE_HOLD_MIN_MIB": "0",
            },
        )[1]
        local.apply_objects([webhook_configuration(local, ports={"af": port})])
        for namespace in ("airflow", "executor", "executor-forbidden", "executor-429", "executor-blockers"):
            refusal = {"executor-forbidden": "forbidden", "executor-429": "retry-after"}.get(namespace)
            local.create_namespace(
                namespace,
                {"vramshare-e2e/shard": "af", **({"vramshare.io/refusal": refusal} if refusal else {})},
            )
        start_controller(
            local,
            name="controller",
            env={
                "VRAMSHARE_POLL_INTERVAL_S": str(POLL_S),
                "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
                "VRAMSHARE_MISSING_GRACE_S": "3",
                "VRAMSHARE_SETTLE_S": "2",
                "VRAMSHARE_AIRFLOW_URL": f"http://127.0.0.1:{api_port}",
                "VRAMSHARE_AIRFLOW_USERNAME": USER,
                "VRAMSHARE_AIRFLOW_PASSWORD_FILE": str(password_file),
                "VRAMSHARE_AIRFLOW_POOL": POOL,
            },
        )
        wait_for_gpu_devices(local)
        core = client.CoreV1Api(config.new_client_from_config(config_file=str(local.kubeconfig)))
        yield Stack(cluster=local, airflow=airflow, api_port=api_port, core=core)


def device_states(cluster: LocalCluster) -> dict[str, str]:
    items = json.loads(cluster.kubectl("get", "gpudevices", "-o", "json"))["items"]
    return {d["spec"]["uuid"]: d.get("status", {}).get("state", "") for d in items}


def reservations(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "gpureservations", "-n", namespace, "-o", "json")
    return json.loads(out)["items"]  # type: ignore[no-any-return]


def dag_test(stack: Stack, dag_id: str, *, free_blockers_after: str | None = None) -> tuple[str, float]:
    """`airflow dags test`: the run's output and how long it took. With `free_blockers_after` (a
    decision outcome), the blockers go once the webhook has decided that about the DAG's pod."""
    started = time.monotonic()
    run = stack.airflow.start("dags", "test", dag_id, env={"VRAMSHARE_E2E_NAMESPACE": "airflow"})
    pod = "airflow/" + dag_id.replace("_", "-")
    output = output_freeing_blockers(
        stack, run, after=None if free_blockers_after is None else (pod, free_blockers_after)
    )
    (stack.cluster.logs_dir / f"airflow-dags-test-{dag_id}.log").write_text(output)
    return output, time.monotonic() - started


def output_freeing_blockers(
    stack: Stack, run: subprocess.Popen[str], *, after: tuple[str, str] | None
) -> str:
    """`run`'s output once it has ended. With `after` (a pod name prefix and a decision outcome), the
    blockers are deleted 2 s after the webhook has decided so about that pod: memory frees while the
    task is refused or waiting (re-queued a few times, refused more than once), whatever Airflow's
    start-up took."""
    try:
        if after is not None:
            pod, outcome = after
            eventually(lambda: decided(stack, pod, outcome), what=f"{pod} {outcome}", timeout_s=90)
            time.sleep(2)
            free_blockers(stack)
        output, _ = run.communicate(timeout=300)
    finally:
        run.kill()
    return output


def decided(stack: Stack, pod_prefix: str, outcome: str) -> bool:
    """Whether the webhook has logged a decision `outcome` for a pod whose name starts so."""
    for line in stack.cluster.component("webhook").log_path.read_text().splitlines():
        if '"decision"' in line and f'"{outcome}"' in line:
            entry = json.loads(line)
            if entry.get("outcome") == outcome and str(entry.get("pod", "")).startswith(pod_prefix):
                return True
    return False


def task_states(stack: Stack, dag_id: str) -> list[dict[str, Any]]:
    """The task instances of the DAG's latest run, as Airflow's REST API reports them."""
    return latest_task_instances(stack.api_port, dag_id)


def wait_until_nothing_is_booked(stack: Stack) -> None:
    def idle() -> bool:
        out = json.loads(stack.cluster.kubectl("get", "gpureservations", "-A", "-o", "json"))["items"]
        return not any(
            r.get("status", {}).get("phase") in ("Reserved", "Bound", "Queued", "Held") for r in out
        )

    eventually(idle, what="no GPU memory booked", timeout_s=60)


BLOCKER = "e2e-blocker=true"


def block_a100s(stack: Stack, namespace: str) -> None:
    """Book 30000 MiB on both A100s (plain annotated pods that run until deleted), so a 30000 MiB
    task waits; `free_blockers` ends them."""
    wait_until_nothing_is_booked(stack)
    for i in range(2):
        stack.core.create_namespaced_pod(
            namespace,
            client.V1Pod(
                metadata=client.V1ObjectMeta(
                    name=f"blocker-{i}", labels={"e2e-blocker": "true"}, annotations={"gpu-mem-mb": "30000"}
                ),
                spec=client.V1PodSpec(
                    containers=[client.V1Container(name="base", image="example.invalid/blocker")],
                    restart_policy="Never",
                ),
            ),
        )


def free_blockers(stack: Stack) -> None:
    for namespace in ("airflow", "executor-blockers"):
        stack.core.delete_collection_namespaced_pod(namespace, label_selector=BLOCKER, grace_period_seconds=0)


# --- 3. Kaapana's pool, kept in step ---------------------------------------------------------------


def test_the_pool_follows_ready_gpus_within_one_inventory_interval(stack: Stack) -> None:
    cluster = stack.cluster
    gpus = [g.uuid for _, g in cluster.settings.fleet.all_gpus()]
    eventually(lambda: pool_slots(stack.api_port, POOL) == len(gpus), what="the pool created with 5 slots")
    # A GPU whose DCGM series stops while its node reports others goes Missing: one slot less.
    cluster.exporter.set_silent(gpus[-1], True)
    missing_at = eventually(
        lambda: device_states(cluster)[gpus[-1]] == "Missing" and time.monotonic(), what="Missing"
    )
    eventually(lambda: pool_slots(stack.api_port, POOL) == len(gpus) - 1, what="one slot less")
    lag = time.monotonic() - missing_at
    print(f"\npool slots followed a GPU going Missing {lag:.2f} s after its GpuDevice said so")
    assert lag < POLL_S + 1.5  # the same poll writes both; the rest is this test's own polling
    cluster.exporter.set_silent(gpus[-1], False)
    eventually(lambda: pool_slots(stack.api_port, POOL) == len(gpus), what="the slot back")


def test_airflow_away_is_logged_once_and_the_pool_is_set_when_it_returns(stack: Stack) -> None:
    cluster = stack.cluster
    gpus = [g.uuid for _, g in cluster.settings.fleet.all_gpus()]
    log = cluster.component("controller").log_path
    eventually(lambda: pool_slots(stack.api_port, POOL) == len(gpus), what="the pool in step")
    cluster.stop_component("airflow-api-server")
    try:
        cluster.exporter.set_silent(gpus[0], True)
        eventually(lambda: device_states(cluster)[gpus[0]] == "Missing", what="Missing while Airflow is away")
        time.sleep(3 * POLL_S)  # several failed polls
        away = [json.loads(line) for line in log.read_text().splitlines() if "Airflow unreachable" in line]
        assert len(away) == 1, away
        assert away[0]["level"] == "warning"
        assert away[0]["slots"] == len(gpus) - 1
    finally:
        cluster.start_component("airflow-api-server")
    eventually(
        lambda: pool_slots(stack.api_port, POOL) == len(gpus) - 1, what="the pool set after Airflow returns"
    )
    assert "Airflow reachable again" in log.read_text()
    cluster.exporter.set_silent(gpus[0], False)
    eventually(lambda: pool_slots(stack.api_port, POOL) == len(gpus), what="the slot back")


# --- 1. KubernetesPodOperator tasks through vramshare ---------------------------------------------


def test_a_task_that_fits_succeeds_on_its_gpu_and_its_reservation_ends_released(stack: Stack) -> None:
    output, took = dag_test(stack, "vramshare_fits")
    (task,) = task_states(stack, "vramshare_fits")
    assert task["state"] == "success", output[-3000:]
    print(f"\nKubernetesPodOperator task with 4000 MiB: success in {took:.1f} s")
    (pod,) = stack.core.list_namespaced_pod("airflow", label_selector="dag_id=vramshare_fits").items
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    gpus = {g.uuid for _, g in stack.cluster.settings.fleet.all_gpus()}
    assert env["NVIDIA_VISIBLE_DEVICES"] in gpus
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    name = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(
        lambda: (
            next(r for r in reservations(stack.cluster, "airflow") if r["metadata"]["name"] == name)
            .get("status", {})
            .get("phase")
            == "Released"
        ),
        what="its reservation Released",
    )


def test_a_task_larger_than_any_gpu_fails_its_try_with_vramshares_explanation(stack: Stack) -> None:
    output, _ = dag_test(stack, "vramshare_too_large")
    (task,) = task_states(stack, "vramshare_too_large")
    assert task["state"] == "failed"
    # The task log carries the client's exception: the API server's Status body, whose message is
    # vramshare's explanation inside the API server's words.
    (raw,) = {  # the exception is printed more than once; one distinct refusal
        line.split("HTTP response body: ", 1)[1]
        for line in output.splitlines()
        if "HTTP response body: " in line
    }
    body = json.loads(raw)
    assert (body["code"], body["reason"]) == (403, "Forbidden")
    message = body["message"]
    assert message.startswith(
        f'admission webhook "{WEBHOOK}" denied the request: no GPU has 100000 MiB of headroom for pod '
        "airflow/vramshare-too-large-"
    ), message
    assert "the most any GPU can give is 39936 MiB" in message
    assert message.endswith("The pod was not created; Airflow retries the task after its retry_delay.")
    assert not stack.core.list_namespaced_pod("airflow", label_selector="dag_id=vramshare_too_large").items


def test_in_429_mode_a_refused_task_succeeds_inside_the_same_try_once_memory_frees(stack: Stack) -> None:
    block_a100s(stack, "airflow")
    output, took = dag_test(stack, "vramshare_waits_429", free_blockers_after="refused")
    (task,) = task_states(stack, "vramshare_waits_429")
    assert task["state"] == "success", output[-3000:]
    assert task["try_number"] == 1
    # The provider's create retry, waiting what the API server's Retry-After (from vramshare) said.
    retries = re.findall(
        r"Retrying \S+PodManager.create_pod in (\d+) seconds as it raised ApiException: \(429\)", output
    )
    assert retries, output[-3000:]
    assert "'Retry-After': '" in output
    print(
        f"\n429 mode: refused {len(retries)}x while the A100s were busy (waits {retries} s), admitted in "
        f"the same try; the run took {took:.1f} s"
    )


def test_in_queue_mode_a_task_waits_and_succeeds_without_spending_a_try(stack: Stack) -> None:
    block_a100s(stack, "airflow")
    output, took = dag_test(stack, "vramshare_waits_queued", free_blockers_after="queued")
    (task,) = task_states(stack, "vramshare_waits_queued")
    assert task["state"] == "success", output[-3000:]
    assert task["try_number"] == 1
    (pod,) = stack.core.list_namespaced_pod("airflow", label_selector="dag_id=vramshare_waits_queued").items
    assert pod.spec.scheduling_gates in (None, [])  # lifted by the controller
    assert decided(stack, "airflow/vramshare-waits-queued", "queued")  # it was admitted gated, to wait
    print(f"\nqueue mode: the task waited behind the gate and succeeded in {took:.1f} s")


# --- 2. The KubernetesExecutor ----------------------------------------------------------------------


def executor_launch(
    stack: Stack, namespace: str, *, mib: int, seconds: float, free_blockers_after_refusal: bool = False
) -> tuple[dict[str, Any], str]:
    template = stack.airflow.home / "pod_template.yaml"
    template.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: worker\nspec:\n  restartPolicy: Never\n"
        "  containers:\n    - name: base\n      image: example.invalid/airflow:3\n"
    )
    run = stack.airflow.start_python(
        HERE / "executor_launch.py",
        namespace,
        str(mib),
        str(seconds),
        env={
            "AIRFLOW__CORE__EXECUTOR": "KubernetesExecutor",
            "AIRFLOW__KUBERNETES_EXECUTOR__NAMESPACE": namespace,
            "AIRFLOW__KUBERNETES_EXECUTOR__IN_CLUSTER": "False",
            "AIRFLOW__KUBERNETES_EXECUTOR__CONFIG_FILE": str(stack.cluster.kubeconfig),
            "AIRFLOW__KUBERNETES_EXECUTOR__POD_TEMPLATE_FILE": str(template),
            "AIRFLOW__KUBERNETES_EXECUTOR__WORKER_CONTAINER_REPOSITORY": "example.invalid/airflow",
            "AIRFLOW__KUBERNETES_EXECUTOR__WORKER_CONTAINER_TAG": "3",
            "AIRFLOW__KUBERNETES_EXECUTOR__TASK_PUBLISH_MAX_RETRIES": "-1",
            "AIRFLOW__KUBERNETES_EXECUTOR__DELETE_WORKER_PODS": "False",
        },
    )
    output = output_freeing_blockers(
        stack, run, after=(f"{namespace}/", "refused") if free_blockers_after_refusal else None
    )
    done = subprocess.CompletedProcess(run.args, run.returncode, output)
    # Its pods run until deleted; they and their bookings go.
    stack.core.delete_collection_namespaced_pod(namespace, label_selector="kubernetes_executor=True")
    assert done.returncode == 0, done.stdout[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def test_the_executor_requeues_a_refused_gpu_task_without_a_try_and_without_pausing_others(
    stack: Stack,
) -> None:
    block_a100s(stack, "executor-blockers")
    result, log = executor_launch(stack, "executor", mib=30_000, seconds=60, free_blockers_after_refusal=True)
    print(f"\nKubernetesExecutor, default refusal (requeue): {result}")
    # Refused while the A100s were busy, re-queued (no try spent), then created once memory freed.
    assert result["requeued"] >= 1
    assert result["failed_after_s"] is None
    assert not result["paused"]
    assert result["gpu_pod_visible_devices"] is not None
    assert result["created_after_s"]["plain_task"] < result["created_after_s"]["gpu_task"]
    # Not held back by the GPU task's refusals: created right after the first one, whatever the time.
    assert result["gpu_refusals_before"]["plain_task"] <= 1
    # What the scheduler's log says, with vramshare's explanation.
    line = next(line for line in log.splitlines() if "Kube ApiException for Task" in line)
    assert "Reason: 'Forbidden'" in line
    assert f'admission webhook "{WEBHOOK}" denied the request' in line
    assert "exceeded quota" in line


def test_with_the_forbidden_refusal_the_executor_fails_the_task_and_with_429_it_pauses_all(
    stack: Stack,
) -> None:
    block_a100s(stack, "executor-blockers")
    failed, _ = executor_launch(stack, "executor-forbidden", mib=30_000, seconds=10)
    assert failed["failed_after_s"] is not None
    assert failed["requeued"] == 0
    paused, _ = executor_launch(stack, "executor-429", mib=30_000, seconds=6)
    assert paused["paused"]
    free_blockers(stack)
    print(f"\nforbidden: failed after {failed['failed_after_s']} s; retry-after: pod creation paused")
