"""A DAG whose KubernetesPodOperator task runs a real container on a real node of the local cluster.

Run by tests/integration/test_real_node_e2e.py with `airflow dags test` in Airflow's own virtualenv:
the task pod asks for an H100's memory (only the real nodes have one), vramshare's webhook (the
chart's pods) admits and pins it, the node's containerd runs it, and the operator streams the
container's output (the environment it got) into the task log. Namespace, kubeconfig and the task
image come from the environment.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import DAG

with DAG("vramshare_real_node", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
    KubernetesPodOperator(
        task_id="gpu_task",
        name="real-node-task",
        namespace=os.environ.get("VRAMSHARE_E2E_NAMESPACE", "jobs"),
        image=os.environ["VRAMSHARE_E2E_IMAGE"],
        image_pull_policy="Never",
        cmds=["sh", "-c"],
        arguments=["env | grep -E '^(NVIDIA_|CUDA_|VRAMSHARE_)' | sort"],
        annotations={"gpu-mem-mb": "30000", "gpu-model": "NVIDIA H100*"},
        config_file=os.environ.get("KUBECONFIG"),
        in_cluster=False,
        get_logs=True,
        on_finish_action="keep_pod",
        startup_timeout_seconds=120,
        startup_check_interval_seconds=1,
        retries=0,
    )
