"""Two webhook replicas on one local control plane, dealing tied GPUs between them: shared by the deal and
the endpoints tests."""

from __future__ import annotations

import json
import re
import ssl
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kubernetes import client, config

from vramshare.domain.allocation import _rank
from vramshare.kube.resources import ANNOTATION_GPU_UUID
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import start_controller, start_webhook, webhook_configuration
from vramshare_e2e.process import eventually


def agreeing_identities(gpus: list[str]) -> dict[str, str]:
    """Names for replicas a and b whose own hashed orders rank the same of `gpus` first: without the
    deal both would take that GPU and race."""
    first = {f"webhook-{n}": min(gpus, key=lambda g, n=n: _rank(f"webhook-{n}", g)) for n in range(64)}
    a = "webhook-0"
    b = next(name for name, gpu in first.items() if name != a and gpu == first[a])
    return {"a": a, "b": b}


def start_two_replicas(local: LocalCluster, *, names: dict[str, str], env: dict[str, str]) -> dict[str, int]:
    """Webhook replicas a and b named `names` (each serving namespace jobs-a or jobs-b), a controller,
    and its GPU inventory in place; the replicas' ports."""
    ports = {
        s: start_webhook(local, name=f"webhook-{s}", env={**env, "VRAMSHARE_IDENTITY": names[s]})[1]
        for s in ("a", "b")
    }
    local.apply_objects([webhook_configuration(local, ports=ports)])
    for s in ports:
        local.create_namespace(f"jobs-{s}", {"vramshare-e2e/shard": s})
    start_controller(local, name="controller")
    eventually(
        lambda: (
            len(json.loads(local.kubectl("get", "gpudevices", "-o", "json"))["items"])
            == len(local.settings.fleet.all_gpus())
        ),
        what="the GPU inventory",
        timeout_s=30,
    )
    return ports


def metric(port: int, name: str) -> float:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx, timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{name}(?:\{{\}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def admit_40_pods_onto_two_tied_a100s(local: LocalCluster, ports: dict[str, int]) -> None:
    """40 pods created at once, alternately through replicas a and b (their namespaces' shards): each
    replica takes its own A100, and no commit loses a race to the other."""
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(local.kubeconfig)))
    before = {p: metric(p, "vramshare_webhook_commit_rebases_total") for p in ports.values()}
    conflicts = {p: metric(p, "vramshare_webhook_commit_conflicts_total") for p in ports.values()}

    def create(i: int) -> tuple[str, str]:
        shard = "ab"[i % 2]
        pod = core.create_namespaced_pod(
            f"jobs-{shard}",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"deal-{i}", "annotations": {"gpu-mem-mb": "10"}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "example.invalid/x"}],
                },
            },
        )
        return shard, pod.metadata.annotations[ANNOTATION_GPU_UUID]

    with ThreadPoolExecutor(max_workers=8) as pool:
        placed = list(pool.map(create, range(40)))
    # The two A100s tie (40 GiB each, idle; 10 MiB pods keep them within near_tie_mib), the T4s are far
    # behind. The replicas' own hashed orders agree on which A100 comes first (`agreeing_identities`),
    # so only the deal sends each replica to its own A100; then no commit loses a race to the other.
    by_shard = {s: Counter(g for shard, g in placed if shard == s) for s in ports}
    assert all(len(c) == 1 for c in by_shard.values()), by_shard
    assert set(by_shard["a"]) != set(by_shard["b"]), by_shard
    for p in ports.values():
        assert metric(p, "vramshare_webhook_commit_rebases_total") == before[p]
        assert metric(p, "vramshare_webhook_commit_conflicts_total") == conflicts[p]
