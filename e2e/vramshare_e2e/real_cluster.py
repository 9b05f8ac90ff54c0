"""vramshare installed by its Helm chart on real nodes of the local cluster, as an operator installs it.

Two kubelets with containerd (`vramshare_e2e.node`) beside the kwok nodes, each with a fake H100 in
the exporter's fleet; the image `make image` builds (`vramshare_e2e.image`) imported into their
containerd; `helm install` with only what an operator sets for such nodes (`operator_values`). Used by
tests/integration/test_real_node_e2e.py and `make demo REAL_NODE=1`.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from vramshare_e2e.cluster import ClusterSettings, LocalCluster
from vramshare_e2e.credentials import WEBHOOK_CLIENT
from vramshare_e2e.fleet import FakeGpu, FakeNode, Fleet, default_fleet, stable_gpu_uuid
from vramshare_e2e.image import ProductImage, product_image
from vramshare_e2e.node import RealNode
from vramshare_e2e.node_gpus import DevicePluginSetup
from vramshare_e2e.node_network import node_address
from vramshare_e2e.process import ClusterError, say
from vramshare_e2e.tools import images_cache

CHART = Path(__file__).resolve().parents[2] / "charts" / "vramshare"
RELEASE, NAMESPACE = "vs", "vramshare-system"
UPGRADE_TAG_SUFFIX = "-upgrade"
"""A second tag of the same image on every node: `helm upgrade` to it replaces every pod."""
REAL_NODE_LABEL = "vramshare-e2e/real-node"


def real_node_fleet(names: tuple[str, ...], gpus: Sequence[int] | None = None) -> Fleet:
    """The default kwok fleet plus fake H100 80 GB on the real nodes: `gpus[n]` on the n-th, by default
    one on the first, two on each other (for pods with a GPU set)."""
    real = [
        FakeNode(
            name=name,
            real=True,
            gpus=[
                FakeGpu(
                    uuid=stable_gpu_uuid(name, index),
                    index=index,
                    model="NVIDIA H100 80GB HBM3",
                    total_mib=81_559,
                    driver_reserved_mib=512,
                )
                for index in range(gpus[n] if gpus is not None else 1 if n == 0 else 2)
            ],
        )
        for n, name in enumerate(names)
    ]
    return Fleet(nodes=[*default_fleet().nodes, *real])


RUNTIME_CLASSES = [
    {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name}, "handler": name}
    for name in ("nvidia", "nvidia-hardened")
]
"""nvidia as the GPU Operator creates it: its handler is NVIDIA's runtime on every real node;
nvidia-hardened: the same runtime refusing the variable from unprivileged containers and taking
device-list mounts (Bottlerocket's settings)."""


CLUSTER_POLICY_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterpolicies.nvidia.com"},
    "spec": {
        "group": "nvidia.com",
        "scope": "Cluster",
        "names": {
            "kind": "ClusterPolicy",
            "listKind": "ClusterPolicyList",
            "plural": "clusterpolicies",
            "singular": "clusterpolicy",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                        "properties": {
                            "spec": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                                "properties": {
                                    "cdi": {
                                        "type": "object",
                                        "properties": {
                                            "enabled": {"type": "boolean"},
                                            "default": {"type": "boolean"},
                                            "nriPluginEnabled": {"type": "boolean"},
                                        },
                                    }
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}
"""The GPU Operator's ClusterPolicy API (nvidia.com/v1, cluster-scoped), with the fields of its spec.cdi
that GPU Operator 25.10+ defines (enabled, the deprecated default, nriPluginEnabled) and the rest kept
as is: what the delivery preflight reads on a GPU Operator cluster. Written here (the operator's Go
module is not served), not NVIDIA's file."""


def cluster_policy(*, cdi_enabled: bool, nri_plugin_enabled: bool) -> dict[str, object]:
    """A ClusterPolicy as a GPU Operator 25.10+ install has it (its defaults: CDI on, the NRI plugin off)."""
    return {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy"},
        "spec": {
            "operator": {"defaultRuntime": "containerd", "runtimeClass": "nvidia"},
            "cdi": {"enabled": cdi_enabled, "nriPluginEnabled": nri_plugin_enabled},
        },
    }


def operator_values(cluster: LocalCluster, image: ProductImage) -> list[str]:
    """What an operator sets for nodes like these, and nothing else: the image (imported, so never
    pulled), Prometheus, hostNetwork (pods here reach nothing off their node but loopback), the API
    server's address (no kube-proxy routes the kubernetes Service), a nodeSelector and the CA of the
    API server's client certificate for webhooks."""
    port = cluster.api_url.rsplit(":", 1)[1]
    on_real_nodes = json.dumps({REAL_NODE_LABEL: "true"})
    return [
        *("--set", f"global.image.repository={image.repository}"),
        *("--set", f"global.image.tag={image.tag}"),
        *("--set", "global.image.pullPolicy=Never"),
        *("--set", "global.apiServer.host=127.0.0.1", "--set", f"global.apiServer.port={port}"),
        *("--set", "webhook.hostNetwork=true", "--set", "controller.hostNetwork=true"),
        *("--set-json", f"webhook.nodeSelector={on_real_nodes}"),
        *("--set-json", f"controller.nodeSelector={on_real_nodes}"),
        *("--set", f"controller.settings.prometheus_url={cluster.prometheus_url}"),
        # The API server authenticates to webhooks with a client certificate (vramshare_e2e.credentials),
        # as the README tells operators to configure theirs: the webhook answers only it.
        *("--set-file", f"webhook.clientAuth.caBundle={cluster.ca.cert_path}"),
        *("--set-json", f"webhook.clientAuth.names={json.dumps([WEBHOOK_CLIENT])}"),
    ]


@dataclass
class RealCluster:
    cluster: LocalCluster
    nodes: list[RealNode]
    image: ProductImage
    values: Sequence[str] = ()
    """Chart values beyond `operator_values`."""
    node_ready_s: list[float] = field(default_factory=list)
    install_s: float = 0.0

    def helm(self, *args: str, timeout_s: float = 600) -> str:
        result = subprocess.run(
            [str(self.cluster.bin_dir / "helm"), "--kubeconfig", str(self.cluster.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if result.returncode != 0:
            raise ClusterError(f"helm {args[0]} failed: {result.stderr.strip()}\n{self.pods_report()}")
        return result.stdout

    def pods_report(self) -> str:
        return self.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False)

    def install(self) -> float:
        """`helm install --wait`; the seconds it took."""
        started = time.monotonic()
        self.helm(
            "install",
            RELEASE,
            str(CHART),
            "-n",
            NAMESPACE,
            "--create-namespace",
            "--wait",
            "--timeout=300s",
            *operator_values(self.cluster, self.image),
            *self.values,
        )
        self.install_s = time.monotonic() - started
        return self.install_s


@contextmanager
def real_cluster(
    *,
    nodes: int = 2,
    managed: tuple[str, ...] = (),
    labels: Mapping[str, Mapping[str, str]] | None = None,
    gpus: Sequence[int] | None = None,
    device_plugins: Mapping[int, DevicePluginSetup] | None = None,
    values: Sequence[str] = (),
    first_node: int = 2,
) -> Iterator[RealCluster]:
    """A local cluster with `nodes` real nodes (198.18.0.`first_node` and up) and vramshare installed by
    its chart (with `values`); `gpus[n]` fake GPUs on the n-th node; NVIDIA's device plugin on the nodes
    `device_plugins` numbers (test modules that may run at once take different node numbers: a node's
    address, cgroups and mount namespace are its number's); `managed` namespaces are created labelled
    vramshare.io/managed=true, and with `labels[namespace]`.
    The labels are there from creation: one added afterwards reaches the API server's and the webhook's
    namespace caches a moment later, and a pod created in that moment misses them."""
    image = product_image(images_cache())
    numbers = range(first_node, first_node + nodes)
    names = tuple(node_address(n) for n in numbers)
    plugins = device_plugins or {}
    with LocalCluster.start(settings=ClusterSettings(fleet=real_node_fleet(names, gpus))) as local:
        real = RealCluster(
            cluster=local,
            nodes=[RealNode.create(local, n, device_plugin=plugins.get(n)) for n in numbers],
            image=image,
            values=values,
        )
        for node in real.nodes:
            real.node_ready_s.append(node.start(images=[image.archive]))
            node.tag_image(image.reference, image.reference + UPGRADE_TAG_SUFFIX)
        say(f"real nodes {', '.join(names)} Ready in {', '.join(f'{s:.1f} s' for s in real.node_ready_s)}")
        local.apply_objects(RUNTIME_CLASSES)
        if managed:
            local.apply_objects(
                [
                    {
                        "apiVersion": "v1",
                        "kind": "Namespace",
                        "metadata": {
                            "name": ns,
                            "labels": {"vramshare.io/managed": "true", **(labels or {}).get(ns, {})},
                        },
                    }
                    for ns in managed
                ]
            )
        say("helm install from charts/vramshare (the webhook and controller as pods on the real nodes)")
        real.install()
        say(f"helm install --wait: {real.install_s:.1f} s")
        yield real
