"""`make bench-admission`: what vramshare adds to pod creation, against a no-webhook baseline measured
in the same run on the same API server, and how the pure decision grows with the fleet and the ledger.

1. At each concurrency level (1, 4, 16, 64), create pods four times: plain pods in a namespace no
   webhook sees (the baseline), pods through a null TLS webhook that allows at once (the cost of a
   webhook call itself), pods through two `one-write` webhooks that each make one durable write per
   pod, of a copy of the GpuReservation kind, and watch them all (the floor of any design that books
   in the API server: `vramshare_e2e.admission_parts`), and annotated pods through two vramshare
   replicas (reservations committed). Report p50/p95/p99 create latency and throughput for each,
   vramshare's ratios against the baseline, the null webhook and the floor, the webhooks' own decision
   latency, conflict retries, consistent reads, API writes per admission, and peak resident memory.
2. Fill the ledger to 10 000 and then 100 000 active reservations and measure pod creation against
   plain pods, the decision, and the webhook's resident memory.
3. Time `choose()` with headroom as GPUs (8 ... 4096) and active reservations (100 ... 100 000) grow.

    python -m vramshare_e2e.bench_admission [--smoke] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl
import statistics
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.utils import parse_quantity

from vramshare.domain import (
    AllocationRequest,
    Gpu,
    LedgerIndex,
    Reservation,
    ReservationPhase,
    choose,
)
from vramshare_e2e.admission_parts import FLOOR_PLURAL, start_mutating_webhook, start_one_write_webhooks
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import hide_gpus_policy, start_controller, start_webhook, webhook_configuration
from vramshare_webhook.settings import WebhookSettings

NOW = 1_800_000_000.0


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


SETTLE_S = 3.0
# The one-write floor's two replicas, as start_one_write_webhooks names them.
FLOOR_WEBHOOKS = ("e2e-one-write-0", "e2e-one-write-1")
CPU_OF = ("kube-apiserver", "etcd", "webhook-a", "webhook-b", "controller", "kwok", *FLOOR_WEBHOOKS)


def cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds (user + system) each component has used so far, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name in CPU_OF:
        component = cluster.components.get(name)
        process = getattr(component, "process", None)
        if process is None:
            continue
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


class _Phase:
    """What the cluster spent on one phase of pods: API requests and CPU, per pod."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.requests = api_requests(cluster)
        self.cpu = cpu_seconds(cluster)

    def per_pod(self, pods: int) -> dict[str, Any]:
        requests, cpu = api_requests(self.cluster), cpu_seconds(self.cluster)
        made = {k: v - self.requests.get(k, 0.0) for k, v in requests.items()}
        return {
            "api_requests": {k: round(v / pods, 2) for k, v in sorted(made.items()) if v >= pods / 20},
            "api_requests_total": round(sum(made.values()) / pods, 2),
            "cpu_ms": {k: round((v - self.cpu.get(k, 0.0)) * 1000 / pods, 2) for k, v in cpu.items()},
        }


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


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _clean(cluster: LocalCluster, namespaces: list[str]) -> None:
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


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _ratios(row: dict[str, float], against: dict[str, float]) -> dict[str, float]:
    return {
        "ratio_p50": round(row["p50_ms"] / against["p50_ms"], 2),
        "ratio_p99": round(row["p99_ms"] / against["p99_ms"], 2),
        "throughput_ratio": round(row["pods_per_s"] / against["pods_per_s"], 2),
    }


FLOOR_SPACES = ["floor-a", "floor-b"]
"""The one-write floor's namespaces, one per replica (as vramshare's gpu-a and gpu-b)."""

PODS_PER_NODE = 2000
"""Room on each of the two nodes for a level's four phases (4 x 244 pods) and a round of the no-GPU
cases (4 x 496) at once."""


def _room_for_every_phase(cluster: LocalCluster, *, pods: int) -> None:
    """Let the nodes hold every pod of a level (its four phases and their warm-up) and of a no-GPU
    round, so that each phase's pods are scheduled and run. With the test cluster's 250 pods per node,
    the two nodes were full after the plain and null phases, and the later phases' pods stayed
    Pending, unschedulable (until 2026-12-05: vramshare's phase paid a failed scheduling attempt where
    the plain one paid a binding and kwok's status, and was not like for like with it)."""
    per_node = str(pods)
    for node in cluster.kubectl("get", "nodes", "-o", "name").split():
        room = {"capacity": {"pods": per_node}, "allocatable": {"pods": per_node}}
        cluster.kubectl(
            "patch", node, "--subresource=status", "--type=merge", "-p", json.dumps({"status": room})
        )
    cluster.wait_for(  # as a quantity: the API server writes 2000 as "2k"
        lambda: all(
            parse_quantity(n["status"]["allocatable"]["pods"]) == pods  # type: ignore[no-untyped-call]
            for n in json.loads(cluster.kubectl("get", "nodes", "-o", "json"))["items"]
        ),
        what=f"room for {per_node} pods on every node",
        timeout_s=30,
    )


def _writes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in after.items():
        m = re.match(r'vramshare_webhook_api_writes_total\{resource="([^"]+)",verb="([^"]+)"\}', key)
        if m:
            out[f"{m.group(1)}/{m.group(2)}"] = value - before.get(key, 0.0)
    return out


def admission(
    *, smoke: bool, show: Callable[[str], None], scale: bool = True, levels: list[int] | None = None
) -> dict[str, Any]:
    levels = levels or ([1, 4] if smoke else [1, 4, 16, 64])
    pods = 12 if smoke else 240
    result: dict[str, Any] = {"pods_per_level": pods, "levels": {}}
    with LocalCluster.start() as cluster:
        # The scale section stops the controller (it would expire the pod-less fillers), so samples
        # must stay usable without it for the length of the run.
        env = {
            "VRAMSHARE_LOG_LEVEL": "warning",
            "VRAMSHARE_SAFETY_MARGIN_MIB": "0",
            "VRAMSHARE_MAX_SAMPLE_AGE_S": "86400",
        }
        ports = [start_webhook(cluster, name=f"webhook-{s}", env=env)[1] for s in ("a", "b")]
        registration = webhook_configuration(cluster, ports={"a": ports[0], "b": ports[1]}, as_the_chart=True)
        cluster.apply_objects([registration])
        start_mutating_webhook(cluster, mode="null")
        start_one_write_webhooks(cluster)
        start_controller(
            cluster,
            name="controller",
            env={"VRAMSHARE_LOG_LEVEL": "warning", "VRAMSHARE_POLL_INTERVAL_S": "2"},
        )
        for ns, labels in (
            ("plain", {}),
            ("null", {"e2e.vramshare.io/null": "on"}),
            ("floor-a", {"e2e.vramshare.io/one-write": "0"}),
            ("floor-b", {"e2e.vramshare.io/one-write": "1"}),
            ("gpu-a", {"vramshare-e2e/shard": "a"}),
            ("gpu-b", {"vramshare-e2e/shard": "b"}),
        ):
            cluster.apply_objects(
                [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}]
            )
        cluster.wait_for(
            lambda: len(cluster.kubectl("get", "gpudevices", "-o", "name").split()) == 5,
            what="the inventory",
            timeout_s=30,
        )
        _room_for_every_phase(cluster, pods=PODS_PER_NODE)
        # One connection per client thread: with the client's default pool of 10, the threads past 10
        # opened a fresh TLS connection per pod, a cost of the benchmark's own, not of admission.
        client_config = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=client_config)  # type: ignore[no-untyped-call]
        client_config.connection_pool_maxsize = max(levels)
        core = client.CoreV1Api(client.ApiClient(client_config))
        spaces = ["plain", "null", *FLOOR_SPACES, "gpu-a", "gpu-b"]
        # Warm up every path (connections, caches).
        create_pods(core, ["plain"], 4, 2, False, "warm")
        create_pods(core, ["null"], 4, 2, False, "warm")
        create_pods(core, FLOOR_SPACES, 4, 2, False, "warm")
        create_pods(core, ["gpu-a", "gpu-b"], 4, 2, True, "warm")
        _clean(cluster, spaces)
        for level in levels:
            show(
                f"concurrency {level}: {pods} plain pods, {pods} through a null webhook, {pods} through "
                f"one-write webhooks (the floor), {pods} GPU pods"
            )
            phase = _Phase(cluster)
            base_lat, base_wall, base_err = create_pods(core, ["plain"], pods, level, False, f"b{level}")
            # What follows each pod's creation (scheduling, kwok's status, vramshare's controller binding
            # the booking) is counted too: each phase's count waits for it to land.
            time.sleep(SETTLE_S)
            cost = {"baseline": phase.per_pod(pods)}
            phase = _Phase(cluster)
            null_lat, null_wall, null_err = create_pods(core, ["null"], pods, level, False, f"n{level}")
            time.sleep(SETTLE_S)
            cost["null_webhook"] = phase.per_pod(pods)
            phase = _Phase(cluster)
            floor_lat, floor_wall, floor_err = create_pods(
                core, FLOOR_SPACES, pods, level, False, f"f{level}"
            )
            time.sleep(SETTLE_S)
            cost["one_write_floor"] = phase.per_pod(pods)
            before = webhook_metrics(ports)
            phase = _Phase(cluster)
            vs_lat, vs_wall, vs_err = create_pods(core, ["gpu-a", "gpu-b"], pods, level, True, f"v{level}")
            time.sleep(SETTLE_S)
            cost["vramshare"] = phase.per_pod(pods)
            after = webhook_metrics(ports)
            base, null, floor, vs = (
                latency_stats(base_lat, base_wall),
                latency_stats(null_lat, null_wall),
                latency_stats(floor_lat, floor_wall),
                latency_stats(vs_lat, vs_wall),
            )
            admitted = pods - vs_err
            writes = _writes(before, after)
            result["levels"][str(level)] = {
                "baseline": base,
                "null_webhook": null,
                "one_write_floor": floor,
                "vramshare": vs,
                **_ratios(vs, base),
                "against_null_webhook": _ratios(vs, null),
                "floor_vs_baseline": _ratios(floor, base),
                "against_floor": _ratios(vs, floor),
                "errors": {
                    "baseline": base_err,
                    "null_webhook": null_err,
                    "one_write_floor": floor_err,
                    "vramshare": vs_err,
                },
                "webhook_decision": decision_quantiles(before, after),
                "webhook_choose": decision_quantiles(before, after, "choose"),
                "webhook_commit": decision_quantiles(before, after, "commit"),
                "conflicts_retried": after.get("vramshare_webhook_commit_conflicts_total", 0)
                - before.get("vramshare_webhook_commit_conflicts_total", 0),
                "commits_rebased": after.get("vramshare_webhook_commit_rebases_total", 0)
                - before.get("vramshare_webhook_commit_rebases_total", 0),
                "consistent_reads": after.get("vramshare_webhook_consistent_reads_total", 0)
                - before.get("vramshare_webhook_consistent_reads_total", 0),
                "api_writes": writes,
                "api_writes_per_admission": round(sum(writes.values()) / admitted, 2) if admitted else None,
                "cost_per_pod": cost,
            }
            _clean(cluster, spaces)
            cluster.kubectl("delete", FLOOR_PLURAL, "--all", "-A", "--wait=false")
            time.sleep(2)
        result["no_gpu"] = _no_gpu(
            cluster,
            core,
            registration,
            webhook_configuration(
                cluster, ports={"a": ports[0], "b": ports[1]}, as_the_chart=True, hide_in_process=True
            ),
            pods=pods * 2,
            concurrency=levels[-1],
            rounds=2 if smoke else NO_GPU_ROUNDS,
            show=show,
        )
        _clean(cluster, spaces)
        result["peak_rss_mib"] = {
            name: _peak_rss_mib(cluster.components[name].process.pid)  # type: ignore[union-attr]
            for name in ("webhook-a", "webhook-b", "controller")
        }
        result["scale"] = []
        if not scale:
            return result
        made = 0
        # The fillers are pod-less Reserved bookings: the controller runs on with a TTL they outlive,
        # so its memory with the whole ledger in its caches is measured too.
        cluster.stop_component("controller")
        controller = cluster.components["controller"]
        controller.env = {**(controller.env or {}), "VRAMSHARE_RESERVATION_TTL_S": "86400"}
        cluster.start_component("controller")
        for count in [200, 500] if smoke else [10_000, 100_000]:
            result["scale"].append(_at_scale(cluster, core, ports, have=made, count=count, show=show))
            made = count
    return result


WARM_UP = 16
"""Pods created untimed before each case of `_no_gpu`."""
NO_GPU_ROUNDS = 4
"""Rounds of `_no_gpu`: each case runs once in each of the four positions."""
CLEANUP_SETTLE_S = 10.0
"""After a round's pods are gone, before the next round: deleting some 2000 pods keeps the API server
and kwok busy for a while after the last is gone."""


def _no_gpu(
    cluster: LocalCluster,
    core: Any,
    configuration: dict[str, Any],
    in_process_configuration: dict[str, Any],
    *,
    pods: int,
    concurrency: int,
    rounds: int,
    show: Callable[[str], None],
) -> dict[str, Any]:
    """Pods that ask for no GPU memory, at `concurrency`: with no vramshare webhook registered at all
    (the baseline), in a namespace vramshare does not manage, in ones where the webhook hides GPUs from
    them (the chart's second webhook entry answers each), and in ones where the API server hides them
    itself (the chart's MutatingAdmissionPolicy, Kubernetes 1.36+: `in_process_configuration` leaves
    such pods to it). The cases run in `rounds` rounds (`NO_GPU_ROUNDS`), each in another rotation of
    their order, so that every case runs once in every position; each case keeps its best run, so a slow
    moment of this machine is not blamed on one case. Each case starts `SETTLE_S` after the last one,
    each round `CLEANUP_SETTLE_S` after the pods of the round before are gone. (Always first, right
    after the cleanup of the round before, the baseline ran slowest: the unmanaged case, which has no
    work it lacks, measured 0.64-0.78x of it on 2026-12-04, and every ratio against it looked better
    than it was. With two rounds in reverse orders, the same case still differed by 1.5x between
    positions.)"""
    show(
        f"pods asking no GPU, concurrency {concurrency}: no webhook, unmanaged namespace, GPUs hidden by the "
        "webhook, GPUs hidden in the API server"
    )
    policy = hide_gpus_policy(
        namespace_selector={
            "matchExpressions": [{"key": "vramshare-e2e/shard", "operator": "In", "values": ["a", "b"]}]
        }
    )
    runs: dict[str, list[dict[str, float]]] = {
        "no_webhook": [],
        "unmanaged": [],
        "hidden": [],
        "hidden_in_process": [],
    }

    def timed(namespaces: list[str], tag: str) -> tuple[list[float], float, int]:
        # A few untimed first: the API server compiles a new policy's CEL, and opens connections to a
        # new webhook, on first use; every case gets the same start.
        create_pods(core, namespaces, WARM_UP, min(WARM_UP, concurrency), False, f"{tag}-warm")
        return create_pods(core, namespaces, pods, concurrency, False, tag)

    def hidden(case: str, attempt: int) -> None:
        tag = f"ng-{case.replace('_', '-')}{attempt}"
        lat, wall, errors = timed(["gpu-a", "gpu-b"], tag)
        if errors:
            raise RuntimeError(f"{errors} pods without a GPU request were refused in managed namespaces")
        # What was timed really hid the GPUs (a policy that matched nothing would time no work).
        made = [p for p in core.list_namespaced_pod("gpu-a").items if p.metadata.name.startswith(tag)]
        shown = [p.metadata.name for p in made if _visible_devices(p) != ["void"]]
        if not made or shown:
            raise RuntimeError(f"{case}: pods not hidden: {shown[:5] or 'none made'}")
        runs[case].append(latency_stats(lat, wall))

    def no_webhook(attempt: int) -> None:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", configuration["metadata"]["name"])
        time.sleep(2)  # the API server drops the webhook from its view
        lat, wall, _ = timed(["plain"], f"ng-base{attempt}")
        runs["no_webhook"].append(latency_stats(lat, wall))
        cluster.apply_objects([configuration])
        time.sleep(2)

    def unmanaged(attempt: int) -> None:
        lat, wall, _ = timed(["plain"], f"ng-plain{attempt}")
        runs["unmanaged"].append(latency_stats(lat, wall))

    def in_process(attempt: int) -> None:
        cluster.apply_objects([in_process_configuration, *policy])
        time.sleep(2)
        hidden("hidden_in_process", attempt)
        for obj in policy:
            cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"])
        cluster.apply_objects([configuration])
        time.sleep(2)

    cases: list[Callable[[int], None]] = [
        no_webhook,
        unmanaged,
        lambda attempt: hidden("hidden", attempt),
        in_process,
    ]
    spaces = ["plain", "gpu-a", "gpu-b"]
    for attempt in range(rounds):
        for case in cases[attempt % len(cases) :] + cases[: attempt % len(cases)]:
            time.sleep(SETTLE_S)  # the case before has settled (kwok's statuses, events)
            case(attempt)
        _clean(cluster, spaces)
        cluster.wait_for(
            lambda: not any(cluster.kubectl("get", "pods", "-n", n, "-o", "name").split() for n in spaces),
            what="the round's pods gone",
            timeout_s=120,
        )
        time.sleep(CLEANUP_SETTLE_S)
    best = {case: min(results, key=lambda r: r["p50_ms"]) for case, results in runs.items()}
    return {
        "concurrency": concurrency,
        "pods": pods,
        "rounds": rounds,
        **best,
        "unmanaged_vs_no_webhook": _ratios(best["unmanaged"], best["no_webhook"]),
        "hidden_vs_no_webhook": _ratios(best["hidden"], best["no_webhook"]),
        "hidden_in_process_vs_no_webhook": _ratios(best["hidden_in_process"], best["no_webhook"]),
        "runs": runs,
    }


def _visible_devices(pod: Any) -> list[str]:
    return [e.value for c in pod.spec.containers for e in c.env or [] if e.name == "NVIDIA_VISIBLE_DEVICES"]


def _at_scale(
    cluster: LocalCluster, core: Any, ports: list[int], *, have: int, count: int, show: Callable[[str], None]
) -> dict[str, Any]:
    """Pod creation and the webhook's decision with `count` active reservations in the ledger."""
    show(f"filling the ledger to {count} active reservations")
    gpus = [d["spec"] for d in json.loads(cluster.kubectl("get", "gpudevices", "-o", "json"))["items"]]
    custom = client.CustomObjectsApi(core.api_client)

    def one(i: int) -> None:
        gpu = gpus[i % len(gpus)]
        custom.create_namespaced_custom_object(
            "vramshare.io",
            "v1alpha1",
            "plain",
            "gpureservations",
            {
                "apiVersion": "vramshare.io/v1alpha1",
                "kind": "GpuReservation",
                "metadata": {
                    "name": f"filler-{i}",
                    "labels": {"vramshare.io/committed": "true", "vramshare.io/active": "true"},
                },
                "spec": {
                    "podName": f"filler-{i}",
                    "memoryMiB": 1,
                    "nodeName": gpu["nodeName"],
                    "gpuUUID": gpu["uuid"],
                    "gpuIndex": gpu["index"],
                },
            },
        )

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=24) as pool:
        for done, _ in enumerate(pool.map(one, range(have, count)), start=have + 1):
            if done % 10_000 == 0:
                show(f"  {done} reservations")
    show(f"  created in {time.perf_counter() - started:.0f} s")
    time.sleep(1 if count < 5_000 else 5)  # let the webhooks' and the controller's watches take them in
    base_lat, base_wall, _ = create_pods(core, ["plain"], 40, 1, False, f"scale-b{count}")
    before = webhook_metrics(ports)
    lat, wall, errors = create_pods(core, ["gpu-a", "gpu-b"], 40, 1, True, f"scale-v{count}")
    after = webhook_metrics(ports)
    base, vs = latency_stats(base_lat, base_wall), latency_stats(lat, wall)
    return {
        "active_reservations": count,
        "baseline": base,
        "vramshare": vs,
        "create_ratio_p50": round(vs["p50_ms"] / base["p50_ms"], 2),
        "errors": errors,
        "webhook_decision": decision_quantiles(before, after),
        "webhook_choose": decision_quantiles(before, after, "choose"),
        "webhook_commit": decision_quantiles(before, after, "commit"),
        "webhook_rss_mib": {
            name: _rss_mib(cluster.components[name].process.pid)  # type: ignore[union-attr]
            for name in ("webhook-a", "webhook-b")
        },
        "controller_rss_mib": _rss_mib(cluster.components["controller"].process.pid),  # type: ignore[union-attr]
    }


def decision_curve(*, smoke: bool) -> dict[str, Any]:
    """Time of `choose()` (with headroom) for fleets and ledgers of growing size: `ms`, the median with
    the ledger as a list (summed per GPU on every call); `indexed_ms`, p50 and p99 with the ledger the
    way the webhook holds it (a `LedgerIndex`, summed per GPU as bookings come and go), which is what
    an admission pays, with the webhook's own default settings and a replica's preference among two
    replicas up (ties dealt out between them, then its own hashed order). 1000 GPUs x 10 000
    bookings is the fleet of issue #31 (125 nodes x 8). The fastest run is reported too: this
    machine's noise shows as the gap between it and the median."""
    settings = WebhookSettings().allocation
    gpu_sizes = [8, 64] if smoke else [8, 64, 512, 1000, 4096]
    reservation_sizes = [100, 1_000] if smoke else [100, 10_000, 100_000]
    out: dict[str, Any] = {"ms": {}, "indexed_ms": {}}
    for n_gpus in gpu_sizes:
        gpus = [
            Gpu(
                uuid=f"GPU-{i}",
                node=f"node-{i // 8}",
                index=i % 8,
                model="sim",
                total_mib=81_920,
                used_mib=1_000,
                free_mib=80_920,
                sampled_at=NOW,
            )
            for i in range(n_gpus)
        ]
        for n_res in reservation_sizes:
            ledger = [
                Reservation(
                    name=f"r{i}",
                    namespace="ns",
                    pod=f"p{i}",
                    mib=1,
                    node="node-0",
                    gpu_uuid=f"GPU-{i % n_gpus}",
                    gpu_index=0,
                    phase=ReservationPhase.BOUND,
                    reserved_at=NOW - 100,
                    pod_running_since=NOW - 100,
                )
                for i in range(n_res)
            ]
            request = AllocationRequest(mib=4_096, namespace="ns", pod="p")
            runs = []
            for _ in range(3 if n_res >= 100_000 else 7):
                started = time.perf_counter()
                choose(request, gpus, ledger, settings=settings, now=NOW)
                runs.append(time.perf_counter() - started)
            out["ms"][f"{n_gpus}x{n_res}"] = round(statistics.median(runs) * 1000, 3)
            index = LedgerIndex()
            for r in ledger:
                index.put(f"{r.namespace}/{r.name}", r)
            runs = []
            for _ in range(20 if smoke else 200):
                started = time.perf_counter()
                choose(
                    request,
                    gpus,
                    (),
                    settings=settings,
                    now=NOW,
                    index=index,
                    prefer="webhook-a",
                    replicas=("webhook-a", "webhook-b"),
                )
                runs.append(time.perf_counter() - started)
            out["indexed_ms"][f"{n_gpus}x{n_res}"] = {
                "min": round(min(runs) * 1000, 3),
                "p50": round(percentile(runs, 0.5) * 1000, 3),
                "p99": round(percentile(runs, 0.99) * 1000, 3),
            }
    return out


def run(
    *,
    smoke: bool,
    out: Path,
    show: Callable[[str], None] = print,
    scale: bool = True,
    levels: list[int] | None = None,
) -> dict[str, Any]:
    """The whole benchmark. Without `scale` the ledger-size steps (filling 100 000 bookings takes
    about half an hour here) are not run, and the last run's are kept, marked with their date."""
    report: dict[str, Any] = {"smoke": smoke, "levels": {}}
    adm = admission(smoke=smoke, show=show, scale=scale, levels=levels)
    report.update(adm)
    previous = out / "admission.json"
    if not scale and previous.exists():
        last = json.loads(previous.read_text())
        report["scale"] = last.get("scale", [])
        report["scale_measured"] = last.get("scale_measured", "an earlier run (before 2026-12-03)")
    elif scale:
        report["scale_measured"] = time.strftime("%Y-%m-%d")
    report["decision_curve"] = decision_curve(smoke=smoke)
    out.mkdir(parents=True, exist_ok=True)
    (out / "admission.json").write_text(json.dumps(report, indent=2) + "\n")
    chart(report, out / "admission.png")
    show(summary(report))
    return report


def chart(report: dict[str, Any], path: Path) -> None:
    """Pod creation latency (p50 and p99) against concurrency: plain, null webhook, the one-write
    floor, vramshare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["levels"], key=int)
    x = [int(level) for level in levels]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, quantile in zip(axes, ("p50_ms", "p99_ms"), strict=True):
        for case, label, colour in (
            ("baseline", "plain pod (no webhook called)", "#495057"),
            ("null_webhook", "null webhook (TLS round trip, no work)", "#1971c2"),
            ("one_write_floor", "one-write webhook (the floor: one booking, watched)", "#e8590c"),
            ("vramshare", "vramshare (decide + commit)", "#2b8a3e"),
        ):
            ax.plot(
                x, [report["levels"][lv][case][quantile] for lv in levels], "o-", label=label, color=colour
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel("concurrent pod creations")
        ax.set_ylabel(f"{quantile.removesuffix('_ms')} latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Pod creation on one API server ({report['pods_per_level']} pods per point)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio_text(ratios: dict[str, float]) -> str:
    return f"{ratios['ratio_p50']:.2f}x / {ratios['ratio_p99']:.2f}x / {ratios['throughput_ratio']:.2f}x"


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"Admission: {report['pods_per_level']} pods per level; "
        "plain, null webhook and vramshare on one API server",
        f"{'conc':>4}  {'plain p50':>9} {'p99':>8} {'pods/s':>7}  {'null p50':>9} {'p99':>8}  "
        f"{'vram p50':>9} {'p99':>8} {'pods/s':>7}  {'r50':>5} {'r99':>5} {'thr':>5}  "
        f"{'decision p50/p99':>17}  writes/adm  conflicts  rebased",
    ]
    for level, r in report["levels"].items():
        b, n, v, d = r["baseline"], r["null_webhook"], r["vramshare"], r["webhook_decision"]
        lines.append(
            f"{level:>4}  {b['p50_ms']:>7.1f}ms {b['p99_ms']:>6.1f}ms {b['pods_per_s']:>7.1f}  "
            f"{n['p50_ms']:>7.1f}ms {n['p99_ms']:>6.1f}ms  "
            f"{v['p50_ms']:>7.1f}ms {v['p99_ms']:>6.1f}ms {v['pods_per_s']:>7.1f}  "
            f"{r['ratio_p50']:>5.2f} {r['ratio_p99']:>5.2f} {r['throughput_ratio']:>5.2f}  "
            f"<={d['p50_ms_at_most']:>5.1f}/<={d['p99_ms_at_most']:>5.1f}ms  "
            f"{r['api_writes_per_admission']!s:>10}  {r['conflicts_retried']:>9.0f}  "
            f"{r.get('commits_rebased', 0):>7.0f}"
        )
        f = r["one_write_floor"]
        lines.append(
            f"      one-write floor: p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, "
            f"{f['pods_per_s']:.1f} pods/s ({_ratio_text(r['floor_vs_baseline'])} plain); "
            f"vramshare against it {_ratio_text(r['against_floor'])} (p50 / p99 / throughput)"
        )
        c, w = r["webhook_choose"], r["webhook_commit"]
        lines.append(
            f"      of the answer: choosing p50 <= {c['p50_ms_at_most']:.2f} ms (mean {c['mean_ms']:.2f}), "
            f"committing p50 <= {w['p50_ms_at_most']:.1f} ms (mean {w['mean_ms']:.1f}); "
            f"consistent reads {r['consistent_reads']:.0f}"
        )
        for case, cost in r.get("cost_per_pod", {}).items():
            cpu = cost["cpu_ms"]
            lines.append(
                f"      per pod, {case}: {cost['api_requests_total']:.2f} API requests "
                f"({', '.join(f'{k} {v:g}' for k, v in cost['api_requests'].items())}); CPU ms "
                + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
            )
    for scale in report["scale"]:
        d = scale["webhook_decision"]
        c = scale["webhook_choose"]
        lines.append(
            f"with {scale['active_reservations']} active reservations: create p50 "
            f"{scale['vramshare']['p50_ms']:.1f} ms ({scale['create_ratio_p50']:.2f}x plain), answer p50 "
            f"<= {d['p50_ms_at_most']:.1f} ms, of which choosing p50 <= {c['p50_ms_at_most']:.2f} ms "
            f"(mean {c['mean_ms']:.2f} ms); webhook RSS {scale['webhook_rss_mib']} MiB, "
            f"controller RSS {scale['controller_rss_mib']} MiB"
        )
    if "no_gpu" in report:
        ng = report["no_gpu"]
        lines.append(
            f"pods asking no GPU at concurrency {ng['concurrency']}: p50/p99 ms no webhook "
            f"{ng['no_webhook']['p50_ms']:.1f}/{ng['no_webhook']['p99_ms']:.1f}, unmanaged namespace "
            f"{ng['unmanaged']['p50_ms']:.1f}/{ng['unmanaged']['p99_ms']:.1f} "
            f"({ng['unmanaged_vs_no_webhook']['ratio_p50']:.2f}x), GPUs hidden "
            f"{ng['hidden']['p50_ms']:.1f}/{ng['hidden']['p99_ms']:.1f} "
            f"({ng['hidden_vs_no_webhook']['ratio_p50']:.2f}x p50, "
            f"{ng['hidden_vs_no_webhook']['throughput_ratio']:.2f}x throughput), "
            f"GPUs hidden in the API server "
            f"{ng['hidden_in_process']['p50_ms']:.1f}/{ng['hidden_in_process']['p99_ms']:.1f} "
            f"({ng['hidden_in_process_vs_no_webhook']['ratio_p50']:.2f}x p50, "
            f"{ng['hidden_in_process_vs_no_webhook']['throughput_ratio']:.2f}x throughput)"
        )
    lines.append(f"peak RSS MiB: {report['peak_rss_mib']}")
    lines.append(
        "choose() median ms (GPUs x reservations): "
        + ", ".join(f"{k}: {v}" for k, v in report["decision_curve"]["ms"].items())
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--no-scale",
        action="store_true",
        help="skip the 10 000 and 100 000 booking steps; keep the last run's",
    )
    parser.add_argument(
        "--levels",
        type=lambda v: [int(x) for x in v.split(",")],
        help="concurrency levels, comma-separated (default 1,4,16,64; smoke 1,4)",
    )
    args = parser.parse_args(argv)
    run(
        smoke=args.smoke,
        out=args.out,
        show=lambda s: print(s, flush=True),
        scale=not args.no_scale,
        levels=args.levels,
    )


if __name__ == "__main__":
    main()
