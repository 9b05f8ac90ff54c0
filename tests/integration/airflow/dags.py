"""DAGs whose KubernetesPodOperator tasks create pods through vramshare on the local control plane.

Run by tests/integration/test_airflow_e2e.py with `airflow dags test` in Airflow's own virtualenv.
Pods never run a container: kwok finishes them after the duration in the annotation
e2e.vramshare.io/run-duration. The namespace and kubeconfig come from the environment.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import DAG

NAMESPACE = os.environ.get("VRAMSHARE_E2E_NAMESPACE", "airflow")
KUBECONFIG = os.environ.get("KUBECONFIG")


def gpu_task(dag: DAG, *, mib: int, run: str = "1s", **annotations: str) -> KubernetesPodOperator:
    return KubernetesPodOperator(
        dag=dag,
        task_id="gpu_task",
        name=dag.dag_id.replace("_", "-"),
        namespace=NAMESPACE,
        image="example.invalid/gpu-task:1",
        annotations={"gpu-mem-mb": str(mib), "e2e.vramshare.io/run-duration": run, **annotations},
        config_file=KUBECONFIG,
        in_cluster=False,
        get_logs=False,
        on_finish_action="keep_pod",
        startup_timeout_seconds=120,
        startup_check_interval_seconds=1,  # the default 5 s only slows the tests
        retries=0,
    )


def dag(dag_id: str) -> DAG:
    return DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False)


with dag("vramshare_fits") as fits:
    gpu_task(fits, mib=4000)

with dag("vramshare_too_large") as too_large:
    gpu_task(too_large, mib=100_000)

# While the A100s are busy: 429 mode (the create is retried inside the try) ...
with dag("vramshare_waits_429") as waits_429:
    gpu_task(waits_429, mib=30_000, **{"gpu-refusal": "retry-after"})

# ... and queue mode (admitted behind the scheduling gate, placed when memory frees).
with dag("vramshare_waits_queued") as waits_queued:
    gpu_task(waits_queued, mib=30_000, **{"gpu-queue": "true"})
