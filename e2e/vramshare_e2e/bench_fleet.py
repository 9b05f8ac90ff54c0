"""`make bench-fleet`: vramshare on a 1000-GPU fleet (issue #31).

125 kwok nodes with 8 fake GPUs each (80 GB cards), the fake DCGM exporter behind a real Prometheus,
one controller and two webhook replicas on one API server, and 10 000 active bookings in the ledger
(pod-less, so the controller is given a TTL they outlive). Measured, in one run:

- **inventory polls** (the controller's `vramshare_inventory_poll_seconds`, and where its time went
  by step): with no GPU changing, then with 10 and then 100 GPUs' used memory changed between two
  polls (within their bookings and the safety margin); with the GpuDevice status
  writes each poll made (`vramshare_gpudevice_status_writes_total`), which should follow the GPUs
  that changed, not the fleet;
- **admission on that fleet**: 40 GPU pods created one at a time through the webhooks, against 40
  plain pods in the same run, with the webhooks' own time to choose (histogram buckets, as
  `make bench-admission` reports them);
- **memory**: the resident set of the controller and of each webhook with the fleet and the ledger
  in their caches;
- **the DCGM reading taken apart**: the controller's query, sent from this process (an interpreter
  of its own, not the controller's busy one), timed as Prometheus's answer (evaluating, encoding and
  sending it) and as its parsing into samples, to compare with the poll's `read` step.

Queue placements' writes are bounded by `queue_positions_shown` whatever the queue's length; that is
measured on the fake API in `tests/unit/controller/test_queue_positions.py`, not here.

    python -m vramshare_e2e.bench_fleet [--smoke] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config

from vramshare.dcgm_series import AUTO, promql, samples_from
from vramshare_e2e.admission_parts import start_mutating_webhook
from vramshare_e2e.bench_controller import mem_mib
from vramshare_e2e.bench_measure import create_pods, decision_quantiles, latency_stats, webhook_metrics
from vramshare_e2e.cluster import ClusterSettings, LocalCluster
from vramshare_e2e.components import bare_booking, start_controller, start_webhook, webhook_configuration
from vramshare_e2e.fleet import FakeNode, Fleet, uniform_gpus

POLL_INTERVAL_S = 5.0
"""The controller's default poll interval."""


SCRAPE_INTERVAL_S = 2.5
"""How often the benchmark reads the controller's metrics: half the poll interval, so each poll is
still seen on its own. Rendering the 9000 per-GPU series holds the controller's interpreter about
0.1 s (py-spy), and its DCGM reading waits for it: read every second, that was a tenth of the
controller's time, against the one scrape in 15 to 60 s of a real Prometheus."""


def fleet_of(nodes: int, gpus_per_node: int) -> Fleet:
    return Fleet(
        nodes=[
            FakeNode(
                name=f"gpu-{n:03d}",
                gpus=uniform_gpus(
                    f"gpu-{n:03d}",
                    gpus_per_node,
                    model="NVIDIA H100 80GB HBM3",
                    total_mib=81_559,
                    driver_reserved_mib=512,
                ),
            )
            for n in range(nodes)
        ]
    )


def _controller_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vramshare_inventory_poll_seconds_(?:sum|count)) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
        m = re.match(r'^vramshare_gpudevice_status_writes_total\{why="([a-z]+)"\} ([0-9.e+-]+)$', line)
        if m:
            out[f"writes_{m.group(1)}"] = float(m.group(2))
        m = re.match(r'^vramshare_inventory_poll_step_seconds_sum\{step="([a-z]+)"\} ([0-9.e+-]+)$', line)
        if m:
            out[f"step_{m.group(1)}"] = float(m.group(2))
        m = re.match(r'^vramshare_inventory_heartbeat_gpus\{coverage="([a-z]+)"\} ([0-9.e+-]+)$', line)
        if m:
            out[f"heartbeat_{m.group(1)}"] = float(m.group(2))
    return out


def _polls(port: int, *, polls: int, between: Callable[[], None] | None = None) -> dict[str, Any]:
    """Watch `polls` inventory polls complete; `between` runs right after the first one counted."""
    seen = _controller_metrics(port)
    per_poll: list[tuple[float, float, float]] = []
    steps: list[dict[str, float]] = []
    deadline = time.monotonic() + polls * POLL_INTERVAL_S * 6
    while len(per_poll) < polls and time.monotonic() < deadline:
        # Not more often: rendering the controller's /metrics (nine series per GPU, 9000 at this
        # size) takes the CPU the poll needs; scraped every 0.2 s it took over half the controller's
        # samples (py-spy) and slowed the very polls being timed (see SCRAPE_INTERVAL_S).
        time.sleep(SCRAPE_INTERVAL_S)
        now = _controller_metrics(port)
        count = now.get("vramshare_inventory_poll_seconds_count", 0.0)
        if count > seen.get("vramshare_inventory_poll_seconds_count", 0.0):
            took = now["vramshare_inventory_poll_seconds_sum"] - seen["vramshare_inventory_poll_seconds_sum"]
            changed = now.get("writes_changed", 0.0) - seen.get("writes_changed", 0.0)
            refreshed = now.get("writes_refresh", 0.0) - seen.get("writes_refresh", 0.0)
            per_poll.append((round(took, 3), changed, refreshed))
            steps.append(
                {
                    k.removeprefix("step_"): round(v - seen.get(k, 0.0), 3)
                    for k, v in now.items()
                    if k.startswith("step_")
                }
            )
            seen = now
            if between is not None and len(per_poll) == 1:
                between()
    return {
        "completed": len(per_poll),
        "watched_s": round(polls * POLL_INTERVAL_S * 6, 1),
        "poll_s": [p for p, _, _ in per_poll],
        "status_writes_changed": [c for _, c, _ in per_poll],
        "status_writes_refresh": [r for _, _, r in per_poll],
        "max_poll_s": max((p for p, _, _ in per_poll), default=None),
        # Where each poll's time went (`vramshare_inventory_poll_step_seconds`).
        "steps_s": steps,
        # GPUs the last poll's heartbeat dated (no status write of their own), and those it did not.
        "heartbeat_confirmed": seen.get("heartbeat_confirmed", 0.0),
        "heartbeat_unconfirmed": seen.get("heartbeat_unconfirmed", 0.0),
    }


def _reading_cost(url: str, *, tries: int = 5) -> dict[str, Any]:
    """The controller's one query, its answer and its parsing timed apart (medians of `tries`)."""
    query = promql()
    answer_s, parse_s, size, series, gpus = [], [], 0, 0, 0
    for _ in range(tries):
        at = time.time() - 1.0  # the controller's query_delay_s
        params = urllib.parse.urlencode({"query": query, "time": f"{at:.3f}"})
        started = time.perf_counter()
        with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=30) as resp:
            body = resp.read()
        answered = time.perf_counter()
        result = json.loads(body)["data"]["result"]
        reading = samples_from(result, node_label=AUTO, evaluated_at=at)
        answer_s.append(answered - started)
        parse_s.append(time.perf_counter() - answered)
        size, series, gpus = len(body), len(result), len(reading.samples)
    return {
        "series": series,
        "bytes": size,
        "gpus": gpus,
        "answer_s": round(statistics.median(answer_s), 3),
        "parse_s": round(statistics.median(parse_s), 3),
    }


def run(*, smoke: bool, out: Path | None, show: Callable[[str], None] = print) -> dict[str, Any]:
    nodes, per_node = (8, 8) if smoke else (125, 8)
    bookings = 500 if smoke else 10_000
    gpus = nodes * per_node
    report: dict[str, Any] = {"smoke": smoke, "nodes": nodes, "gpus": gpus, "active_reservations": bookings}
    settings = ClusterSettings(fleet=fleet_of(nodes, per_node), scrape_interval_s=2.0, startup_timeout_s=600)
    show(f"starting a control plane with {nodes} kwok nodes x {per_node} GPUs")
    with LocalCluster.start(settings=settings) as cluster:
        env = {"VRAMSHARE_LOG_LEVEL": "warning"}
        ports = [start_webhook(cluster, name=f"webhook-{s}", env=env)[1] for s in ("a", "b")]
        cluster.apply_objects(
            [webhook_configuration(cluster, ports={"a": ports[0], "b": ports[1]}, as_the_chart=True)]
        )
        start_mutating_webhook(cluster, mode="null")
        _, metrics_port = start_controller(
            cluster,
            name="controller",
            env={
                **env,
                "VRAMSHARE_RESERVATION_TTL_S": "86400",
                "VRAMSHARE_POLL_INTERVAL_S": str(POLL_INTERVAL_S),
            },
        )
        for ns, labels in (
            ("plain", {}),
            ("gpu-a", {"vramshare-e2e/shard": "a"}),
            ("gpu-b", {"vramshare-e2e/shard": "b"}),
        ):
            cluster.apply_objects(
                [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}]
            )
        started = time.monotonic()
        cluster.wait_for(
            lambda: len(cluster.kubectl("get", "gpudevices", "-o", "name").split()) == gpus,
            what=f"{gpus} GpuDevices",
            timeout_s=600,
        )
        report["inventory_discovered_s"] = round(time.monotonic() - started, 1)
        show(f"{gpus} GpuDevices in {report['inventory_discovered_s']} s; booking {bookings}")
        api_config = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=api_config)  # type: ignore[no-untyped-call]
        api_config.connection_pool_maxsize = 24
        api = client.ApiClient(api_config)
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        fleet = cluster.exporter.fleet().all_gpus()

        def book(i: int) -> None:
            node, gpu = fleet[i % len(fleet)]
            custom.create_namespaced_custom_object(
                "vramshare.io",
                "v1alpha1",
                "plain",
                "gpureservations",
                bare_booking(
                    name=f"filler-{i}",
                    namespace="plain",
                    pod=f"filler-{i}",
                    node=node.name,
                    uuid=gpu.uuid,
                    index=gpu.index,
                    mib=1,
                ),
            )

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=24) as pool:
            list(pool.map(book, range(bookings)))
        report["booked_in_s"] = round(time.monotonic() - started, 1)
        show(f"{bookings} bookings in {report['booked_in_s']} s; letting the caches take them in")
        time.sleep(2 * POLL_INTERVAL_S)
        show("polls with nothing changing")
        report["polls_unchanged"] = _polls(metrics_port, polls=3)
        # Each step moves its GPUs to a figure none of them had: every one of them changes. Within
        # what the GPU's bookings and the safety margin allow, as pods using the memory they booked
        # do: above it each changed GPU would also post a MemoryOverused event (2026-12-04's runs
        # moved them to 2 and 4 GiB, and measured that too).
        for step, changed in enumerate((10, 100) if not smoke else (4, 16), start=1):
            show(f"polls with {changed} GPUs changing")

            def change(count: int = changed, used: int = 100 * step) -> None:
                for _, gpu in fleet[:count]:
                    cluster.exporter.set_used(gpu.uuid, used)

            report[f"polls_{changed}_changed"] = _polls(metrics_port, polls=3, between=change)
        report["reading"] = _reading_cost(cluster.prometheus_url)
        show("admission on the fleet: 40 plain pods, then 40 GPU pods, one at a time")
        create_pods(core, ["gpu-a", "gpu-b"], 4, 1, True, "warm")
        base_lat, base_wall, _ = create_pods(core, ["plain"], 40, 1, False, "fleet-b")
        before = webhook_metrics(ports)
        lat, wall, errors = create_pods(core, ["gpu-a", "gpu-b"], 40, 1, True, "fleet-v")
        after = webhook_metrics(ports)
        base, vs = latency_stats(base_lat, base_wall), latency_stats(lat, wall)
        report["admission"] = {
            "baseline": base,
            "vramshare": vs,
            "create_ratio_p50": round(vs["p50_ms"] / base["p50_ms"], 2),
            "errors": errors,
            "webhook_decision": decision_quantiles(before, after),
            "webhook_choose": decision_quantiles(before, after, "choose"),
        }
        report["rss_mib"] = {
            name: mem_mib(cluster.component(name).process.pid, "VmRSS")  # type: ignore[union-attr]
            for name in ("controller", "webhook-a", "webhook-b")
        }
    show(summary(report))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / ("fleet-smoke.json" if smoke else "fleet.json")).write_text(
            json.dumps(report, indent=2) + "\n"
        )
    return report


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"Fleet: {report['gpus']} GPUs on {report['nodes']} nodes, {report['active_reservations']} bookings"
    ]
    for key, value in report.items():
        if key.startswith("polls_"):
            lines.append(
                f"  {key}: poll s {value['poll_s']} (max {value['max_poll_s']}), status writes per poll: "
                f"changed {value['status_writes_changed']}, refresh {value['status_writes_refresh']}; "
                f"heartbeat dated {value['heartbeat_confirmed']:.0f} GPUs "
                f"({value['heartbeat_unconfirmed']:.0f} not); steps s {value['steps_s']}"
            )
    r = report["reading"]
    lines.append(
        f"  the DCGM reading from a quiet interpreter: {r['series']} series, {r['bytes'] / 1e6:.1f} MB; "
        f"Prometheus's answer {r['answer_s']} s, parsing into {r['gpus']} samples {r['parse_s']} s"
    )
    adm = report["admission"]
    lines.append(
        f"  admission one at a time: create p50 {adm['vramshare']['p50_ms']} ms vs plain "
        f"{adm['baseline']['p50_ms']} ms ({adm['create_ratio_p50']}x), choosing p50 <= "
        f"{adm['webhook_choose']['p50_ms_at_most']} ms, p99 <= {adm['webhook_choose']['p99_ms_at_most']} ms "
        f"(mean {adm['webhook_choose']['mean_ms']} ms), errors {adm['errors']}"
    )
    lines.append(f"  resident memory MiB: {report['rss_mib']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    run(smoke=args.smoke, out=args.out, show=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
