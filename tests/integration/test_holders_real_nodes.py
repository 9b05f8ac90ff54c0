"""vramshare beside NVIDIA's device plugin on real nodes (issue #43): two kubelets with containerd, each
running NVIDIA's own device plugin (k8s-device-plugin, built from its module) on the mock NVML, and
vramshare installed by its chart in mode hold. The first node's plugin time-slices its GPU (4 replicas);
the second hands its three GPUs out whole.

vramshare's holder pods request nvidia.com/gpu: 1 through the scheduler and the plugin, read their GPU
through NVML in their container (NVIDIA's runtime mounts the mock library and the GPU's file, as it
mounts the driver's library and device node), and write its UUID on themselves. The tests look from
outside only: pods, their logs, GpuDevices, events, the Node and a ResourceQuota.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from vramshare.kube.holders import ANNOTATION_HELD_GPU, HOLDER_SELECTOR
from vramshare.kube.resources import ANNOTATION_GPU_UUID
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.fleet import stable_gpu_uuid
from vramshare_e2e.node import RealNode
from vramshare_e2e.node_gpus import DevicePluginSetup
from vramshare_e2e.node_images import TASK_IMAGE
from vramshare_e2e.node_network import node_address
from vramshare_e2e.process import ClusterError, eventually
from vramshare_e2e.real_cluster import NAMESPACE, RealCluster, real_cluster

pytestmark = pytest.mark.cluster

SLICED, WHOLE = node_address(4), node_address(5)
"""Not 2 and 3: test_real_node_e2e's nodes, whose module may run at the same time on another worker."""
GPUS = {SLICED: [stable_gpu_uuid(SLICED, 0)], WHOLE: [stable_gpu_uuid(WHOLE, i) for i in range(3)]}
TASKS, OPEN = "tasks", "open"
"""TASKS is managed (vramshare's GPU tasks); OPEN is not (pods asking NVIDIA's plugin for whole GPUs)."""
IDLE_RELEASE_S = 15


@dataclass
class Stack:
    real: RealCluster

    @property
    def cluster(self) -> LocalCluster:
        return self.real.cluster

    def node(self, name: str) -> RealNode:
        return next(n for n in self.real.nodes if n.name == name)

    def get(self, *args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.cluster.kubectl("get", *args, "-o", "json"))
        return out

    def holders(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("pods", "-n", NAMESPACE, "-l", HOLDER_SELECTOR)["items"]
        return items

    def held(self) -> dict[str, str]:
        """GPU -> the running holder pod that wrote it on itself."""
        return {
            p["metadata"]["annotations"][ANNOTATION_HELD_GPU]: p["metadata"]["name"]
            for p in self.holders()
            if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
            and ANNOTATION_HELD_GPU in (p["metadata"].get("annotations") or {})
        }

    def devices(self) -> dict[str, dict[str, Any]]:
        """GPU -> its status, with `message`: its Ready condition's (why it is not shared, for one)."""
        out = {}
        for device in self.get("gpudevices")["items"]:
            status = dict(device.get("status") or {})
            ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
            out[device["spec"]["uuid"]] = {**status, "message": ready.get("message", "")}
        return out

    def create(self, obj: dict[str, Any]) -> tuple[bool, str]:
        try:
            return True, self.cluster.kubectl("create", "-f", "-", stdin=json.dumps(obj))
        except ClusterError as exc:
            return False, str(exc)

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.get("pod", "-n", namespace, name)

    def whole_gpu_of(self, name: str) -> str:
        """The GPU a whole-GPU pod got, as its container printed it (NVIDIA's runtime's CDI edit)."""
        log = self.cluster.kubectl("logs", "-n", OPEN, name, check=False)
        return next((line.split("=", 1)[1] for line in log.splitlines() if "VRAMSHARE_FAKE_GPU_" in line), "")

    def report(self) -> str:
        """Pods, the real nodes' GPUs with their messages, and the controllers' last words on holds."""
        mine = {u for uuids in GPUS.values() for u in uuids}
        messages = "\n".join(
            f"{u}: {d.get('state')}: {d.get('message')}" for u, d in self.devices().items() if u in mine
        )
        logs = self.cluster.kubectl(
            "logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=controller", "--tail=200", check=False
        )
        holds = "\n".join(
            line for line in logs.splitlines() if "hold" in line.lower() or "error" in line.lower()
        )
        pods = self.cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False)
        return f"{pods}\n{messages}\n{holds[-3000:]}"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    values = [
        "--set", "controller.gpuHolders.hostNetwork=true",
        "--set", f"controller.gpuHolders.idleReleaseS={IDLE_RELEASE_S}",
        "--set", "controller.settings.poll_interval_s=2",
    ]  # fmt: skip
    with real_cluster(
        nodes=2,
        gpus=[1, 3],
        device_plugins={4: DevicePluginSetup(replicas=4), 5: DevicePluginSetup()},
        first_node=4,
        managed=(TASKS,),
        values=values,
    ) as real:
        real.cluster.kubectl("create", "namespace", OPEN)
        yield Stack(real=real)
    left = [thing for node in real.nodes for thing in node.leftovers()]
    assert not left, f"the real nodes left {len(left)} things behind: {left[:10]}"


def whole_gpu_pod(name: str) -> dict[str, Any]:
    """A pod asking NVIDIA's device plugin for a whole GPU, as a training job or notebook does."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": OPEN},
        "spec": {
            "runtimeClassName": "nvidia",
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": WHOLE},
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "job",
                    "image": TASK_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "env | grep VRAMSHARE_FAKE_GPU_; sleep 3600"],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def task(name: str, mib: int) -> dict[str, Any]:
    """A vramshare GPU task (an Airflow task pod's shape): memory by annotation, no nvidia.com/gpu."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": TASKS, "annotations": {"gpu-mem-mb": str(mib)}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "task",
                    "image": TASK_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "env | grep VRAMSHARE_FAKE_GPU_; sleep 3600"],
                }
            ],
        },
    }


def booked_gpu(stack: Stack, name: str) -> str:
    return str(stack.pod(TASKS, name)["metadata"]["annotations"][ANNOTATION_GPU_UUID])


def test_vramshare_holds_one_idle_gpu_per_whole_gpu_node_and_the_cluster_counts_it(stack: Stack) -> None:
    held = eventually(stack.held, what="a GPU held", timeout_s=90, detail=stack.report)
    assert len(held) == 1, held
    [uuid] = held
    assert uuid in GPUS[WHOLE]

    def ready_with_the_rest() -> dict[str, dict[str, Any]] | None:
        devices = stack.devices()
        return devices if devices.get(uuid, {}).get("state") == "Ready" else None

    devices = eventually(
        ready_with_the_rest,
        what="the held GPU Ready",
        timeout_s=30,
        detail=stack.report,
    )
    for other in set(GPUS[WHOLE]) - {uuid}:
        assert devices[other]["state"] == "NotShared"
        assert devices[other]["message"].startswith("not held: node"), devices[other]["message"]
    sliced = devices[GPUS[SLICED][0]]
    assert sliced["state"] == "NotShared"
    assert "hands each GPU to 4 pods (time-slicing or MPS replicas)" in sliced["message"]
    assert not [h for h in stack.holders() if h["metadata"]["labels"]["holder.vramshare.io/node"] == SLICED]
    # The scheduler, kubectl and quotas count the hold: it is an ordinary nvidia.com/gpu pod.
    described = stack.cluster.kubectl("describe", "node", WHOLE).split("Allocated resources:")[1]
    assert next(line.split() for line in described.splitlines() if "nvidia.com/gpu" in line)[:3] == [
        "nvidia.com/gpu",
        "1",
        "1",
    ]
    stack.cluster.apply_objects(
        [
            {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {"name": "gpus", "namespace": NAMESPACE},
                "spec": {"hard": {"requests.nvidia.com/gpu": "8"}},
            }
        ]
    )
    eventually(
        lambda: (
            stack.get("resourcequota", "-n", NAMESPACE, "gpus")
            .get("status", {})
            .get("used", {})
            .get("requests.nvidia.com/gpu")
            == "1"
        ),
        what="the ResourceQuota counting the held GPU",
        timeout_s=30,
    )


def running(stack: Stack, namespace: str, name: str) -> bool:
    return bool(stack.pod(namespace, name)["status"].get("phase") == "Running")


def never_shared(
    stack: Stack, jobs: list[str], tasks: list[str]
) -> tuple[dict[str, str], set[str], dict[str, str]]:
    """The invariant: the GPUs whole-GPU jobs run on, the GPUs tasks are booked on and the GPUs vramshare
    holds; no job's GPU is booked or held, every booked GPU is held (while its holder lives)."""
    booked = {booked_gpu(stack, t) for t in tasks}
    held = stack.held()
    on = {
        j: eventually(lambda j=j: stack.whole_gpu_of(j), what=f"{j}'s GPU", timeout_s=30)
        for j in jobs
        if running(stack, OPEN, j)
    }  # type: ignore[misc]
    assert not set(on.values()) & booked, (on, booked)
    assert not set(on.values()) & set(held), (on, held)
    assert booked <= set(held), (booked, held)
    return on, booked, held


def settle_to_one_hold(stack: Stack) -> float:
    """Wait until the idle surplus is given back: one holder left, holding; the seconds it took."""
    started = time.monotonic()

    def one_left() -> bool:
        holders = [h for h in stack.holders() if not h["metadata"].get("deletionTimestamp")]
        return len(holders) == 1 and len(stack.held()) == 1

    eventually(
        one_left, what="the idle surplus given back", timeout_s=IDLE_RELEASE_S + 90, detail=stack.report
    )
    return time.monotonic() - started


def test_whole_gpu_jobs_and_tasks_never_share_a_gpu_in_a_burst_of_both(stack: Stack) -> None:
    """Two whole-GPU jobs and two tasks that each fill a GPU, created at once on a node of three GPUs
    (one held): the first task takes the held GPU, the second needs another hold, which races the jobs
    for the two free GPUs. Whoever wins, no GPU is both a job's and vramshare's."""
    results: dict[str, tuple[bool, str]] = {}

    def create(name: str, obj: dict[str, Any]) -> None:
        results[name] = stack.create(obj)

    burst = {
        "job-1": whole_gpu_pod("job-1"),
        "job-2": whole_gpu_pod("job-2"),
        "task-c": task("task-c", 60_000),
    }
    threads = [threading.Thread(target=create, args=item) for item in burst.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["task-c"][0], results["task-c"]
    admitted_d = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not admitted_d:
        admitted_d, refusal = stack.create(task("task-d", 60_000))
        if not admitted_d:
            assert "not held" in refusal, refusal
            time.sleep(1)
    tasks = ["task-c", *(["task-d"] if admitted_d else [])]
    for name in tasks:
        eventually(
            lambda n=name: running(stack, TASKS, n), what=f"{name} running", timeout_s=90, detail=stack.report
        )  # type: ignore[misc]
    time.sleep(5)  # the jobs and the holders settle
    on, booked, held = never_shared(stack, ["job-1", "job-2"], tasks)
    print(f"\nburst: jobs on {on}; tasks {tasks} on {sorted(booked)}; vramshare holds {sorted(held)}")
    assert len(on) + len(held) <= 3
    stack.cluster.kubectl("delete", "pod", "-n", OPEN, "job-1", "job-2", "--wait=false")
    # The jobs gone, the waiting hold gets a GPU and the refused task's retry is admitted (its refusal
    # kept memory for it: a hold that only its admission ends).
    if not admitted_d:
        eventually(
            lambda: stack.create(task("task-d", 60_000))[0],
            what="task-d admitted once the jobs ended",
            timeout_s=90,
            interval_s=1,
            detail=stack.report,
        )
    stack.cluster.kubectl("delete", "pod", "-n", TASKS, "task-c", "task-d", "--wait=false")


def test_idle_holds_are_given_back_after_the_grace_period(stack: Stack) -> None:
    took = settle_to_one_hold(stack)
    print(f"\nidle holds given back {took:.0f} s after the burst ended (idleReleaseS {IDLE_RELEASE_S})")
    assert took >= IDLE_RELEASE_S - 5


def test_a_task_that_fits_no_held_gpu_is_refused_while_a_gpu_is_acquired_then_admitted(stack: Stack) -> None:
    """The acquire latency: from the refusal that names the hold under way to the retry admitted."""
    assert stack.create(task("task-a", 60_000))[0]
    refused_at, first_refusal = None, ""
    deadline = time.monotonic() + 120
    while True:
        ok, out = stack.create(task("task-b", 60_000))
        if ok:
            break
        refused_at = refused_at or time.monotonic()
        first_refusal = first_refusal or out
        assert time.monotonic() < deadline, f"task-b never admitted: {out}\n{stack.report()}"
        time.sleep(0.5)
    latency = time.monotonic() - refused_at if refused_at else 0.0
    print(
        f"\nacquire latency: first refusal to admission {latency:.1f} s; "
        f"the refusal: ...{first_refusal[-300:]}"
    )
    if refused_at:  # the refusal says why the GPUs it could use are not shared (held, acquiring, ...)
        assert "not shared:" in first_refusal, first_refusal
    for name in ("task-a", "task-b"):
        eventually(
            lambda n=name: running(stack, TASKS, n), what=f"{name} running", timeout_s=90, detail=stack.report
        )  # type: ignore[misc]
    never_shared(stack, [], ["task-a", "task-b"])
    assert booked_gpu(stack, "task-a") != booked_gpu(stack, "task-b")


def test_a_deleted_holder_takes_its_gpu_out_of_sharing_and_its_bookings_are_reported(stack: Stack) -> None:
    gpu = booked_gpu(stack, "task-a")
    holder = stack.held()[gpu]
    stack.cluster.kubectl("delete", "pod", "-n", NAMESPACE, holder, "--wait=false")
    events = eventually(
        lambda: [
            e
            for e in stack.get("events", "-n", "default", "--field-selector", "reason=GpuHoldLost")["items"]
            if holder in e["message"]
        ],
        what="a GpuHoldLost event",
        timeout_s=30,
        detail=stack.report,
    )
    assert f"{TASKS}/task-a" in events[0]["message"]
    assert events[0]["type"] == "Warning"
    # The task keeps running: nothing of its booking is lost.
    assert running(stack, TASKS, "task-a")
    assert booked_gpu(stack, "task-a") == gpu
    reservations = stack.get("gpureservations", "-n", TASKS)["items"]
    assert {r["status"]["phase"] for r in reservations if r["spec"]["gpuUUID"] == gpu} <= {
        "Bound",
        "Reserved",
    }
    stack.cluster.kubectl("delete", "pod", "-n", TASKS, "task-a", "task-b", "--wait=false")


def test_holds_outlive_a_device_plugin_restart_and_a_kubelet_restart(stack: Stack) -> None:
    settle_to_one_hold(stack)
    before = stack.held()
    node = stack.node(WHOLE)
    component = stack.cluster.component(node.device_plugin_component)
    component.stop()
    component.start()
    component.wait_ready(timeout_s=60)
    assert stack.held() == before
    log = stack.cluster.logs_dir / f"nvidia-device-plugin-{WHOLE}.log"

    def registrations() -> int:
        return log.read_text(errors="replace").count("Registered device plugin for 'nvidia.com/gpu'")

    before_restart = registrations()
    kubelet = stack.cluster.component(f"kubelet-{WHOLE}")
    kubelet.stop()
    kubelet.start()
    kubelet.wait_ready(timeout_s=120)
    # The plugin sees the kubelet's new socket and registers again (its own inotify watch). Until then
    # the kubelet refuses device-plugin pods (UnexpectedAdmissionError): wait for it, not for the Node
    # object, whose allocatable still says what the old kubelet wrote.
    eventually(lambda: registrations() > before_restart, what="the plugin registered again", timeout_s=60)
    eventually(lambda: node.advertised_gpus() == 3, what="nvidia.com/gpu advertised again", timeout_s=60)
    assert stack.held() == before
    # The kubelet's checkpoint kept the holder's allocation: two jobs get the two other GPUs. A job
    # the restarted kubelet refuses at admission (UnexpectedAdmissionError) is made again, as a Job's
    # controller would.
    refusals: list[str] = []

    def job_running(name: str) -> bool:
        phase = stack.pod(OPEN, name)["status"].get("phase")
        if phase == "Failed":
            refusals.append(
                stack.cluster.kubectl(
                    "get",
                    "events",
                    "-n",
                    OPEN,
                    f"--field-selector=involvedObject.name={name}",
                    "-o",
                    "jsonpath={.items[*].message}",
                )
            )
            stack.cluster.kubectl("delete", "pod", "-n", OPEN, name, "--wait=true")
            assert stack.create(whole_gpu_pod(name))[0]
        return phase == "Running"

    for name in ("job-3", "job-4"):
        assert stack.create(whole_gpu_pod(name))[0]
    for name in ("job-3", "job-4"):
        eventually(
            lambda n=name: job_running(n),
            what=f"{name} after the restarts",
            timeout_s=90,
            interval_s=1,
            detail=stack.report,
        )  # type: ignore[misc]
    if refusals:
        print(f"\nthe restarted kubelet refused {len(refusals)} job(s) at admission first: {refusals}")
    on, _, held = never_shared(stack, ["job-3", "job-4"], [])
    assert held == before
    assert len(set(on.values())) == 2
    stack.cluster.kubectl("delete", "pod", "-n", OPEN, "job-3", "job-4", "--wait=false")


def test_a_drained_node_loses_its_holds_reported_and_gets_none_until_uncordoned(stack: Stack) -> None:
    eventually(lambda: len(stack.held()) >= 1, what="a GPU held", timeout_s=60, detail=stack.report)
    assert stack.create(task("task-e", 1000))[0]
    gpu = booked_gpu(stack, "task-e")
    eventually(
        lambda: running(stack, TASKS, "task-e"), what="task-e running", timeout_s=90, detail=stack.report
    )
    # Only the holders are drained (the chart's own pods stay to watch it): evicted, as a drain does.
    stack.cluster.kubectl(
        "drain", WHOLE, "--pod-selector=app.kubernetes.io/component=gpu-holder", "--force", "--timeout=60s"
    )
    events = eventually(
        lambda: [
            e
            for e in stack.get("events", "-n", "default", "--field-selector", "reason=GpuHoldLost")["items"]
            if gpu in e["message"] and "task-e" in e["message"]
        ],
        what="a GpuHoldLost event for task-e's GPU",
        timeout_s=30,
        detail=stack.report,
    )
    assert events
    eventually(
        lambda: stack.devices()[gpu]["state"] == "NotShared", what="its GPU out of sharing", timeout_s=30
    )
    time.sleep(6)  # three polls: a cordoned node gets no new holder
    # One made just before the controller saw the cordon may wait, unscheduled; none runs, none more.
    waiting = [h for h in stack.holders() if not h["metadata"].get("deletionTimestamp")]
    assert len(waiting) <= 1, stack.report()
    assert all(h["status"].get("phase") == "Pending" and not h["spec"].get("nodeName") for h in waiting)
    assert running(stack, TASKS, "task-e")
    stack.cluster.kubectl("uncordon", WHOLE)
    eventually(
        lambda: len(stack.held()) >= 1,
        what="a GPU held again after uncordon",
        timeout_s=90,
        detail=stack.report,
    )
    stack.cluster.kubectl("delete", "pod", "-n", TASKS, "task-e", "--wait=false")


def test_a_node_dedicated_by_label_is_shared_whole_whatever_its_plugin_does(stack: Stack) -> None:
    stack.cluster.kubectl("label", "node", SLICED, "vramshare.io/dedicated=true")
    uuid = GPUS[SLICED][0]
    eventually(
        lambda: stack.devices().get(uuid, {}).get("state") == "Ready",
        what="the dedicated node's GPU Ready",
        timeout_s=30,
        detail=stack.report,
    )
