"""vramshare's own processes on the local control plane: webhook replicas, their registration, and a
seeded GPU inventory for tests that run without the controller."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from vramshare.kube.resources import (
    API_VERSION,
    FINALIZER_POD_GONE,
    MEMORY_RESOURCE,
    device_name,
    format_time_precise,
)
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.credentials import WEBHOOK_CLIENT
from vramshare_e2e.fleet import Fleet
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import Component, eventually, http_ok

ROOT = Path(__file__).resolve().parents[2]

WEBHOOK_NAME = "gpu-mem.vramshare.io"
POD_CREATE_RULES = [
    {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "operations": ["CREATE"],
        "resources": ["pods"],
        "scope": "Namespaced",
    }
]
VRAMSHARE_RULES = [
    *POD_CREATE_RULES,
    {  # kubectl debug: the new containers get the pod's GPUs, or none (as the chart registers it)
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "operations": ["UPDATE"],
        "resources": ["pods/ephemeralcontainers"],
        "scope": "Namespaced",
    },
]


CONTROLLER_NAMESPACE = "default"
"""Where the controllers the tests start keep their Lease."""

CHART = Path(__file__).resolve().parents[2] / "charts" / "vramshare"


def chart_webhook_env(*names: str) -> dict[str, str]:
    """Webhook settings as the chart sets them by default (its values.yaml), as environment variables:
    a webhook started here then runs as one the chart installs."""
    settings = yaml.safe_load((CHART / "values.yaml").read_text())["webhook"]["settings"]
    return {f"VRAMSHARE_{name.upper()}": str(settings[name]) for name in names}


def start_webhook(
    cluster: LocalCluster,
    *,
    name: str,
    env: Mapping[str, str] | None = None,
    kubeconfig: Path | None = None,
    port: int | None = None,
) -> tuple[Component, int]:
    """Start one webhook replica over TLS (on a free port unless given); returns it and the port."""
    port = port or free_port()
    pair = cluster.ca.issue(
        f"webhook-{name}",
        common_name="vramshare-webhook",
        server_ips=("127.0.0.1",),
        server_names=("localhost",),
    )
    environment = {
        **os.environ,
        "VRAMSHARE_PORT": str(port),
        "VRAMSHARE_HOST": "127.0.0.1",
        "VRAMSHARE_TLS_CERT_FILE": str(pair.cert_path),
        "VRAMSHARE_TLS_KEY_FILE": str(pair.key_path),
        "VRAMSHARE_KUBECONFIG": str(kubeconfig or cluster.kubeconfig),
        # Where start_controller's replicas keep their Lease (and the inventory heartbeat on it).
        "VRAMSHARE_CONTROLLER_LEASE": f"{CONTROLLER_NAMESPACE}/vramshare-controller",
        # The replicas keep Leases of their own there, to deal GPUs that tie out among themselves.
        "VRAMSHARE_NAMESPACE": CONTROLLER_NAMESPACE,
        "VRAMSHARE_REPLICA_LEASE_S": "15",
        # Only the API server may ask for decisions: the client certificate its AdmissionConfiguration
        # presents (see vramshare_e2e.credentials), as the README tells operators to configure theirs.
        "VRAMSHARE_CLIENT_CA_FILE": str(cluster.ca.cert_path),
        "VRAMSHARE_CLIENT_NAMES": WEBHOOK_CLIENT,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    # The probe checks readiness only; in the self-managed TLS mode the webhook's CA is its own.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    component = Component(
        name=name,
        argv=[sys.executable, "-m", "vramshare_webhook"],
        log_path=cluster.logs_dir / f"{name}.log",
        ready=lambda: http_ok(f"https://127.0.0.1:{port}/readyz", context=ctx),
        env=environment,
    )
    cluster.add_component(component)
    return component, port


def webhook_configuration(
    cluster: LocalCluster,
    *,
    ports: Mapping[str, int],
    annotation: str = "gpu-mem-mb",
    timeout_s: int = 10,
    as_the_chart: bool = False,
    hide_in_process: bool = False,
) -> dict[str, Any]:
    """A MutatingWebhookConfiguration with one entry per shard: namespaces labelled
    `vramshare-e2e/shard=<shard>` go to that shard's replica, so tests decide which replica answers.
    With `as_the_chart`, split as the chart registers it: the GPU entry sees only pods with the
    annotation (a match condition the API server evaluates), and a second entry, with the chart's
    failurePolicy Ignore, the others, whose GPUs it hides. With `hide_in_process` too, that second entry
    leaves plain pods to the chart's MutatingAdmissionPolicy (`hide_gpus_policy`), as the chart does
    where the API server serves it."""
    ca = base64.b64encode(cluster.ca.cert_pem).decode()
    webhooks = []
    for shard, port in ports.items():
        entry = {
            "name": f"{shard}.{WEBHOOK_NAME}",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "NoneOnDryRun",
            "failurePolicy": "Fail",
            "matchPolicy": "Equivalent",
            "reinvocationPolicy": "IfNeeded",
            "timeoutSeconds": timeout_s,
            "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate", "caBundle": ca},
            "rules": VRAMSHARE_RULES,
            "namespaceSelector": {"matchLabels": {"vramshare-e2e/shard": shard}},
        }
        if not as_the_chart:
            webhooks.append(entry)
            continue
        asks = f"has(object.metadata.annotations) && '{annotation}' in object.metadata.annotations"
        webhooks.append({**entry, "matchConditions": [{"name": "requests-gpu-memory", "expression": asks}]})
        hide = [{"name": "no-gpu-memory-request", "expression": f"!({asks})"}]
        if hide_in_process:
            data = _in_process()
            plain = " && ".join(f"({c['expression']})" for c in [*data["policy"], *data["plainPod"]])
            hide.append(
                {
                    "name": "not-hidden-in-process",
                    "expression": f"request.subResource == 'ephemeralcontainers' || !({plain}) "
                    f"|| !({data['hidden']['expression']})",
                }
            )
        webhooks.append(
            {
                **entry,
                "name": f"hide-{shard}.{WEBHOOK_NAME}",
                "failurePolicy": "Ignore",
                "matchConditions": hide,
            }
        )
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "vramshare-e2e"},
        "webhooks": webhooks,
    }


POD_CREATE = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
"""An admission policy's rule for pod creations."""


def _in_process() -> dict[str, Any]:
    """The chart's in-process hiding (its CEL), which the chart's templates build from too."""
    data = yaml.safe_load((ROOT / "charts" / "vramshare" / "files" / "hide-gpus-in-process.yaml").read_text())
    return dict(data)


def hide_gpus_policy(
    *, namespace_selector: dict[str, Any], annotation: str = "gpu-mem-mb"
) -> list[dict[str, Any]]:
    """The chart's MutatingAdmissionPolicy and its binding, for the namespaces `namespace_selector` picks."""
    data = _in_process()
    name = "vramshare-e2e-hide-gpus"
    asks = f"has(object.metadata.annotations) && '{annotation}' in object.metadata.annotations"
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Ignore",
                "reinvocationPolicy": "IfNeeded",
                "matchConstraints": {"resourceRules": [POD_CREATE]},
                "matchConditions": [
                    {"name": "no-gpu-memory-request", "expression": f"!({asks})"},
                    *data["policy"],
                ],
                "mutations": data["mutations"],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "matchResources": {"namespaceSelector": namespace_selector}},
        },
    ]


CHART_POLICIES = (
    "templates/validating-admission-policy.yaml",
    "templates/hide-gpus-policy.yaml",
)
RELEASE = "vramshare"
CONTROLLER_ACCOUNT = f"{RELEASE}-controller"
"""The controller's ServiceAccount as the chart names it for the release `vramshare`."""
WEBHOOK_ACCOUNT = f"{RELEASE}-webhook"
"""The webhook's ServiceAccount as the chart names it for the release `vramshare`."""


def chart_admission_policies(
    cluster: LocalCluster, *, namespace: str = CONTROLLER_NAMESPACE
) -> list[dict[str, Any]]:
    """The chart's own admission policies (pinning, hiding, in-process hiding), rendered by `helm template`
    as `helm install vramshare -n <namespace>` renders them, so a local cluster is protected as an
    installed one is (issue #42)."""
    argv = [str(cluster.bin_dir / "helm"), "template", RELEASE, str(ROOT / "charts" / "vramshare")]
    argv += ["--namespace", namespace, "--set", "webhook.hideGpus.inProcess=always"]
    for template in CHART_POLICIES:
        argv += ["--show-only", template]
    rendered = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def controller_identity(cluster: LocalCluster, *, namespace: str = CONTROLLER_NAMESPACE) -> Path:
    """A kubeconfig with a token of the controller's ServiceAccount as the chart names it, the identity
    the chart's pinning policy lets place queued pods. Bound to cluster-admin here: the chart's own
    least-privilege roles are tested with the chart (tests/integration/test_chart_install.py)."""
    return service_account_identity(cluster, account=CONTROLLER_ACCOUNT, namespace=namespace)


def service_account_identity(
    cluster: LocalCluster, *, account: str, namespace: str = CONTROLLER_NAMESPACE
) -> Path:
    """A kubeconfig with a bound token of the ServiceAccount `account` (created, and bound to
    cluster-admin), the way a pod of the chart reaches the API server. The admin's kubeconfig presents a
    client certificate instead, which the API server verifies on every request, where it keeps a
    token's check for 10 s: 0.39 against 0.24 ms of its CPU per GET from its cache on this machine
    (2026-12-06). In the admission benchmark, which gives its components tokens since that day, no
    difference showed beyond the spread of its runs."""
    cluster.apply_objects(
        [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": account, "namespace": namespace},
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{account}-local"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
            },
        ]
    )
    return cluster.service_account_kubeconfig(namespace, account)


def seed_inventory(
    cluster: LocalCluster, fleet: Fleet | None = None, *, sampled_at: float | None = None
) -> None:
    """Write one GpuDevice per fake GPU, as the controller would, from the fleet's current figures, and
    advertise each node's GPU memory (the sum of its GPUs') as the controller does."""
    fleet = fleet or cluster.exporter.fleet()
    when = format_time_precise(sampled_at or time.time())
    devices = []
    for node, gpu in fleet.all_gpus():
        devices.append(
            {
                "apiVersion": API_VERSION,
                "kind": "GpuDevice",
                "metadata": {"name": device_name(gpu.uuid)},
                "spec": {"uuid": gpu.uuid, "nodeName": node.name, "index": gpu.index, "model": gpu.model},
            }
        )
    cluster.apply_objects(devices)
    for _, gpu in fleet.all_gpus():
        status = {
            "status": {
                "totalMiB": gpu.total_mib,
                "usedMiB": gpu.used_mib,
                "freeMiB": gpu.free_mib,
                "driverReservedMiB": gpu.driver_reserved_mib,
                "sampledAt": when,
                "state": "Ready",
            }
        }
        cluster.kubectl(
            "patch",
            "gpudevice",
            device_name(gpu.uuid),
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )
    for node in fleet.nodes:
        mib = str(sum(g.total_mib for g in node.gpus))
        capacity = {"status": {"capacity": {MEMORY_RESOURCE: mib}, "allocatable": {MEMORY_RESOURCE: mib}}}
        cluster.kubectl(
            "patch", "node", node.name, "--subresource=status", "--type=merge", "-p", json.dumps(capacity)
        )


def start_controller(
    cluster: LocalCluster, *, name: str, env: Mapping[str, str] | None = None, kubeconfig: Path | None = None
) -> tuple[Component, int]:
    """Start one controller replica reading the cluster's Prometheus; returns it and its metrics port."""
    port = free_port()
    environment = {
        **os.environ,
        "VRAMSHARE_PROMETHEUS_URL": cluster.prometheus_url,
        "VRAMSHARE_METRICS_PORT": str(port),
        "VRAMSHARE_KUBECONFIG": str(kubeconfig or cluster.kubeconfig),
        "VRAMSHARE_NAMESPACE": CONTROLLER_NAMESPACE,
        "VRAMSHARE_IDENTITY": name,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    component = Component(
        name=name,
        argv=[sys.executable, "-m", "vramshare.controller"],
        log_path=cluster.logs_dir / f"{name}.log",
        ready=lambda: http_ok(f"http://127.0.0.1:{port}/metrics"),
        env=environment,
    )
    cluster.add_component(component)
    return component, port


def wait_for_gpu_devices(cluster: LocalCluster) -> None:
    """Until the controller has made a GpuDevice for every GPU of the fake fleet."""
    eventually(
        lambda: (
            len(json.loads(cluster.kubectl("get", "gpudevices", "-o", "json"))["items"])
            == len(cluster.settings.fleet.all_gpus())
        ),
        what="GpuDevices",
    )


def metric(port: int, name: str) -> float | None:
    """The value of an unlabelled series on a component's /metrics (None: absent or unreachable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def bare_booking(
    *, name: str, namespace: str, pod: str, node: str, uuid: str, index: int, mib: int
) -> dict[str, Any]:
    """A GpuReservation as the webhook creates one, for a pod that does not exist (yet)."""
    return {
        "apiVersion": "vramshare.io/v1alpha1",
        "kind": "GpuReservation",
        "metadata": {"name": name, "namespace": namespace, "finalizers": [FINALIZER_POD_GONE]},
        "spec": {"podName": pod, "memoryMiB": mib, "nodeName": node, "gpuUUID": uuid, "gpuIndex": index},
    }


def as_the_api_server(cluster: LocalCluster) -> ssl.SSLContext:
    """A TLS client context that presents the API server's client certificate for webhooks (and does
    not check the webhook's own): for tests that post AdmissionReviews as the API server would."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    pair = cluster.credentials.webhook_client()
    ctx.load_cert_chain(str(pair.cert_path), str(pair.key_path))
    return ctx
