"""One phase of the admission benchmark: a batch of pods created at a concurrency level, and what the
cluster spent on it (API requests and CPU per pod, per component, while the pods were created and in
all), optionally with the scheduler held while they are created (`hold_scheduler`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vramshare_e2e.bench_measure import (
    SETTLE_S,
    api_requests,
    cpu_seconds,
    create_pods,
    machine_cpu_seconds,
)
from vramshare_e2e.cluster import LocalCluster

SETTLE_TIMEOUT_S = 60.0
"""How long a phase waits for its pods to run before it is counted anyway (and says how many did not)."""

SCHEDULER = "kube-scheduler"


@dataclass(frozen=True, kw_only=True)
class PhaseResult:
    latencies: list[float]
    wall_s: float
    errors: int
    cost: dict[str, Any]
    """Per pod: API requests by resource and verb, CPU ms by component (in all, and while the pods were
    created), the whole machine's CPU while creating and after."""


class _Phase:
    """What the cluster spent on one phase of pods: API requests and CPU, per pod."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.requests = api_requests(cluster)
        self.cpu = cpu_seconds(cluster)
        self.machine = machine_cpu_seconds()
        self.machine_created: float | None = None
        self.cpu_created: dict[str, float] | None = None
        self.polls = 0
        """The phase's own LISTs of pods (`settle`), left out of its count."""
        self.not_running = 0

    def created(self) -> None:
        """The phase's last pod is created: what the machine spent from here on is the work that
        followed the creations (bindings, kwok's status, events, vramshare's controller)."""
        self.machine_created = machine_cpu_seconds()
        self.cpu_created = cpu_seconds(self.cluster)

    def settle(self, core: Any, namespaces: list[str]) -> None:
        """Wait until every pod of the phase runs (scheduled, bound, its status written by kwok), then
        `SETTLE_S` more for what follows (events; vramshare's controller binding the booking), so
        that a phase's work is counted in that phase. A fixed wait alone did not do it: the faster
        phases' pods were created quicker than the scheduler binds (its client is rate limited), and
        up to a fifth of their bindings, kwok's status writes and events landed in the next phase
        (the one-write floor's in vramshare's) on runs of 2026-12-06."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            waiting = 0
            for namespace in namespaces:
                self.polls += 1
                listed = core.list_namespaced_pod(
                    namespace, field_selector="status.phase!=Running", resource_version="0"
                )
                waiting += len(listed.items)
            self.not_running = waiting
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(SETTLE_S)

    def per_pod(self, pods: int) -> dict[str, Any]:
        requests, cpu = api_requests(self.cluster), cpu_seconds(self.cluster)
        made = {k: v - self.requests.get(k, 0.0) for k, v in requests.items()}
        made["pods/list"] = made.get("pods/list", 0.0) - self.polls
        cost: dict[str, Any] = {
            "api_requests": {k: round(v / pods, 2) for k, v in sorted(made.items()) if v >= pods / 20},
            "api_requests_total": round(sum(made.values()) / pods, 2),
            "cpu_ms": {k: round((v - self.cpu.get(k, 0.0)) * 1000 / pods, 2) for k, v in cpu.items()},
        }
        if self.cpu_created is not None:
            # Latency and throughput follow what is spent here: the CPU the admission path takes
            # while the pods are created (and whatever else runs then), not what comes after.
            cost["cpu_ms_while_creating"] = {
                k: round((v - self.cpu.get(k, 0.0)) * 1000 / pods, 2) for k, v in self.cpu_created.items()
            }
        if self.machine_created is not None:
            # The latency and throughput of a phase follow the CPU spent while its pods are created:
            # both phases keep the machine busy, and a faster phase leaves more of its follow-up
            # work (the scheduler's bindings, at its client's rate limit) until after.
            cost["machine_cpu_ms"] = {
                "while_creating": round((self.machine_created - self.machine) * 1000 / pods, 2),
                "after": round((machine_cpu_seconds() - self.machine_created) * 1000 / pods, 2),
            }
        if self.not_running:
            cost["pods_not_running"] = self.not_running
        return cost


@contextlib.contextmanager
def scheduler_held(cluster: LocalCluster, *, hold: bool) -> Iterator[None]:
    """With `hold`, the kube-scheduler is stopped (SIGSTOP) for the block and continued after it,
    whatever happens: no pod is bound while the block creates pods, so their bindings, kwok's status
    writes and the events that follow land after it in every phase alike. Without the hold the
    faster phase leaves more of that work until after its pods are created (the scheduler's client is
    rate limited), and its latency and throughput are measured on a less busy machine."""
    process = cluster.component(SCHEDULER).process if hold else None
    if process is None:
        yield
        return
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


def run_phase(
    cluster: LocalCluster,
    core: Any,
    *,
    namespaces: list[str],
    pods: int,
    concurrency: int,
    annotated: bool,
    tag: str,
    hold_scheduler: bool = False,
) -> PhaseResult:
    """Create `pods` pods in `namespaces` at `concurrency`, wait until they run (and what follows has
    landed), and count what that cost."""
    phase = _Phase(cluster)
    with scheduler_held(cluster, hold=hold_scheduler):
        latencies, wall, errors = create_pods(core, namespaces, pods, concurrency, annotated, tag)
        phase.created()
    # What follows each pod's creation (scheduling, kwok's status, vramshare's controller binding the
    # booking) is counted too: each phase's count waits for it to land.
    phase.settle(core, namespaces)
    return PhaseResult(latencies=latencies, wall_s=wall, errors=errors, cost=phase.per_pod(pods))
