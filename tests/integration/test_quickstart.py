"""The quick start, run as the manual writes it: its commands, copied from the page, against a real API
server (the local control plane), with the helm and kubectl the harness builds. The README carries the
same block (a unit test checks), so both pages stay true."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from vramshare_e2e.cluster import LocalCluster

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "install" / "quickstart.md"


def quick_start() -> str:
    match = re.search(r"```bash\n(.*?)```", PAGE.read_text(), re.S)
    assert match is not None, f"{PAGE} has no bash block"
    return match.group(1)


def test_the_quick_start_runs_as_written() -> None:
    commands = quick_start()
    with LocalCluster.start() as cluster:
        # What the page assumes: Airflow's namespace exists.
        cluster.kubectl("create", "namespace", "airflow")
        env = {
            **os.environ,
            "PATH": f"{cluster.bin_dir}{os.pathsep}{os.environ['PATH']}",
            "KUBECONFIG": str(cluster.kubeconfig),
        }
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", commands],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        print(result.stdout, result.stderr)
        assert result.returncode == 0, result.stderr

        helm = subprocess.run(
            [str(cluster.bin_dir / "helm"), "status", "vramshare", "-n", "vramshare", "-o", "json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        status = json.loads(helm.stdout)
        assert status["info"]["status"] == "deployed"
        labels = json.loads(cluster.kubectl("get", "namespace", "airflow", "-o", "json"))["metadata"][
            "labels"
        ]
        assert labels["vramshare.io/managed"] == "true"
        # Beside NVIDIA's device plugin, vramshare holds what it shares: the holders' PriorityClass.
        priority = json.loads(cluster.kubectl("get", "priorityclass", "vramshare-gpu-holder", "-o", "json"))
        assert priority["preemptionPolicy"] == "Never"
        # The webhook is registered for pod creation, and the controller reads the Prometheus named.
        webhooks = json.loads(
            cluster.kubectl("get", "mutatingwebhookconfiguration", "vramshare", "-o", "json")
        )
        assert any("pods" in rule["resources"] for w in webhooks["webhooks"] for rule in w["rules"])
        controller = json.loads(
            cluster.kubectl("get", "deployment", "vramshare-controller", "-n", "vramshare", "-o", "json")
        )
        env_vars = {
            e["name"]: e.get("value") for e in controller["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env_vars["VRAMSHARE_PROMETHEUS_URL"] == "http://prometheus-server.monitoring.svc"
        # The last command answered from the CRD the chart installed (no GPUs in a cluster without DCGM).
        assert "error" not in result.stderr.lower()
