"""The KubernetesExecutor's real pod-launch code against the local API server.

Run inside Airflow's virtualenv by tests/integration/test_airflow_e2e.py. It starts the executor (as
the scheduler would), hands it two task instances, a GPU task (pod_override with gpu-mem-mb) and a
plain one, and calls `sync()` (the scheduler's heartbeat) once a second, recording what the executor
did with each: whether the GPU task was re-queued or failed, whether pod creation was paused, and when
each pod was created. Prints one JSON object on its last line.

Usage: executor_launch.py <namespace> <gpu MiB> <seconds>
"""

from __future__ import annotations

import json
import sys
import time

from airflow.models.taskinstancekey import TaskInstanceKey
from airflow.providers.cncf.kubernetes.executors.kubernetes_executor import KubernetesExecutor
from kubernetes import client, config
from kubernetes.client import models as k8s

namespace, mib, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
run_id = f"manual__{namespace}"
gpu = TaskInstanceKey("vramshare_executor", "gpu_task", run_id, 1, -1)
plain = TaskInstanceKey("vramshare_executor", "plain_task", run_id, 1, -1)


def command(key: TaskInstanceKey) -> list[str]:
    return ["airflow", "tasks", "run", key.dag_id, key.task_id, key.run_id]


core = client.CoreV1Api(config.new_client_from_config())
executor = KubernetesExecutor()
executor.job_id = 1
executor.start()
override = k8s.V1Pod(
    metadata=k8s.V1ObjectMeta(annotations={"gpu-mem-mb": str(mib), "e2e.vramshare.io/run-duration": "600s"})
)
executor.execute_async(gpu, command(gpu), executor_config={"pod_override": override})
executor.execute_async(plain, command(plain), executor_config=None)

started = time.monotonic()
seen: dict[str, float] = {}
# How often the GPU task had been refused when each pod appeared: a plain task that waits behind the
# GPU task's refusals would appear only after several.
refusals_before: dict[str, int] = {}
paused = False
requeued = 0
failed_at = None
while time.monotonic() - started < seconds:
    executor.sync()
    requeued = max(requeued, executor.task_publish_retries.get(gpu, 0))
    paused = paused or executor.create_pods_after is not None
    state = executor.event_buffer.get(gpu, (None, None))[0]
    if state == "failed" and failed_at is None:
        failed_at = round(time.monotonic() - started, 1)
    for pod in core.list_namespaced_pod(namespace, label_selector="kubernetes_executor=True").items:
        task = pod.metadata.labels.get("task_id")
        if task not in seen:
            seen[task] = round(time.monotonic() - started, 1)
            refusals_before[task] = requeued
    if "gpu_task" in seen or failed_at is not None or paused:
        break
    time.sleep(1)

gpu_pod = next(
    (
        p
        for p in core.list_namespaced_pod(namespace, label_selector="task_id=gpu_task").items
        if p.metadata.labels.get("kubernetes_executor") == "True"
    ),
    None,
)
env = {e.name: e.value for e in (gpu_pod.spec.containers[0].env or [])} if gpu_pod else {}
result = {
    "requeued": requeued,
    "paused": paused,
    "failed_after_s": failed_at,
    "created_after_s": seen,
    "gpu_refusals_before": refusals_before,
    "gpu_pod_visible_devices": env.get("NVIDIA_VISIBLE_DEVICES"),
    "gpu_try_number": gpu.try_number,
}
executor.end()
print(json.dumps(result), flush=True)
