"""`make bench-packing`: how well each GPU-sharing design packs the same workload, by simulation.

A trace-driven simulator replays one seeded workload under each design. The vramshare designs call
the real domain code (`vramshare.domain.choose`); the others follow their published behaviour:

- `vramshare-spread`, `vramshare-binpack`: the headroom rule and policies, with durable reservations;
- `kaapana-like`: free memory minus an in-memory queue that is wiped at every 5 s refresh, least
  loaded first, and a fallback pass that ignores free memory;
- `whole-gpu`: one pod per GPU (`nvidia.com/gpu: 1`), the smallest idle GPU big enough;
- `time-slicing`: a fixed number of pods per GPU, memory-blind.

The model has what matters in reality:
- memory use ramps up over the first seconds of a job;
- the scheduler sees DCGM samples that are taken periodically and arrive with a scrape lag;
- every CUDA context costs extra memory, and many jobs use less than they asked;
- refused pods retry after Airflow's retry_delay;
- a GPU whose real use exceeds its memory has an OOM: its newest job dies and is retried.

    python -m vramshare_e2e.bench_packing [--smoke] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramshare.domain import (
    Accounting,
    AllocationRequest,
    AllocationSettings,
    Choice,
    Gpu,
    Policy,
    Reservation,
    ReservationPhase,
    choose,
)


@dataclass(frozen=True, kw_only=True)
class Model:
    scrape_interval_s: float = 15.0
    scrape_lag_s: float = 30.0
    ramp_s: float = 20.0
    context_mib: int = 300
    retry_delay_s: float = 60.0
    kaapana_refresh_s: float = 5.0
    time_slices: int = 4
    safety_margin_mib: int = 512
    settle_s: float = 60.0  # vramshare: covers ramp + scrape lag


@dataclass(frozen=True, kw_only=True)
class Job:
    name: str
    arrival_s: float
    asked_mib: int
    peak_mib: int
    """Real use at the end of the ramp: context + model, at most what was asked for most jobs."""
    duration_s: float


@dataclass(kw_only=True)
class Card:
    uuid: str
    node: str
    index: int
    total_mib: int
    running: list[Running] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)
    """(time, used MiB) as DCGM took them."""


@dataclass(kw_only=True)
class Running:
    job: Job
    started_s: float

    def usage(self, now: float, ramp_s: float) -> int:
        return (
            int(self.job.peak_mib * min(1.0, (now - self.started_s) / ramp_s))
            if ramp_s > 0
            else self.job.peak_mib
        )


def fleet(smoke: bool) -> list[tuple[str, int, int]]:
    """(node, count, MiB): mixed sizes, as on-prem clusters grow."""
    if smoke:
        return [("node-a", 1, 40_960), ("node-b", 2, 15_360)]
    return [("node-a", 4, 81_920), ("node-b", 4, 40_960), ("node-c", 8, 15_360)]


def workload(smoke: bool, seed: int) -> list[Job]:
    """An Airflow-like mix: many small inference tasks and a few large training tasks, as a backlog
    arriving over the first minutes (so the fleet, not the arrivals, limits the makespan)."""
    rng = random.Random(seed)
    jobs = []
    n_small, n_large = (36, 4) if smoke else (900, 60)
    window = 120.0 if smoke else 1800.0
    for i in range(n_small + n_large):
        large = i >= n_small
        asked = (
            rng.choice([16_384, 24_576, 32_768]) if large else rng.choice([1_024, 2_048, 3_072, 4_096, 6_144])
        )
        duration = rng.uniform(900, 2400) if large else rng.uniform(60, 400)
        fraction = rng.uniform(0.55, 1.0)  # many jobs use less than they asked
        peak = max(300, min(asked, int(asked * fraction)))  # within the request, CUDA context included
        jobs.append(
            Job(
                name=f"{'train' if large else 'infer'}-{i}",
                arrival_s=rng.uniform(0, window),
                asked_mib=asked,
                peak_mib=peak,
                duration_s=duration,
            )
        )
    return sorted(jobs, key=lambda j: j.arrival_s)


class Design:
    name = ""

    def __init__(self, model: Model) -> None:
        self.model = model

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        raise NotImplementedError


def observed_used(card: Card, now: float, model: Model) -> tuple[int, float]:
    """The used memory the scheduler sees at `now`: the newest sample older than the scrape lag."""
    visible = [s for s in card.samples if s[0] <= now - model.scrape_lag_s]
    return (visible[-1][1], visible[-1][0]) if visible else (0, 0.0)


class Vramshare(Design):
    def __init__(self, model: Model, policy: Policy) -> None:
        super().__init__(model)
        self.name = f"vramshare-{policy.value}"
        self.settings = AllocationSettings(
            policy=policy,
            accounting=Accounting(
                safety_margin_mib=model.safety_margin_mib, settle_s=model.settle_s, max_sample_age_s=1e9
            ),
        )

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        gpus, reservations = [], []
        for c in cards:
            used, at = observed_used(c, now, self.model)
            gpus.append(
                Gpu(
                    uuid=c.uuid,
                    node=c.node,
                    index=c.index,
                    model="sim",
                    total_mib=c.total_mib,
                    used_mib=used,
                    free_mib=c.total_mib - used,
                    sampled_at=at,
                )
            )
            reservations += [
                Reservation(
                    name=r.job.name,
                    namespace="sim",
                    pod=r.job.name,
                    mib=r.job.asked_mib,
                    node=c.node,
                    gpu_uuid=c.uuid,
                    gpu_index=c.index,
                    phase=ReservationPhase.BOUND,
                    reserved_at=r.started_s,
                    pod_running_since=r.started_s,
                )
                for r in c.running
            ]
        decision = choose(
            AllocationRequest(mib=job.asked_mib, namespace="sim", pod=job.name),
            gpus,
            reservations,
            settings=self.settings,
            now=now,
        )
        if not isinstance(decision, Choice):
            return None
        return next(c for c in cards if c.uuid == decision.gpu.uuid)


class KaapanaLike(Design):
    name = "kaapana-like"

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.queued: dict[str, int] = {}
        self.refreshed_at = -math.inf

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        if now - self.refreshed_at >= self.model.kaapana_refresh_s:
            self.queued.clear()  # the in-memory queue is wiped at every refresh
            self.refreshed_at = now
        rooms = {}
        for c in cards:
            used, _ = observed_used(c, now, self.model)
            rooms[c.uuid] = c.total_mib - used - self.queued.get(c.uuid, 0)
        fitting = [c for c in cards if rooms[c.uuid] >= job.asked_mib]
        if fitting:
            chosen = max(fitting, key=lambda c: rooms[c.uuid])
        else:
            # The fallback pass ignores free memory: any GPU big enough, least queued first.
            big = [c for c in cards if c.total_mib >= job.asked_mib]
            if not big:
                return None
            chosen = min(big, key=lambda c: self.queued.get(c.uuid, 0))
        self.queued[chosen.uuid] = self.queued.get(chosen.uuid, 0) + job.asked_mib
        return chosen


class WholeGpu(Design):
    name = "whole-gpu"

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        idle = [c for c in cards if not c.running and c.total_mib >= job.asked_mib]
        return min(idle, key=lambda c: c.total_mib) if idle else None


class TimeSlicing(Design):
    name = "time-slicing"

    def place(self, job: Job, cards: list[Card], now: float) -> Card | None:
        open_ = [c for c in cards if len(c.running) < self.model.time_slices]
        return min(open_, key=lambda c: (len(c.running), c.uuid)) if open_ else None


@dataclass(kw_only=True)
class Result:
    makespan_s: float
    mean_wait_s: float
    p95_wait_s: float
    utilisation_vs_fluid: float
    oom_events: int
    retries: int
    placed: int


def simulate(
    design: Design, jobs: list[Job], fleet_spec: list[tuple[str, int, int]], model: Model, dt: float = 1.0
) -> Result:
    cards = [
        Card(uuid=f"GPU-{node}-{i}", node=node, index=i, total_mib=mib)
        for node, count, mib in fleet_spec
        for i in range(count)
    ]
    pending: list[tuple[float, Job]] = []  # (eligible at, job)
    arrivals = list(jobs)
    first_start: dict[str, float] = {}
    done = 0
    retries = oom = placed = 0
    next_sample = 0.0
    now = 0.0
    limit = 10 * 86_400.0
    while done < len(jobs) and now < limit:
        while arrivals and arrivals[0].arrival_s <= now:
            job = arrivals.pop(0)
            pending.append((job.arrival_s, job))
        # Finish jobs.
        for c in cards:
            finished = [r for r in c.running if now - r.started_s >= r.job.duration_s]
            for r in finished:
                c.running.remove(r)
                done += 1
        # DCGM takes a sample every scrape interval.
        if now >= next_sample:
            for c in cards:
                c.samples.append((now, sum(r.usage(now, model.ramp_s) for r in c.running)))
                if len(c.samples) > 64:
                    del c.samples[:32]
            next_sample = now + model.scrape_interval_s
        # Try pending jobs that are due, oldest first.
        still = []
        for eligible, job in pending:
            if eligible > now:
                still.append((eligible, job))
                continue
            card = design.place(job, cards, now)
            if card is None:
                retries += 1
                still.append((now + model.retry_delay_s, job))
                continue
            card.running.append(Running(job=job, started_s=now))
            first_start.setdefault(job.name, now)
            placed += 1
        pending = still
        # Out of memory: the newest job on the GPU dies and is retried later.
        for c in cards:
            while c.running and sum(r.usage(now, model.ramp_s) for r in c.running) > c.total_mib:
                victim = max(c.running, key=lambda r: r.started_s)
                c.running.remove(victim)
                oom += 1
                retries += 1
                pending.append((now + model.retry_delay_s, victim.job))
        now += dt
    waits = [first_start[j.name] - j.arrival_s for j in jobs if j.name in first_start]
    capacity = sum(c.total_mib for c in cards)
    work = sum(j.asked_mib * j.duration_s for j in jobs)
    return Result(
        makespan_s=now,
        mean_wait_s=statistics.fmean(waits) if waits else 0.0,
        p95_wait_s=sorted(waits)[int(0.95 * (len(waits) - 1))] if waits else 0.0,
        utilisation_vs_fluid=work / (capacity * now) if now else 0.0,
        oom_events=oom,
        retries=retries,
        placed=placed,
    )


def designs(model: Model) -> list[Design]:
    return [
        Vramshare(model, Policy.SPREAD),
        Vramshare(model, Policy.BINPACK),
        KaapanaLike(model),
        WholeGpu(model),
        TimeSlicing(model),
    ]


def run(*, smoke: bool, out: Path, seed: int = 42, show: Callable[[str], None] = print) -> dict[str, Any]:
    model = Model()
    jobs = workload(smoke, seed)
    spec = fleet(smoke)
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for design in designs(model):
        r = simulate(design, jobs, spec, model)
        results[design.name] = {
            "makespan_s": round(r.makespan_s, 1),
            "mean_wait_s": round(r.mean_wait_s, 1),
            "p95_wait_s": round(r.p95_wait_s, 1),
            "utilisation_vs_fluid": round(r.utilisation_vs_fluid, 4),
            "oom_events": r.oom_events,
            "retries": r.retries,
        }
    report = {
        "workload": {
            "jobs": len(jobs),
            "seed": seed,
            "smoke": smoke,
            "fleet": [{"node": n, "gpus": c, "mib": m} for n, c, m in spec],
            "asked_mib_seconds": sum(j.asked_mib * j.duration_s for j in jobs),
        },
        "model": model.__dict__,
        "designs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps(report, indent=2) + "\n")
    chart = out / "packing.png"
    _chart(results, chart)
    show(
        summary(report)
        + f"\n(simulated in {time.monotonic() - started:.1f} s; {out / 'packing.json'}, {chart})"
    )
    return report


def summary(report: dict[str, Any]) -> str:
    rows = [
        f"{'design':<18} {'makespan':>9} {'mean wait':>10} {'p95 wait':>9} {'util/fluid':>10} {'OOM':>5} "
        f"{'retries':>8}"
    ]
    for name, r in report["designs"].items():
        rows.append(
            f"{name:<18} {r['makespan_s']:>8.0f}s {r['mean_wait_s']:>9.0f}s {r['p95_wait_s']:>8.0f}s "
            f"{r['utilisation_vs_fluid']:>10.1%} {r['oom_events']:>5} {r['retries']:>8}"
        )
    w = report["workload"]
    return (
        f"Packing: {w['jobs']} jobs on {sum(f['gpus'] for f in w['fleet'])} GPUs (seed {w['seed']})\n"
        + "\n".join(rows)
    )


def _chart(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(
        axes,
        ["makespan_s", "utilisation_vs_fluid", "oom_events"],
        ["makespan (s, lower is better)", "utilisation vs fluid bound", "OOM events"],
        strict=True,
    ):
        values = [results[n][key] for n in names]
        ax.bar(range(len(names)), values, color=["#2b8a3e", "#5c940d", "#e67700", "#c92a2a", "#862e9c"])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle("GPU sharing designs on the same workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    run(smoke=args.smoke, out=args.out, seed=args.seed)


if __name__ == "__main__":
    main()
