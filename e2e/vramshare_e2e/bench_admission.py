"""`make bench-admission`: what vramshare adds to pod creation, against a no-webhook baseline measured
in the same run on the same API server, and how the pure decision grows with the fleet and the ledger.

1. At each concurrency level (1, 4, 16, 64), create pods five times: plain pods in a namespace no
   webhook sees (the baseline), pods through a null TLS webhook that allows at once (the cost of a
   webhook call itself), pods through two `one-write` webhooks that each make one durable write per
   pod, of a copy of the GpuReservation kind, and watch them all (the floor of any design that books
   in the API server), pods through two `pinned` webhooks that do that and pin each pod to a GPU as
   vramshare does, watching the pods they pinned (the floor of any design that also pins pods and
   counts from their start: `vramshare_e2e.floor_webhook`), and annotated pods through two vramshare
   replicas (reservations committed). Report p50/p95/p99 create latency and throughput for each,
   vramshare's ratios against the baseline, the null webhook and both floors, the webhooks' own
   decision latency, conflict retries, consistent reads, API writes per admission, what each phase
   cost per pod (API requests; every component's CPU, in all and while the pods were created), and
   peak resident memory.
2. Fill the ledger to 10 000 and then 100 000 active reservations and measure pod creation against
   plain pods, the decision, and the webhook's resident memory.
3. Time `choose()` with headroom as GPUs (8 ... 4096) and active reservations (100 ... 100 000) grow.

    python -m vramshare_e2e.bench_admission [--smoke] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.utils import parse_quantity

from vramshare_e2e.admission_parts import start_mutating_webhook
from vramshare_e2e.bench_admission_report import chart, summary
from vramshare_e2e.bench_decision import decision_curve
from vramshare_e2e.bench_measure import (
    clean_namespaces,
    create_pods,
    decision_quantiles,
    latency_stats,
    peak_rss_mib,
    pin,
    ratios,
    rss_mib,
    split_cores,
    webhook_metrics,
    writes_between,
)
from vramshare_e2e.bench_no_gpu import NO_GPU_ROUNDS, no_gpu_phase
from vramshare_e2e.bench_phase import PhaseResult, run_phase
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import (
    WEBHOOK_ACCOUNT,
    chart_webhook_env,
    controller_identity,
    service_account_identity,
    start_controller,
    start_webhook,
    webhook_configuration,
)
from vramshare_e2e.floor_webhook import FLOOR_PLURAL, namespace_label, start_floor_webhooks

FLOOR_SPACES = ["floor-a", "floor-b"]
"""The one-write floor's namespaces, one per replica (as vramshare's gpu-a and gpu-b)."""
PINNED_SPACES = ["pinned-a", "pinned-b"]
"""The pinned floor's."""

PODS_PER_NODE = 2000
"""Room on each of the two nodes for a level's five phases (5 x 244 pods) and a round of the no-GPU
cases (4 x 496) at once."""


def _room_for_every_phase(cluster: LocalCluster, *, pods: int) -> None:
    """Let the nodes hold every pod of a level (its five phases and their warm-up) and of a no-GPU
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


def admission(
    *,
    smoke: bool,
    show: Callable[[str], None],
    scale: bool = True,
    levels: list[int] | None = None,
    cores_split: bool = False,
    hold_scheduler: bool = False,
) -> dict[str, Any]:
    levels = levels or ([1, 4] if smoke else [1, 4, 16, 64])
    pods = 12 if smoke else 240
    result: dict[str, Any] = {
        "pods_per_level": pods,
        "levels": {},
        "layout": "shared",
        "scheduler": "held while each phase's pods are created" if hold_scheduler else "running",
    }
    with LocalCluster.start() as cluster:
        # The scale section stops the controller (it would expire the pod-less fillers), so samples
        # must stay usable without it for the length of the run.
        env = {
            "VRAMSHARE_LOG_LEVEL": "warning",
            "VRAMSHARE_SAFETY_MARGIN_MIB": "0",
            "VRAMSHARE_MAX_SAMPLE_AGE_S": "86400",
            **chart_webhook_env("grant_pods"),  # grants, as the chart turns them on
        }
        # Each component reaches the API server with a ServiceAccount token, as the chart's pods do
        # (the admin's client certificate would cost the API server a verification per request).
        webhook_identity = service_account_identity(cluster, account=WEBHOOK_ACCOUNT)
        ports = [
            start_webhook(cluster, name=f"webhook-{s}", env=env, kubeconfig=webhook_identity)[1]
            for s in ("a", "b")
        ]
        registration = webhook_configuration(cluster, ports={"a": ports[0], "b": ports[1]}, as_the_chart=True)
        cluster.apply_objects([registration])
        start_mutating_webhook(cluster, mode="null")
        floor_identity = service_account_identity(cluster, account="e2e-one-write")
        for mode in ("one-write", "pinned"):
            start_floor_webhooks(cluster, mode=mode, kubeconfig=floor_identity)
        start_controller(
            cluster,
            name="controller",
            env={"VRAMSHARE_LOG_LEVEL": "warning", "VRAMSHARE_POLL_INTERVAL_S": "2"},
            kubeconfig=controller_identity(cluster),
        )
        for ns, labels in (
            ("plain", {}),
            ("null", {"e2e.vramshare.io/null": "on"}),
            ("floor-a", {namespace_label("one-write"): "0"}),
            ("floor-b", {namespace_label("one-write"): "1"}),
            ("pinned-a", {namespace_label("pinned"): "0"}),
            ("pinned-b", {namespace_label("pinned"): "1"}),
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
        if cores_split:
            result["layout"] = _split_the_cores(cluster, show=show)
        # One connection per client thread: with the client's default pool of 10, the threads past 10
        # opened a fresh TLS connection per pod, a cost of the benchmark's own, not of admission.
        client_config = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=client_config)  # type: ignore[no-untyped-call]
        client_config.connection_pool_maxsize = max(levels)
        core = client.CoreV1Api(client.ApiClient(client_config))
        spaces = ["plain", "null", *FLOOR_SPACES, *PINNED_SPACES, "gpu-a", "gpu-b"]
        # Warm up every path (connections, caches).
        create_pods(core, ["plain"], 4, 2, False, "warm")
        create_pods(core, ["null"], 4, 2, False, "warm")
        create_pods(core, FLOOR_SPACES, 4, 2, False, "warm")
        create_pods(core, PINNED_SPACES, 4, 2, False, "warm")
        create_pods(core, ["gpu-a", "gpu-b"], 4, 2, True, "warm")
        clean_namespaces(cluster, spaces)
        for level in levels:
            show(
                f"concurrency {level}: {pods} plain pods, {pods} through a null webhook, {pods} through "
                f"one-write webhooks (the floor), {pods} through pinning ones (the pinned floor), "
                f"{pods} GPU pods"
            )
            phases: dict[str, PhaseResult] = {}
            before: dict[str, float] = {}
            for case, namespaces, annotated, tag in (
                ("baseline", ["plain"], False, "b"),
                ("null_webhook", ["null"], False, "n"),
                ("one_write_floor", FLOOR_SPACES, False, "f"),
                ("pinned_floor", PINNED_SPACES, False, "p"),
                ("vramshare", ["gpu-a", "gpu-b"], True, "v"),
            ):
                if case == "vramshare":
                    before = webhook_metrics(ports)
                phases[case] = run_phase(
                    cluster,
                    core,
                    namespaces=namespaces,
                    pods=pods,
                    concurrency=level,
                    annotated=annotated,
                    tag=f"{tag}{level}",
                    hold_scheduler=hold_scheduler,
                )
            after = webhook_metrics(ports)
            base, null, floor, pinned, vs = (
                latency_stats(phases[case].latencies, phases[case].wall_s)
                for case in ("baseline", "null_webhook", "one_write_floor", "pinned_floor", "vramshare")
            )
            admitted = pods - phases["vramshare"].errors
            writes = writes_between(before, after)
            result["levels"][str(level)] = {
                "baseline": base,
                "null_webhook": null,
                "one_write_floor": floor,
                "pinned_floor": pinned,
                "vramshare": vs,
                **ratios(vs, base),
                "against_null_webhook": ratios(vs, null),
                "floor_vs_baseline": ratios(floor, base),
                "against_floor": ratios(vs, floor),
                "against_pinned_floor": ratios(vs, pinned),
                "pinned_floor_vs_floor": ratios(pinned, floor),
                "errors": {case: phase.errors for case, phase in phases.items()},
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
                "cost_per_pod": {case: phase.cost for case, phase in phases.items()},
            }
            clean_namespaces(cluster, spaces)
            cluster.kubectl("delete", FLOOR_PLURAL, "--all", "-A", "--wait=false")
            time.sleep(2)
        result["no_gpu"] = no_gpu_phase(
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
        clean_namespaces(cluster, spaces)
        result["peak_rss_mib"] = {
            name: peak_rss_mib(cluster.component(name).process.pid)  # type: ignore[union-attr]
            for name in ("webhook-a", "webhook-b", "controller")
        }
        result["scale"] = []
        if not scale:
            return result
        made = 0
        # The fillers are pod-less Reserved bookings: the controller runs on with a TTL they outlive,
        # so its memory with the whole ledger in its caches is measured too.
        cluster.stop_component("controller")
        controller = cluster.component("controller")
        controller.env = {**(controller.env or {}), "VRAMSHARE_RESERVATION_TTL_S": "86400"}
        cluster.start_component("controller")
        for count in [200, 500] if smoke else [10_000, 100_000]:
            result["scale"].append(_at_scale(cluster, core, ports, have=made, count=count, show=show))
            made = count
    return result


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
            name: rss_mib(cluster.component(name).process.pid)  # type: ignore[union-attr]
            for name in ("webhook-a", "webhook-b")
        },
        "controller_rss_mib": rss_mib(cluster.component("controller").process.pid),  # type: ignore[union-attr]
    }


def _split_the_cores(cluster: LocalCluster, *, show: Callable[[str], None]) -> str:
    """Give the cluster (control plane, kwok, monitoring) one half of this machine's CPUs and its
    workloads (the webhooks, the controller) and the load generator the other (`split_cores`)."""
    running = {c.name: c.process.pid for c in cluster.components if c.process is not None}
    plan, generator = split_cores(list(running), sorted(os.sched_getaffinity(0)))
    for name, cpus in plan.items():
        pin(running[name], cpus)
    pin(os.getpid(), generator)
    workloads = sorted(name for name, cpus in plan.items() if cpus == generator)
    cluster_cpus = next((cpus for cpus in plan.values() if cpus != generator), ())
    layout = (
        f"split: the cluster on CPUs {','.join(map(str, cluster_cpus))}; "
        f"{', '.join(workloads)} and the load generator on CPUs {','.join(map(str, generator))}"
    )
    show(layout)
    return layout


def run(
    *,
    smoke: bool,
    out: Path,
    show: Callable[[str], None] = print,
    scale: bool = True,
    levels: list[int] | None = None,
    cores_split: bool = False,
    hold_scheduler: bool = False,
) -> dict[str, Any]:
    """The whole benchmark. Without `scale` the ledger-size steps (filling 100 000 bookings takes
    about half an hour here) are not run, and the last run's are kept, marked with their date. With
    `cores_split`, the cluster and its workloads run on separate halves of the machine's CPUs; with
    `hold_scheduler`, no pod is bound while a phase's pods are created (`bench_phase.scheduler_held`)."""
    report: dict[str, Any] = {"smoke": smoke, "levels": {}}
    adm = admission(
        smoke=smoke,
        show=show,
        scale=scale,
        levels=levels,
        cores_split=cores_split,
        hold_scheduler=hold_scheduler,
    )
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
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="the cluster (control plane, kwok, monitoring) on one half of the CPUs, the webhooks, the "
        "controller and the load generator on the other, as pods run on nodes; write to another --out",
    )
    parser.add_argument(
        "--hold-scheduler",
        action="store_true",
        help="stop the scheduler while each phase's pods are created, so that every phase's bindings "
        "and what follows them land after its creations: the admission path alone; write to another --out",
    )
    args = parser.parse_args(argv)
    run(
        smoke=args.smoke,
        out=args.out,
        show=lambda s: print(s, flush=True),
        scale=not args.no_scale,
        levels=args.levels,
        cores_split=args.split_cores,
        hold_scheduler=args.hold_scheduler,
    )


if __name__ == "__main__":
    main()
