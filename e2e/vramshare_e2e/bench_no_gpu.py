"""The admission benchmark's no-GPU phase: pods that ask for no GPU memory, with no vramshare webhook, with
the webhook hiding the GPUs, and with the in-process hiding policy, in rotating rounds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vramshare_e2e.bench_measure import (
    SETTLE_S,
    clean_namespaces,
    create_pods,
    latency_stats,
    ratios,
)
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import hide_gpus_policy

WARM_UP = 16
"""Pods created untimed before each case of `no_gpu_phase`."""


NO_GPU_ROUNDS = 4
"""Rounds of `no_gpu_phase`: each case runs once in each of the four positions."""


CLEANUP_SETTLE_S = 10.0
"""After a round's pods are gone, before the next round: deleting some 2000 pods keeps the API server
and kwok busy for a while after the last is gone."""


def no_gpu_phase(
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
        clean_namespaces(cluster, spaces)
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
        "unmanaged_vs_no_webhook": ratios(best["unmanaged"], best["no_webhook"]),
        "hidden_vs_no_webhook": ratios(best["hidden"], best["no_webhook"]),
        "hidden_in_process_vs_no_webhook": ratios(best["hidden_in_process"], best["no_webhook"]),
        "runs": runs,
    }


def _visible_devices(pod: Any) -> list[str]:
    return [e.value for c in pod.spec.containers for e in c.env or [] if e.name == "NVIDIA_VISIBLE_DEVICES"]
