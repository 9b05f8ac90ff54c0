"""`make demo`: the whole of vramshare on one machine, playing Airflow-like GPU tasks.

It starts the local control plane (building it the first time), the webhook and the controller, then:
tasks with mixed `gpu-mem-mb` sizes are admitted and placed; one too large for any GPU is refused with
the message an Airflow user reads; tasks finish and release their memory; the refused task, retried
as Airflow would after its retry_delay, is admitted; a pod without a GPU request gets
`NVIDIA_VISIBLE_DEVICES=void`. Tables of GPUs and reservations are shown as it goes.

    python -m vramshare_e2e.demo [--fast]      KEEP=1 leaves everything running afterwards

With --real-node (`make demo REAL_NODE=1`) it is vramshare as an operator installs it instead, beside
NVIDIA's device plugin (`vramshare_e2e.demo_real_node`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from vramshare import status as status_view
from vramshare.kube.resources import (
    ANNOTATION_GPU_UUID,
    ANNOTATION_NODE,
    ANNOTATION_RESERVATION,
    LABEL_RESERVATION,
)
from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, ClusterSettings, LocalCluster
from vramshare_e2e.components import (
    chart_admission_policies,
    controller_identity,
    start_controller,
    start_webhook,
    webhook_configuration,
)
from vramshare_e2e.process import eventually, wait_for_signal

NAMESPACE = "airflow"
SHARD = "demo"


@dataclass(frozen=True, kw_only=True)
class Task:
    name: str
    mib: int | None
    run_s: float


@dataclass(kw_only=True)
class Outcome:
    admitted: dict[str, dict[str, str]] = field(default_factory=dict)
    """pod -> {gpu, node, reservation, visible_devices, cuda_devices}"""
    refused: dict[str, str] = field(default_factory=dict)
    retry_admitted: dict[str, str] | None = None
    retry_attempts: int = 0
    hidden_pod_env: str | None = None
    tamper_refusal: str | None = None
    """What the chart's pinning policy answered a change of an admitted pod's GPU."""
    released: list[str] = field(default_factory=list)
    queued: dict[str, Any] = field(default_factory=dict)
    """The queue-mode task: gated (bool), position, and where it was placed (gpu, waited_s)."""
    final: status_view.Status | None = None


def tasks(fast: bool) -> tuple[list[Task], Task, Task]:
    scale = 1.0 if fast else 3.0
    first_wave = [
        Task(name="train-resnet", mib=30_000, run_s=12 * scale),
        Task(name="train-bert", mib=30_000, run_s=40 * scale),
        Task(name="embed-docs", mib=8_000, run_s=5 * scale),
        Task(name="infer-batch-1", mib=4_000, run_s=3 * scale),
        Task(name="infer-batch-2", mib=4_000, run_s=4 * scale),
        Task(name="infer-batch-3", mib=4_000, run_s=3 * scale),
    ]
    too_big = Task(name="train-llm", mib=24_000, run_s=6 * scale)
    no_gpu = Task(name="make-report", mib=None, run_s=2 * scale)
    return first_wave, too_big, no_gpu


def pod_for(task: Task, *, queue: bool = False) -> client.V1Pod:
    annotations = {RUN_DURATION_ANNOTATION: f"{task.run_s:g}s", "dag_id": "demo", "task_id": task.name}
    if task.mib is not None:
        annotations["gpu-mem-mb"] = str(task.mib)
    if queue:
        annotations["gpu-queue"] = "true"
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=task.name, annotations=annotations, labels={"dag_id": "demo"}),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/airflow-task:1")],
            restart_policy="Never",
        ),
    )


def env_of(pod: Any) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env or []}


class Demo:
    def __init__(self, cluster: LocalCluster, *, fast: bool, show: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.fast = fast
        self.show = show
        # The kubernetes client's models are loosely typed; the demo handles them as Any.
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))  # type: ignore[no-untyped-call]
        self.core: Any = client.CoreV1Api(api)
        self.custom: Any = client.CustomObjectsApi(api)
        self._last_signature: object = None

    def status(self) -> status_view.Status:
        devices = self.custom.list_cluster_custom_object("vramshare.io", "v1alpha1", "gpudevices")["items"]
        reservations = self.custom.list_cluster_custom_object("vramshare.io", "v1alpha1", "gpureservations")[
            "items"
        ]
        # The pods too, as `vramshare status` reads them: a booking whose pod exists is shown Bound.
        listed = self.core.list_pod_for_all_namespaces(
            label_selector=LABEL_RESERVATION, _preload_content=False
        )
        pods = json.loads(listed.data)["items"]
        return status_view.from_objects(devices, reservations, now=time.time(), pods=pods)

    def simulate_usage(self) -> None:
        """Fake GPUs use what their running pods booked (90% of it), as real tasks would: only once a
        pod's container started (a booking is Bound from the moment its pod exists, before it runs)."""
        current = self.status()
        listed = self.core.list_pod_for_all_namespaces(
            label_selector=LABEL_RESERVATION, field_selector="status.phase=Running", _preload_content=False
        )
        running = {
            (p["metadata"]["namespace"], p["metadata"]["labels"][LABEL_RESERVATION])
            for p in json.loads(listed.data)["items"]
        }
        for gpu in current.gpus:
            if gpu.state == "Missing":
                continue
            booked = sum(
                r.mib
                for r in current.reservations
                if r.gpu_uuid == gpu.uuid and r.phase == "Bound" and (r.namespace, r.name) in running
            )
            self.cluster.exporter.set_used(gpu.uuid, int(booked * 0.9))

    def _settled(self) -> bool:
        """The inventory counts exactly the active reservations (the controller polls every second)."""
        current = self.status()
        for gpu in current.gpus:
            booked = sum(
                r.mib
                for r in current.reservations
                if r.gpu_uuid == gpu.uuid and r.phase in ("Reserved", "Bound")
            )
            if gpu.reserved_mib != booked:
                return False
        return True

    def table(self, title: str, *, force: bool = True) -> None:
        """Show the tables once the inventory has caught up (unless `force`, only when they changed)."""
        self.simulate_usage()
        deadline = time.monotonic() + 5
        while not self._settled() and time.monotonic() < deadline:
            time.sleep(0.2)
        current = self.status()
        signature = (
            tuple((r.name, r.phase) for r in current.reservations),
            tuple((g.uuid, g.used_mib, g.reserved_mib) for g in current.gpus),
        )
        if not force and signature == self._last_signature:
            return
        self._last_signature = signature
        self.show(f"\n== {title} ==\n{status_view.render(current)}\n")

    def wait(self, seconds: float, title: str) -> None:
        """Let time pass, showing the tables whenever they change."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            self.table(title, force=False)

    def create(self, task: Task) -> Any:
        return self.core.create_namespaced_pod(NAMESPACE, pod_for(task))

    def run(self) -> Outcome:
        outcome = Outcome()
        first_wave, too_big, no_gpu = tasks(self.fast)
        self.cluster.wait_for(
            lambda: len(self.status().gpus) == len(self.cluster.settings.fleet.all_gpus()),
            what="the controller's GPU inventory",
            timeout_s=60,
        )
        self.table("The fleet as DCGM reports it (2 x A100 40 GB on gpu-node-a, 3 x T4 16 GB on gpu-node-b)")

        self.show(
            "\n-- Airflow schedules six GPU tasks (KubernetesPodOperator, annotations={'gpu-mem-mb': ...}) --"
        )
        for task in first_wave:
            pod = self.create(task)
            env = env_of(pod)
            a = pod.metadata.annotations
            outcome.admitted[task.name] = {
                "gpu": a[ANNOTATION_GPU_UUID],
                "node": a[ANNOTATION_NODE],
                "reservation": a[ANNOTATION_RESERVATION],
                "visible_devices": env.get("NVIDIA_VISIBLE_DEVICES", ""),
                "cuda_devices": env.get("CUDA_VISIBLE_DEVICES", ""),
            }
            self.show(
                f"admitted {task.name:<14} {task.mib:>6} MiB -> {a[ANNOTATION_NODE]} GPU "
                f"{a['vramshare.io/gpu-index']} ({status_view.short_uuid(a[ANNOTATION_GPU_UUID])}), "
                f"NVIDIA_VISIBLE_DEVICES={env.get('NVIDIA_VISIBLE_DEVICES')} "
                f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}"
            )
        self.table("Six tasks placed by memory")

        self.show(f"\n-- Airflow schedules {too_big.name} asking {too_big.mib} MiB --")
        try:
            self.create(too_big)
            raise RuntimeError(f"{too_big.name} was admitted, but no GPU should have had room")
        except ApiException as exc:
            message = json.loads(str(exc.body))["message"]
            outcome.refused[too_big.name] = message
            self.show(f"refused with HTTP {exc.status}; the task log reads:\n  {message}")

        self.show(f"\n-- A task without a GPU request ({no_gpu.name}) --")
        hidden = self.create(no_gpu)
        outcome.hidden_pod_env = env_of(hidden).get("NVIDIA_VISIBLE_DEVICES")
        self.show(
            f"{no_gpu.name}: NVIDIA_VISIBLE_DEVICES={outcome.hidden_pod_env} (CUDA images default to 'all')"
        )

        self.show("\n-- A tenant tries to point a running task at every GPU of its node --")
        target = first_wave[0].name
        try:
            self.core.patch_namespaced_pod(
                target, NAMESPACE, {"metadata": {"annotations": {"vramshare.io/gpu-uuid": "all"}}}
            )
            raise RuntimeError(f"{target}'s GPU was changed after admission")
        except ApiException as exc:
            outcome.tamper_refusal = json.loads(str(exc.body))["message"]
            self.show(f"refused by the chart's policy (HTTP {exc.status}):\n  {outcome.tamper_refusal}")

        self.show(
            "\n-- Tasks finish and release their memory;"
            " Airflow retries the refused task after its retry_delay --"
        )
        retry_delay = 2.0 if self.fast else 6.0
        deadline = time.monotonic() + (60 if self.fast else 180)
        while outcome.retry_admitted is None:
            self.wait(retry_delay, "Tasks running and finishing")
            outcome.retry_attempts += 1
            try:
                pod = self.create(too_big)
            except ApiException as exc:
                best = json.loads(str(exc.body))["message"].split("; ")[1].split(".")[0]
                self.show(f"retry {outcome.retry_attempts} of {too_big.name}: still refused ({best})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{too_big.name} was never admitted") from exc
                continue
            a = pod.metadata.annotations
            outcome.retry_admitted = {"gpu": a[ANNOTATION_GPU_UUID], "node": a[ANNOTATION_NODE]}
            self.show(
                f"retry {outcome.retry_attempts} of {too_big.name}: admitted -> {a[ANNOTATION_NODE]} GPU "
                f"{a['vramshare.io/gpu-index']} ({status_view.short_uuid(a[ANNOTATION_GPU_UUID])})"
            )

        short = [t.name for t in first_wave if t.name != "train-bert"]

        def released() -> bool:
            phases = {r.pod: r.phase for r in self.status().reservations}
            return all(phases.get(name) == "Released" for name in short)

        self.cluster.wait_for(released, what="finished tasks to release their memory", timeout_s=60)
        outcome.released = short

        def retried_bound() -> bool:
            return any(r.pod == too_big.name and r.phase == "Bound" for r in self.status().reservations)

        self.cluster.wait_for(retried_bound, what=f"{too_big.name} to be bound", timeout_s=30)
        self.queue_mode(outcome, Task(name="train-queued", mib=too_big.mib, run_s=too_big.run_s))
        self.table("Final state")
        outcome.final = self.status()
        return outcome

    def queue_mode(self, outcome: Outcome, task: Task) -> None:
        """A task in queue mode waits behind a scheduling gate instead of failing its try."""
        self.show(
            f"\n-- Airflow schedules {task.name} asking {task.mib} MiB in queue mode "
            "(annotations={'gpu-queue': 'true'}): no GPU has room, so it waits instead of failing --"
        )
        pod = self.core.create_namespaced_pod(NAMESPACE, pod_for(task, queue=True))
        gates = [g.name for g in pod.spec.scheduling_gates or []]
        outcome.queued["gated"] = bool(gates)
        self.show(f"admitted behind scheduling gate {', '.join(gates)}; its reservation is Queued")

        def position() -> int | None:
            return next(
                (
                    r.queue_position
                    for r in self.status().reservations
                    if r.pod == task.name and r.queue_position
                ),
                None,
            )

        outcome.queued["position"] = eventually(position, what="a queue position", timeout_s=30)
        self.table("Queued: it holds a place, no memory")
        started = time.monotonic()

        def placed() -> Any:
            self.table("Waiting for memory to free", force=False)  # DCGM follows the tasks that run
            current = self.core.read_namespaced_pod(task.name, NAMESPACE)
            return not current.spec.scheduling_gates and current

        current = eventually(placed, what=f"{task.name} to be placed", timeout_s=60, interval_s=1)
        a = current.metadata.annotations
        outcome.queued |= {"gpu": a[ANNOTATION_GPU_UUID], "waited_s": round(time.monotonic() - started, 1)}
        self.show(
            f"placed by the controller after {outcome.queued['waited_s']:.0f} s -> {a[ANNOTATION_NODE]} GPU "
            f"{a['vramshare.io/gpu-index']} ({status_view.short_uuid(a[ANNOTATION_GPU_UUID])}); gate lifted, "
            "no try spent"
        )


SHORTENED_SHARED = {
    "VRAMSHARE_SETTLE_S": (
        "3",
        "60",
        "the demo's tasks start and allocate in a second, so DCGM shows their memory at once",
    ),
}
"""Settings both components read, shortened for the demo: (value, product default, why). Given to the
webhook and the controller alike, so they never judge the same GPU differently."""
SHORTENED_CONTROLLER = {
    "VRAMSHARE_POLL_INTERVAL_S": ("1", "5", "the tables refresh every second"),
    "VRAMSHARE_LIFECYCLE_INTERVAL_S": ("1", "10", "a finished task's booking is released within a second"),
}
"""The controller's own settings, shortened for the demo. Everything else runs with the defaults."""


def demo_env() -> tuple[dict[str, str], dict[str, str]]:
    """(the webhook's environment, the controller's) for the demo."""
    shared = {k: v for k, (v, _, _) in SHORTENED_SHARED.items()}
    quiet = {"VRAMSHARE_LOG_LEVEL": "warning"}  # the demo prints tables; the logs are in its work folder
    controller = {k: v for k, (v, _, _) in SHORTENED_CONTROLLER.items()}
    return {**shared, **quiet}, {**shared, **controller, **quiet}


def shortened_note() -> str:
    rows = {**SHORTENED_SHARED, **SHORTENED_CONTROLLER}
    return "settings shortened for the demo (everything else is the product's default): " + "; ".join(
        f"{k}={v} (default {default}: {why})" for k, (v, default, why) in rows.items()
    )


def start_vramshare(cluster: LocalCluster) -> None:
    """Webhook and controller on the local control plane, managing the demo namespace."""
    webhook_env, controller_env = demo_env()
    port = start_webhook(cluster, name="webhook", env=webhook_env)[1]
    cluster.apply_objects([webhook_configuration(cluster, ports={SHARD: port})])
    # Protected as an installed cluster is: the chart's own admission policies, and the controller
    # running as the ServiceAccount they let place queued pods.
    cluster.apply_objects(chart_admission_policies(cluster))
    start_controller(cluster, name="controller", env=controller_env, kubeconfig=controller_identity(cluster))
    managed = {"vramshare-e2e/shard": SHARD, "vramshare.io/managed": "true"}
    cluster.apply_objects(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": managed}}]
    )


def run_demo(*, fast: bool, keep: bool, show: Callable[[str], None] = print) -> Outcome:
    show(
        "vramshare demo: starting the local control plane (the first run builds it from source; "
        "progress below)"
    )
    cluster = LocalCluster.start(settings=ClusterSettings())
    try:
        start_vramshare(cluster)
        show(shortened_note())
        outcome = Demo(cluster, fast=fast, show=show).run()
        show(
            f"\nDone: {len(outcome.admitted)} tasks admitted and placed, {len(outcome.refused)} refused with "
            f"a message (its memory held for its next try), {len(outcome.released)} released, the refused "
            f"task admitted on retry {outcome.retry_attempts}, a queued task placed after "
            f"{outcome.queued['waited_s']:.0f} s without a refusal, a CPU task hidden from GPUs."
        )
        if keep:
            show(
                "\nKEEP=1: everything stays up. Try:\n"
                f"  export KUBECONFIG={cluster.kubeconfig}\n"
                f"  {cluster.bin_dir / 'kubectl'} get gpudevices,gpures -A\n"
                f"  .venv/bin/vramshare status\n"
                f"  {cluster.bin_dir / 'kubectl'} get validatingadmissionpolicies,mutatingadmissionpolicies"
                "   # the chart's own\n"
                "Ctrl-C stops everything."
            )
            wait_for_signal()
        return outcome
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fast", action="store_true", help="short task durations (as in the tests)")
    parser.add_argument(
        "--real-node",
        action="store_true",
        help="vramshare installed by its Helm chart on two real nodes (kubelet + containerd), a GPU pod run",
    )
    args = parser.parse_args(argv)
    keep = os.environ.get("KEEP", "") not in ("", "0", "false")
    try:
        if args.real_node:
            from vramshare_e2e.demo_real_node import run_real_node_demo

            run_real_node_demo(keep=keep, show=lambda text: print(text, flush=True))
            return
        run_demo(fast=args.fast, keep=keep, show=lambda text: print(text, flush=True))
    except Exception as exc:
        print(f"vramshare demo failed: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
