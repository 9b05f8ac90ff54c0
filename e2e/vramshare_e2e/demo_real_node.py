"""`make demo REAL_NODE=1`: vramshare as an operator installs it, beside NVIDIA's device plugin.

Two real nodes (kubelet and containerd on this machine); the second runs NVIDIA's own device plugin on
the mock NVML with three GPUs, as a GPU Operator node does. `helm install` of the chart; vramshare holds
a GPU of that node through the plugin (a holder pod), a whole-GPU job asks the plugin for a GPU, and two
Airflow-style tasks share vramshare's held GPU by memory. Each container prints the GPU it got; the demo
prints which pod has which GPU and who handed it out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from vramshare.kube.holders import ANNOTATION_HELD_GPU, HOLDER_SELECTOR
from vramshare.kube.resources import ANNOTATION_GPU_UUID
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.node_gpus import DevicePluginSetup
from vramshare_e2e.node_images import TASK_IMAGE
from vramshare_e2e.process import eventually, wait_for_signal
from vramshare_e2e.real_cluster import NAMESPACE as SYSTEM
from vramshare_e2e.real_cluster import RELEASE, real_cluster

TASKS, JOBS = "airflow", "training"
SCRIPT = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|VRAMSHARE_FAKE_GPU_)' | sort; sleep 3600"


def _pod(name: str, namespace: str, *, mib: int | None = None, whole: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": TASK_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", SCRIPT],
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
    }
    if whole:
        container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        spec["runtimeClassName"] = "nvidia"
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if mib is not None:  # on the real nodes' H100s, not the kwok nodes' (their pods run no container)
        meta["annotations"] = {"gpu-mem-mb": str(mib), "gpu-model": "NVIDIA H100*"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json"))


def _gpu_in_log(cluster: LocalCluster, namespace: str, name: str) -> str:
    log = cluster.kubectl("logs", "-n", namespace, name, check=False)
    return next(
        (line.split("=", 1)[1] for line in log.splitlines() if line.startswith("VRAMSHARE_FAKE_GPU_")), ""
    )


def run_real_node_demo(*, keep: bool, show: Callable[[str], None] = print) -> dict[str, str]:
    """Returns pod -> the GPU its container printed."""
    show(
        "vramshare demo on real nodes beside NVIDIA's device plugin: kubelet + containerd on this machine, "
        "the chart's pods on them (the first run builds the binaries and the image; progress below)"
    )
    with real_cluster(
        nodes=2,
        gpus=[1, 3],
        device_plugins={2: DevicePluginSetup(), 3: DevicePluginSetup()},  # every GPU node, as the Operator
        managed=(TASKS,),
        values=[
            "--set",
            "controller.gpuHolders.hostNetwork=true",
            "--set",
            "controller.settings.poll_interval_s=2",
        ],
    ) as real:
        cluster = real.cluster
        cluster.kubectl("create", "namespace", JOBS)
        whole_node = real.nodes[1].name
        for node in real.nodes:
            show(
                f"node {node.name}: NVIDIA's device plugin advertises nvidia.com/gpu: "
                f"{node.advertised_gpus()}"
            )

        def holders() -> list[dict[str, Any]]:
            items: list[dict[str, Any]] = _json(cluster, "pods", "-n", SYSTEM, "-l", HOLDER_SELECTOR)["items"]
            return items

        def held() -> dict[str, dict[str, Any]]:
            return {
                p["metadata"]["annotations"][ANNOTATION_HELD_GPU]: p
                for p in holders()
                if p["status"].get("phase") == "Running"
                and ANNOTATION_HELD_GPU in (p["metadata"].get("annotations") or {})
            }

        eventually(lambda: len(held()) == 2, what="vramshare to hold a GPU on each node", timeout_s=120)

        def ready(uuids: set[str]) -> bool:
            devices = _json(cluster, "gpudevices")["items"]
            return uuids <= {
                d["spec"]["uuid"] for d in devices if (d.get("status") or {}).get("state") == "Ready"
            }

        eventually(lambda: ready(set(held())), what="the held GPUs Ready for bookings", timeout_s=60)
        show("\n" + cluster.kubectl("get", "pods", "-n", SYSTEM, "-o", "wide"))
        show(
            "\nkubectl create: a whole-GPU training job (nvidia.com/gpu: 1) on "
            f"{whole_node} and two tasks (gpu-mem-mb 20000 each)"
        )
        job = _pod("job", JOBS, whole=True)
        job["spec"]["nodeSelector"] = {"kubernetes.io/hostname": whole_node}
        cluster.kubectl("create", "-f", "-", stdin=json.dumps(job))
        for name in ("task-1", "task-2"):
            cluster.kubectl("create", "-f", "-", stdin=json.dumps(_pod(name, TASKS, mib=20_000)))
        pods = [("job", JOBS), ("task-1", TASKS), ("task-2", TASKS)]
        for name, namespace in pods:
            eventually(
                lambda n=name, ns=namespace: _gpu_in_log(cluster, ns, n),  # type: ignore[misc]
                what=f"{namespace}/{name} to print its GPU",
                timeout_s=120,
            )
        # A node whose idle held GPU a task booked holds another, where its plugin has one free.
        with contextlib.suppress(AssertionError):
            eventually(lambda: len(holders()) > 2, what="another hold", timeout_s=20)
            eventually(lambda: len(held()) == len(holders()), what="the holds taken", timeout_s=30)
        holds = held()
        rows = [f"  {'node':<11} {'pod':<34} {'GPU':<42} handed out by"]
        got = {}
        for name, namespace in pods:
            pod = _json(cluster, "pod", "-n", namespace, name)
            gpu = got[f"{namespace}/{name}"] = _gpu_in_log(cluster, namespace, name)
            if namespace == JOBS:
                who = "NVIDIA's device plugin, whole"
            else:
                booked = pod["metadata"]["annotations"][ANNOTATION_GPU_UUID]
                ok = booked == gpu and gpu in holds
                who = "vramshare, by memory, on a GPU it holds" if ok else f"WRONG: booked {booked}"
            rows.append(f"  {pod['spec']['nodeName']:<11} {namespace + '/' + name:<34} {gpu:<42} {who}")
        for gpu, holder in sorted(holds.items(), key=lambda kv: str(kv[1]["spec"]["nodeName"])):
            rows.append(
                f"  {holder['spec']['nodeName']:<11} {SYSTEM + '/' + holder['metadata']['name']:<34} "
                f"{gpu:<42} NVIDIA's device plugin, to vramshare's holder"
            )
        show("\nwho has which GPU:\n" + "\n".join(rows))
        per_node: dict[str, int] = {}
        for holder in holds.values():
            per_node[holder["spec"]["nodeName"]] = per_node.get(holder["spec"]["nodeName"], 0) + 1
        waiting = sum(p["status"].get("phase") == "Pending" for p in holders())
        show(
            "vramshare holds "
            + ", ".join(f"{n} GPU{'s' if n > 1 else ''} on {node}" for node, n in sorted(per_node.items()))
            + f" (its tasks' and an idle one per node, kept warm); {waiting} holder(s) wait for a free GPU"
        )
        job_gpu = got[f"{JOBS}/job"]
        verdict = "held by vramshare: WRONG" if job_gpu in holds else "not one vramshare holds"
        show(f"the job's GPU {job_gpu} is {verdict}")
        show(
            "\n"
            + cluster.kubectl("describe", "node", whole_node)
            .split("Allocated resources:")[1]
            .split("Events:")[0]
        )
        if keep:
            show(
                "\nKEEP=1: everything stays up. Try:\n"
                f"  export KUBECONFIG={cluster.kubeconfig}\n"
                f"  {cluster.bin_dir / 'kubectl'} get nodes,pods -A -o wide\n"
                f"  {cluster.bin_dir / 'kubectl'} get gpudevices,gpures -A\n"
                f"  {cluster.bin_dir / 'helm'} test {RELEASE} -n {SYSTEM} --logs\n"
                "Ctrl-C stops everything."
            )
            wait_for_signal()
        return got
