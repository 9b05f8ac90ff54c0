"""A real Kueue on the local control plane: its manager (sigs.k8s.io/kueue, built from its Go module by
e2e/tools/build.sh), its CRDs, and its pod webhooks registered by URL over TLS with the harness's CA,
as Kueue's own manifests declare them (only the clientConfig and the namespace selector differ). Kueue's
pod integration then gates pods labelled kueue.x-k8s.io/queue-name and lifts the gate when it admits
their workload within a ClusterQueue's quota."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import ClusterError, Component, eventually, http_ok

API = "kueue.x-k8s.io/v1beta2"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
SELECTOR_LABEL = "vramshare-e2e/kueue"
"""Namespaces with this label set to "on" are Kueue's (its pod webhook sees their pods)."""


def start_kueue(cluster: LocalCluster) -> Component:
    """Install Kueue's CRDs, start its manager (pod integration only) and register its pod webhooks."""
    manifests = cluster.bin_dir / "kueue-config"
    cluster.kubectl("apply", "--server-side", "-f", str(manifests / "crd"))
    for crd in ("clusterqueues", "localqueues", "resourceflavors", "workloads"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.kueue.x-k8s.io", "--timeout=60s")
    cluster.kubectl("create", "namespace", "kueue-system")
    pair = cluster.ca.issue(
        "kueue-webhook", common_name="kueue-webhook", server_ips=("127.0.0.1",), server_names=("localhost",)
    )
    certs = cluster.workdir / "kueue-certs"
    certs.mkdir(exist_ok=True)
    shutil.copy(pair.cert_path, certs / "tls.crt")
    shutil.copy(pair.key_path, certs / "tls.key")
    # With its own certificate management off, Kueue's manager reads its metrics server's certificate
    # from a fixed path (cmd/kueue/main.go: /etc/kueue/metrics/certs): it is put there for the run and
    # taken away after it.
    if METRICS_CERTS.exists():
        raise ClusterError(f"{METRICS_CERTS} exists already (another Kueue on this machine?): not touched")
    METRICS_CERTS.mkdir(parents=True)
    cluster.on_cleanup(lambda: shutil.rmtree(METRICS_CERTS.parent.parent, ignore_errors=True))
    shutil.copy(pair.cert_path, METRICS_CERTS / "tls.crt")
    shutil.copy(pair.key_path, METRICS_CERTS / "tls.key")
    webhook, health, metrics = free_port(), free_port(), free_port()
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
        "webhook": {"port": webhook, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["pod"]},
        "managedJobsNamespaceSelector": {"matchLabels": {SELECTOR_LABEL: "on"}},
    }
    config_path = cluster.workdir / "kueue-config.yaml"
    config_path.write_text(json.dumps(config))
    component = Component(
        name="kueue",
        argv=[
            str(cluster.bin_dir / "kueue"),
            f"--config={config_path}",
            f"--kubeconfig={cluster.kubeconfig}",
            "--zap-log-level=2",
            # Its on-demand visibility API server reads its certificate from /visibility: not needed.
            "--feature-gates=VisibilityOnDemand=false",
        ],
        log_path=cluster.logs_dir / "kueue.log",
        ready=lambda: http_ok(f"http://127.0.0.1:{health}/readyz"),
    )
    cluster.add_component(component)
    cluster.apply_objects(_pod_webhooks(cluster, manifests.joinpath("webhooks.yaml").read_text(), webhook))
    return component


def _pod_webhooks(cluster: LocalCluster, manifests: str, port: int) -> list[dict[str, Any]]:
    """Kueue's own pod webhooks (mutating and validating), reached by URL on `port`."""
    ca = base64.b64encode(cluster.ca.cert_pem).decode()
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc or doc.get("kind") not in (
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ):
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if not path.endswith("--v1-pod"):
                continue
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
            hook["namespaceSelector"] = {"matchLabels": {SELECTOR_LABEL: "on"}}
            hooks.append(hook)
        kind = doc["kind"]
        # Named so Kueue's mutating webhook comes before vramshare's (the API server orders by name).
        name = "kueue-e2e-mutating" if kind.startswith("Mutating") else "kueue-e2e-validating"
        out.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": name},
                "webhooks": hooks,
            }
        )
    return out


def gpu_memory_queue(cluster: LocalCluster, *, namespace: str, resource: str, quota_mib: int) -> None:
    """A ResourceFlavor, a ClusterQueue whose quota covers `resource` (MiB), and a LocalQueue named
    "gpu" in `namespace`."""
    cluster.apply_objects(
        [
            {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": "default-flavor"}, "spec": {}},
            {
                "apiVersion": API,
                "kind": "ClusterQueue",
                "metadata": {"name": "gpu-memory"},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": [resource],
                            "flavors": [
                                {
                                    "name": "default-flavor",
                                    "resources": [{"name": resource, "nominalQuota": str(quota_mib)}],
                                }
                            ],
                        }
                    ],
                },
            },
            {
                "apiVersion": API,
                "kind": "LocalQueue",
                "metadata": {"name": "gpu", "namespace": namespace},
                "spec": {"clusterQueue": "gpu-memory"},
            },
        ]
    )
    eventually(
        lambda: (
            "True"
            in cluster.kubectl(
                "get",
                "clusterqueue",
                "gpu-memory",
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Active')].status}",
            )
        ),
        what="the ClusterQueue active",
        timeout_s=60,
    )
