"""What the admission benchmark measures of the running stack: latencies and their percentiles, pod
creation under concurrency, the webhook's own metrics, API requests, CPU seconds and memory per
component, and ratios against a baseline."""

from __future__ import annotations

import os
import re
import ssl
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client

from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.floor_webhook import floor_components

FLOOR_WEBHOOKS = floor_components("one-write")
"""The one-write floor's two replicas."""
PINNED_WEBHOOKS = floor_components("pinned")
"""The pinned floor's."""


CPU_OF = (
    "kube-apiserver",
    "etcd",
    "kube-scheduler",
    "webhook-a",
    "webhook-b",
    "controller",
    "kwok",
    *FLOOR_WEBHOOKS,
    *PINNED_WEBHOOKS,
)


def is_workload(component: str) -> bool:
    """Whether `component` runs as a workload of the cluster (a pod on a node): vramshare's webhooks and
    controller, and the benchmark's own webhooks; the rest (the control plane, kwok's kubelets,
    the exporter and Prometheus) is the cluster itself."""
    return component == "controller" or component.startswith(("webhook-", "e2e-"))


def split_cores(components: list[str], cpus: list[int]) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...]]:
    """The CPUs each component may use when the cluster and its workloads get separate halves of the
    machine (`--split-cores`), as in a cluster where the webhooks and the controller run as pods on
    nodes, not on the control plane's CPUs; and the load generator's CPUs (the workloads' half: the
    clients are elsewhere too). The cluster gets the first half, rounded down."""
    if len(cpus) < 2:
        raise ValueError(f"--split-cores needs at least 2 CPUs; this process may use {len(cpus)} ({cpus})")
    ordered = sorted(cpus)
    cluster, workloads = tuple(ordered[: len(ordered) // 2]), tuple(ordered[len(ordered) // 2 :])
    return {name: workloads if is_workload(name) else cluster for name in components}, workloads


def pin(pid: int, cpus: tuple[int, ...]) -> None:
    """Confine every thread of process `pid` and of its descendants to `cpus` (a component may run
    under a wrapper; threads and processes started later inherit it)."""
    for process in (pid, *_descendants(pid)):
        try:
            for task in os.listdir(f"/proc/{process}/task"):
                os.sched_setaffinity(int(task), cpus)
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])  # the field after the state
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency_stats(latencies: list[float], wall_s: float) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 2),
        "p95_ms": round(percentile(latencies, 0.95) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "pods_per_s": round(len(latencies) / wall_s, 1),
    }


def create_pods(
    core: Any, namespaces: list[str], pods: int, concurrency: int, annotated: bool, tag: str
) -> tuple[list[float], float, int]:
    def one(i: int) -> tuple[float, bool]:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{tag}-{i}", "annotations": {"gpu-mem-mb": "10"} if annotated else {}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "base", "image": "example.invalid/x"}],
            },
        }
        started = time.perf_counter()
        try:
            core.create_namespaced_pod(namespaces[i % len(namespaces)], body)
            ok = True
        except client.exceptions.ApiException:
            ok = False
        return time.perf_counter() - started, ok

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, range(pods)))
    wall = time.perf_counter() - started
    return [r[0] for r in results], wall, sum(1 for r in results if not r[1])


def webhook_metrics(ports: list[int]) -> dict[str, float]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    totals: dict[str, float] = {}
    for port in ports:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                m = re.match(r"^(vramshare_webhook_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
                if m:
                    totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
    return totals


def api_requests(cluster: LocalCluster) -> dict[str, float]:
    """The API server's own count of the requests it served, `<resource>/<verb>` (watches left out:
    they are streams, not work per pod), from its /metrics."""
    totals: dict[str, float] = {}
    for line in cluster.kubectl("get", "--raw", "/metrics").splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
        if labels.get("verb") == "WATCH":
            continue
        key = f"{labels.get('resource', '')}/{labels.get('verb', '').lower()}"
        totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy so far (every process: the cluster's components,
    the scheduler, the benchmark's own client), from /proc/stat."""
    fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is counted in user already


def cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds (user + system) each component has used so far, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name in CPU_OF:
        component = cluster.find_component(name)
        process = getattr(component, "process", None)
        if process is None:
            continue
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def decision_quantiles(
    before: dict[str, float], after: dict[str, float], metric: str = "decision"
) -> dict[str, float]:
    buckets = sorted(
        (float(m.group(1)), after[k] - before.get(k, 0.0))
        for k in after
        if (m := re.match(rf'vramshare_webhook_{metric}_seconds_bucket\{{le="([^"]+)"\}}', k))
    )
    total = buckets[-1][1] if buckets else 0

    def q(x: float) -> float:
        return next((b for b, n in buckets if n >= x * total), float("inf")) * 1000

    count = after.get(f"vramshare_webhook_{metric}_seconds_count", 0) - before.get(
        f"vramshare_webhook_{metric}_seconds_count", 0
    )
    mean = (
        (
            after.get(f"vramshare_webhook_{metric}_seconds_sum", 0)
            - before.get(f"vramshare_webhook_{metric}_seconds_sum", 0)
        )
        / count
        * 1000
        if count
        else 0.0
    )
    return {"p50_ms_at_most": q(0.5), "p99_ms_at_most": q(0.99), "mean_ms": round(mean, 3)}


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def ratios(row: dict[str, float], against: dict[str, float]) -> dict[str, float]:
    return {
        "ratio_p50": round(row["p50_ms"] / against["p50_ms"], 2),
        "ratio_p99": round(row["p99_ms"] / against["p99_ms"], 2),
        "throughput_ratio": round(row["pods_per_s"] / against["pods_per_s"], 2),
    }


def writes_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in after.items():
        m = re.match(r'vramshare_webhook_api_writes_total\{resource="([^"]+)",verb="([^"]+)"\}', key)
        if m:
            out[f"{m.group(1)}/{m.group(2)}"] = value - before.get(key, 0.0)
    return out


SETTLE_S = 3.0


def clean_namespaces(cluster: LocalCluster, namespaces: list[str]) -> None:
    """Delete every pod and booking, and wait until the controller has let the bookings go (each waits
    for its pod to be gone: vramshare's finalizer), so the next round starts on an empty ledger."""
    for ns in namespaces:
        cluster.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false", "--grace-period=0", "--force")
        cluster.kubectl("delete", "gpureservations", "--all", "-n", ns, "--wait=false")
    cluster.wait_for(
        lambda: not cluster.kubectl("get", "gpureservations", "-A", "-o", "name").split(),
        what="every booking gone",
        timeout_s=120,
    )
