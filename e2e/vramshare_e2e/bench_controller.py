"""`make bench-controller`: what a cluster's ordinary pods cost vramshare's controller (issue #31).

The controller reacts only to the pods vramshare admitted. Its pod events come from a watch filtered
on the API server by the `vramshare.io/reservation` label, so the cluster's other pods should cost it
nothing: neither the LIST at each leadership term nor the decoding of their events, on the event loop
that also renews the Lease.

One run, two phases of the same length on the same control plane:

1. **baseline**: no ordinary pods. GPU pods that run 1 s come and go, and bookings whose pods never
   appear wait for their TTL.
2. **churn**: the same, while `--pods` ordinary pods (in a namespace vramshare does not manage) exist
   and are deleted and created again at a steady rate.

Reported for each phase: the controller's CPU (cores, from /proc), its resident memory, Lease
transitions (a lost Lease is one), the release lag (from the moment a GPU pod is seen Succeeded to the
moment its booking is seen Released) and the expiry lag (from TTL's end to the booking seen Expired),
both as seen by watches of this process; and the churn phase against the baseline as ratios.

    python -m vramshare_e2e.bench_controller [--smoke] [--pods 5000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, LocalCluster
from vramshare_e2e.components import (
    bare_booking,
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)

TTL_S = 10.0
"""The bookings' TTL in this run (the default is 20 s): expiries measured within a short phase."""
LIFECYCLE_INTERVAL_S = 10.0
"""The default sweep: a lag near it would mean the events were missed and only the sweep acted."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def mem_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _quantiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50_s": round(statistics.median(ordered), 3),
        "p95_s": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3),
        "max_s": round(ordered[-1], 3),
    }


class Observer:
    """Watches pods and GpuReservations in the GPU namespace and records, on this process's clock, when
    each GPU pod was first seen Succeeded and each booking first seen Released or Expired."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.core: Any = client.CoreV1Api(api)
        self.custom: Any = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.succeeded: dict[str, float] = {}
        """Reservation name -> when its pod was seen Succeeded."""
        self.added: dict[str, float] = {}
        self.ended: dict[str, tuple[str, float]] = {}
        """Reservation name -> (phase, when seen ended)."""
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._pods, daemon=True),
            threading.Thread(target=self._reservations, daemon=True),
        ]

    def __enter__(self) -> Observer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()

    def _follow(self, on_event: Callable[[Any], None], list_fn: Any, *args: Any) -> None:
        """Watch until stopped; a stream that ends (its timeout, or the API server going away at the
        end of the run) is started again or left."""
        while not self._stop.is_set():
            try:
                for event in watch.Watch().stream(list_fn, *args, timeout_seconds=5):  # type: ignore[no-untyped-call]
                    on_event(event["object"])
            except Exception:  # a broken stream: the loop decides whether to go on
                self._stop.wait(0.2)

    def _pods(self) -> None:
        def seen(pod: Any) -> None:
            name = (pod.metadata.labels or {}).get("vramshare.io/reservation")
            if name and pod.status.phase == "Succeeded":
                self.succeeded.setdefault(name, time.monotonic())

        self._follow(seen, self.core.list_namespaced_pod, self.namespace)

    def _reservations(self) -> None:
        def seen(obj: Any) -> None:
            name = obj["metadata"]["name"]
            self.added.setdefault(name, time.monotonic())
            phase = (obj.get("status") or {}).get("phase")
            if phase in ("Released", "Expired"):
                self.ended.setdefault(name, (phase, time.monotonic()))

        self._follow(
            seen,
            self.custom.list_namespaced_custom_object,
            "vramshare.io",
            "v1alpha1",
            self.namespace,
            "gpureservations",
        )


def _gpu_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {"gpu-mem-mb": "1024", RUN_DURATION_ANNOTATION: "1s"}},
        "spec": {"containers": [{"name": "task", "image": "example.invalid/task"}], "restartPolicy": "Never"},
    }


def _plain_pod(name: str, node: str) -> dict[str, Any]:
    """An ordinary pod, bound to a node at creation: it runs (kwok makes it Running, with the status
    writes a kubelet makes) without queueing in the scheduler ahead of the GPU pods being measured."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "ordinary"}},
        "spec": {"nodeName": node, "containers": [{"name": "web", "image": "example.invalid/web"}]},
    }


class Churn:
    """Keeps `count` ordinary pods, deleting the oldest and creating a new one `rate` times a second."""

    def __init__(self, core: Any, namespace: str, *, names: list[str], nodes: list[str], rate: float) -> None:
        self.core, self.namespace, self.names, self.nodes, self.rate = core, namespace, names, nodes, rate
        self.replaced = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _one(self, old: str, new: str) -> None:
        try:
            self.core.delete_namespaced_pod(old, self.namespace, grace_period_seconds=0)
            self.core.create_namespaced_pod(
                self.namespace, _plain_pod(new, self.nodes[len(new) % len(self.nodes)])
            )
            self.replaced += 1
        except client.ApiException:
            pass  # counted by `replaced` staying behind

    def _run(self) -> None:
        with ThreadPoolExecutor(max_workers=8) as pool:
            start = time.monotonic()
            i = 0
            while not self._stop.is_set():
                due = start + i / self.rate
                if (wait := due - time.monotonic()) > 0:
                    self._stop.wait(wait)
                old = self.names.pop(0)
                new = f"ordinary-{uuid.uuid4().hex[:10]}"
                self.names.append(new)
                pool.submit(self._one, old, new)
                i += 1


def _phase(
    *,
    cluster: LocalCluster,
    api: client.ApiClient,
    controller_pid: int,
    namespace: str,
    duration_s: float,
    tag: str,
) -> dict[str, Any]:
    core: Any = client.CoreV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    node, gpu = cluster.settings.fleet.all_gpus()[0]

    def lease() -> dict[str, Any]:
        got: dict[str, Any] = json.loads(
            cluster.kubectl("get", "lease", "vramshare-controller", "-n", "default", "-o", "json")
        )
        return got

    before_lease = lease()["spec"]
    cpu0, t0 = _cpu_s(controller_pid), time.monotonic()
    created_at: dict[str, float] = {}
    """This phase's bookings without a pod -> when created."""
    booked: set[str] = set()
    """This phase's GPU pods' bookings (the watches also list the earlier phase's)."""
    with Observer(api, namespace) as seen:
        i = 0
        while time.monotonic() - t0 < duration_s:
            made = core.create_namespaced_pod(namespace, _gpu_pod(f"{tag}-gpu-{i}"))
            booked.add(made.metadata.annotations["vramshare.io/reservation"])
            orphan = f"{tag}-orphan-{i}"
            custom.create_namespaced_custom_object(
                "vramshare.io",
                "v1alpha1",
                namespace,
                "gpureservations",
                bare_booking(
                    name=orphan,
                    namespace=namespace,
                    pod=orphan,
                    node=node.name,
                    uuid=gpu.uuid,
                    index=gpu.index,
                    mib=64,
                ),
            )
            created_at[orphan] = time.monotonic()
            i += 1
            time.sleep(1.0)
        cpu_s = _cpu_s(controller_pid) - cpu0
        wall_s = time.monotonic() - t0
        # The last bookings need their pods to finish, and their TTL to pass.
        mine = booked | set(created_at)

        def ended() -> int:
            return len(mine & set(seen.ended))

        deadline = time.monotonic() + TTL_S + LIFECYCLE_INTERVAL_S + 30
        while time.monotonic() < deadline and ended() < len(mine):
            time.sleep(0.2)
    releases = [
        at - seen.succeeded[name]
        for name, (phase, at) in seen.ended.items()
        if phase == "Released" and name in booked and name in seen.succeeded
    ]
    expiries = [
        at - (created_at[name] + TTL_S)
        for name, (phase, at) in seen.ended.items()
        if phase == "Expired" and name in created_at
    ]
    after_lease = lease()["spec"]
    return {
        "duration_s": round(wall_s, 1),
        "gpu_pods": i,
        "bookings_without_pod": i,
        "controller_cpu_cores": round(cpu_s / wall_s, 4),
        "controller_rss_mib": mem_mib(controller_pid, "VmRSS"),
        "lease_transitions": int(after_lease.get("leaseTransitions") or 0)
        - int(before_lease.get("leaseTransitions") or 0),
        "lease_holder_kept": after_lease.get("holderIdentity") == before_lease.get("holderIdentity"),
        "gpu_pods_seen_succeeded": len(booked & set(seen.succeeded)),
        "release_lag": _quantiles(releases),
        "expiry_lag": _quantiles(expiries),
        "not_ended": len(mine) - ended(),
    }


def _ordinary_nodes(cluster: LocalCluster, pods: int) -> list[str]:
    """kwok nodes without GPUs for the ordinary pods (the GPU nodes take 250 pods each, as a kubelet's
    default: there they would leave no room for the GPU pods measured)."""
    names = [f"plain-node-{i}" for i in range(max(1, -(-pods // 200)))]
    cluster.apply_objects(
        [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"}},
                "status": {
                    "capacity": {"cpu": "32", "memory": "256Gi", "pods": "250"},
                    "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "250"},
                },
            }
            for name in names
        ]
    )
    return names


def run(*, smoke: bool, pods: int, out: Path | None, show: Callable[[str], None] = print) -> dict[str, Any]:
    duration_s = 15.0 if smoke else 60.0
    rate = max(1.0, pods / 200)  # the whole set replaced every 200 s: 25 pods a second for 5000
    with LocalCluster.start() as cluster:
        port = start_webhook(cluster, name="webhook", env={"VRAMSHARE_LOG_LEVEL": "warning"})[1]
        cluster.apply_objects([webhook_configuration(cluster, ports={"a": port})])
        for ns, labels in (("gpu", {"vramshare-e2e/shard": "a"}), ("ordinary", {})):
            cluster.apply_objects(
                [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}]
            )
        controller, _ = start_controller(
            cluster,
            name="controller",
            env={"VRAMSHARE_LOG_LEVEL": "warning", "VRAMSHARE_RESERVATION_TTL_S": str(TTL_S)},
        )
        wait_for_gpu_devices(cluster)
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))  # type: ignore[no-untyped-call]
        api.configuration.connection_pool_maxsize = 16
        core: Any = client.CoreV1Api(api)
        pid = controller.process.pid  # type: ignore[union-attr]
        show(f"baseline: {duration_s:g} s with no ordinary pods")
        baseline = _phase(
            cluster=cluster, api=api, controller_pid=pid, namespace="gpu", duration_s=duration_s, tag="b"
        )
        show(json.dumps(baseline))
        show(f"creating {pods} ordinary pods")
        names = [f"ordinary-{i}" for i in range(pods)]
        nodes = _ordinary_nodes(cluster, pods)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(
                pool.map(
                    lambda i: core.create_namespaced_pod(
                        "ordinary", _plain_pod(names[i], nodes[i % len(nodes)])
                    ),
                    range(len(names)),
                )
            )
        show(
            f"{pods} ordinary pods created in {time.monotonic() - started:.1f} s; "
            f"churn {rate:g}/s for {duration_s:g} s"
        )
        with Churn(core, "ordinary", names=names, nodes=nodes, rate=rate) as churn:
            loaded = _phase(
                cluster=cluster, api=api, controller_pid=pid, namespace="gpu", duration_s=duration_s, tag="c"
            )
        loaded["ordinary_pods"] = pods
        loaded["ordinary_pods_replaced"] = churn.replaced
        show(json.dumps(loaded))

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 2) if b else None

    report = {
        "smoke": smoke,
        "baseline": baseline,
        "churn": loaded,
        "churn_vs_baseline": {
            "controller_cpu": ratio(loaded["controller_cpu_cores"], baseline["controller_cpu_cores"]),
            "controller_rss": ratio(loaded["controller_rss_mib"], baseline["controller_rss_mib"]),
            "release_lag_p95": ratio(
                loaded["release_lag"].get("p95_s", 0), baseline["release_lag"].get("p95_s", 0)
            ),
            "expiry_lag_p95": ratio(
                loaded["expiry_lag"].get("p95_s", 0), baseline["expiry_lag"].get("p95_s", 0)
            ),
        },
    }
    show(json.dumps(report["churn_vs_baseline"]))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / ("controller-smoke.json" if smoke else "controller.json")).write_text(
            json.dumps(report, indent=2) + "\n"
        )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="a short run with 300 ordinary pods")
    parser.add_argument("--pods", type=int, default=None, help="ordinary pods (default 5000, smoke 300)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    pods = args.pods if args.pods is not None else (300 if args.smoke else 5000)
    run(smoke=args.smoke, pods=pods, out=args.out)


if __name__ == "__main__":
    main()
