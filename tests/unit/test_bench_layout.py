"""The admission benchmark's split layout (`--split-cores`): which component gets which CPUs, and the
pinning itself on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramshare_e2e.bench_measure import is_workload, pin, split_cores

STACK = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "fake-dcgm-exporter",
    "prometheus",
    "webhook-a",
    "webhook-b",
    "e2e-one-write-0",
    "e2e-one-write-1",
    "e2e-pinned-0",
    "e2e-pinned-1",
    "controller",
]


def test_the_workloads_are_vramshare_and_the_benchmarks_webhooks_not_the_control_plane() -> None:
    assert [c for c in STACK if is_workload(c)] == [
        "webhook-a",
        "webhook-b",
        "e2e-one-write-0",
        "e2e-one-write-1",
        "e2e-pinned-0",
        "e2e-pinned-1",
        "controller",
    ]
    assert not is_workload("kube-controller-manager")


def test_the_cluster_gets_the_first_half_and_the_workloads_and_the_load_generator_the_rest() -> None:
    plan, generator = split_cores(STACK, [1, 0])
    assert generator == (1,)
    assert plan["kube-apiserver"] == plan["etcd"] == plan["kwok"] == (0,)
    assert plan["webhook-a"] == plan["controller"] == plan["e2e-one-write-0"] == (1,)
    plan, generator = split_cores(STACK, [0, 1, 2, 3, 4])
    assert plan["kube-apiserver"] == (0, 1)
    assert plan["webhook-b"] == generator == (2, 3, 4)


def test_one_cpu_cannot_be_split_and_the_message_says_so() -> None:
    expected = r"--split-cores needs at least 2 CPUs; this process may use 1 \(\[3\]\)"
    with pytest.raises(ValueError, match=expected):
        split_cores(STACK, [3])


def allowed(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    line = next(x for x in status if x.startswith("Cpus_allowed_list"))
    out: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def test_pinning_reaches_every_thread_and_the_processes_a_wrapper_started() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    target = (cpus[-1],)
    # A wrapper (a shell) whose child runs a second thread, as a component under `timeout` would.
    script = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    wrapper = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{script}"; true'])
    try:
        for _ in range(100):
            children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == wrapper.pid]
            if children and len(os.listdir(f"/proc/{children[0]}/task")) >= 2:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        (child,) = (int(p) for p in children)
        pin(wrapper.pid, target)
        assert allowed(wrapper.pid) == {target[0]}
        tasks = [int(t) for t in os.listdir(f"/proc/{child}/task")]
        assert len(tasks) == 2
        assert all(set(os.sched_getaffinity(t)) == {target[0]} for t in tasks)
        assert len(cpus) == 1 or allowed(os.getpid()) != {target[0]}  # this process is left alone
    finally:
        subprocess.run(["pkill", "-P", str(wrapper.pid)], check=False)
        wrapper.kill()
        wrapper.wait()


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except OSError:
        return -1
