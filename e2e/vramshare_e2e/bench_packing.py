"""`make bench-packing`: how well each GPU-sharing design packs the same workload, by simulation.

A trace-driven simulator replays one seeded workload under each design. The vramshare designs call
the real domain code (`vramshare.domain.choose`); the others follow their published behaviour:

- `ideal`: a reference no real design reaches: reservations by the asked memory with no metrics lag,
  and a queue in which freed memory goes in the same second to the oldest task that fits (backfill);
- `vramshare-queue`: queue mode as in the cluster: each arrival meets the webhook's decision first
  (`choose`, admitted at once where it fits, counting the head's hold, which is a booking in the
  ledger), and what does not fit waits for the controller's own planner (`vramshare.domain.plan_queue`:
  fair order, backfill, a bounded hold for the head), over the headroom rule and lagging samples;
- `vramshare-binpack`, `vramshare-spread`: refuse mode (`vramshare.domain.choose`), each refusal
  retried the way the Airflow client really does (see `CLIENTS`);
- `kaapana-like`: free memory minus an in-memory queue that is wiped at every 5 s refresh, least
  loaded first, and a fallback pass that ignores free memory;
- `whole-gpu`: one pod per GPU (`nvidia.com/gpu: 1`), the smallest idle GPU big enough; pending pods
  wait in the scheduler's queue;
- `time-slicing`: a fixed number of pods per GPU, memory-blind; pending pods wait in the scheduler.

The model has what matters in reality:
- memory use ramps up over the first seconds of a job;
- the scheduler sees DCGM samples that are taken periodically and arrive with a scrape lag;
- every CUDA context costs extra memory, and many jobs use less than they asked;
- refused pods are retried as their Airflow client does: a 403 fails the task's try, which Airflow
  retries after `retry_delay`; a 429 is retried inside the try by the KubernetesPodOperator (5 attempts,
  honouring Retry-After), then the try fails; a queued or scheduler-pending pod waits without failing;
- a GPU whose real use exceeds its memory has an OOM: its newest job dies and is retried.

    python -m vramshare_e2e.bench_packing [--smoke] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramshare.domain import (
    Policy,
)
from vramshare_e2e.packing_designs import (
    Design,
    Ideal,
    KaapanaLike,
    TimeSlicing,
    Vramshare,
    VramshareFair,
    VramshareQueue,
    WholeGpu,
)
from vramshare_e2e.packing_model import CLIENTS, Card, Client, Job, Model


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


@dataclass(kw_only=True)
class Result:
    makespan_s: float
    utilisation_vs_fluid: float
    waits: dict[str, dict[str, float]]
    """"small" / "large" -> mean and p95 wait (s) from arrival to first start."""
    oom_events: int
    tries: int
    """Airflow tries spent, all tasks together (one per task if nothing ever failed)."""
    refusals: int


@dataclass(kw_only=True)
class _Pending:
    job: Job
    due_s: float
    attempts: int = 0
    """Creations refused inside the current try."""


def simulate(
    design: Design,
    jobs: list[Job],
    fleet_spec: list[tuple[str, int, int]],
    model: Model,
    client: Client | None = None,
    dt: float = 1.0,
) -> Result:
    """Replay `jobs` under `design`; a design that refuses needs the `client` that retries."""
    assert design.waits or client is not None, f"{design.name} refuses: say which client retries"
    cards = [
        Card(uuid=f"GPU-{node}-{i}", node=node, index=i, total_mib=mib)
        for node, count, mib in fleet_spec
        for i in range(count)
    ]
    pending: list[_Pending] = []
    arrivals = list(jobs)
    first_start: dict[str, float] = {}
    done = 0
    tries = len(jobs)
    oom = refusals = 0
    next_sample = 0.0
    now = 0.0
    limit = 10 * 86_400.0
    while done < len(jobs) and now < limit:
        while arrivals and arrivals[0].arrival_s <= now:
            job = arrivals.pop(0)
            pending.append(_Pending(job=job, due_s=job.arrival_s))
        for c in cards:
            finished = [r for r in c.running if now - r.started_s >= r.job.duration_s]
            for r in finished:
                c.running.remove(r)
                design.released(c, r.job, now)
                done += 1
        # DCGM takes a sample every scrape interval.
        if now >= next_sample:
            for c in cards:
                c.samples.append((now, sum(r.usage(now, model.ramp_s) for r in c.running)))
                if len(c.samples) > 64:
                    del c.samples[:32]
            next_sample = now + model.scrape_interval_s
        due = [p for p in pending if p.due_s <= now]
        if due:
            placed = {job.name for job, _ in design.admit([p.job for p in due], cards, now)}
            for p in due:
                if p.job.name in placed:
                    first_start.setdefault(p.job.name, now)
                    pending.remove(p)
                    continue
                if design.waits or client is None:
                    continue  # still waiting: looked at again in the next second
                refusals += 1
                p.attempts += 1
                if p.attempts < client.attempts_per_try:
                    hint = design.retry_after_s(p.job, now)
                    p.due_s = now + (client.retry_after_s if hint is None else hint)
                else:  # the try fails; Airflow starts the next one after retry_delay
                    tries += 1
                    p.attempts = 0
                    p.due_s = now + client.retry_delay_s
        # Out of memory: the newest job on the GPU dies, and its task's try with it.
        for c in cards:
            while c.running and sum(r.usage(now, model.ramp_s) for r in c.running) > c.total_mib:
                victim = max(c.running, key=lambda r: r.started_s)
                c.running.remove(victim)
                oom += 1
                tries += 1
                pending.append(
                    _Pending(job=victim.job, due_s=now + (client or CLIENTS["403-60s"]).retry_delay_s)
                )
        now += dt
    capacity = sum(c.total_mib for c in cards)
    work = sum(j.asked_mib * j.duration_s for j in jobs)
    return Result(
        makespan_s=now,
        utilisation_vs_fluid=work / (capacity * now) if now else 0.0,
        waits={
            size: _wait_stats(
                [
                    first_start[j.name] - j.arrival_s
                    for j in jobs
                    if j.name in first_start and is_large(j) == (size == "large")
                ]
            )
            for size in ("small", "large")
        },
        oom_events=oom,
        tries=tries,
        refusals=refusals,
    )


def is_large(job: Job) -> bool:
    return job.asked_mib >= 16_384


def _wait_stats(waits: list[float]) -> dict[str, float]:
    if not waits:
        return {"mean_s": 0.0, "p95_s": 0.0}
    ordered = sorted(waits)
    return {
        "mean_s": round(statistics.fmean(ordered), 1),
        "p95_s": round(ordered[int(0.95 * (len(ordered) - 1))], 1),
    }


def runs(model: Model) -> list[tuple[str, Design, Client | None]]:
    """(row, design, client): the waiting designs once, the refusing ones under each Airflow client."""
    rows: list[tuple[str, Design, Client | None]] = [
        ("ideal", Ideal(model), None),
        ("vramshare-queue", VramshareQueue(model), None),
    ]
    for key, client in CLIENTS.items():
        rows.append((f"vramshare-binpack/{key}", Vramshare(model, Policy.BINPACK), client))
    for key, client in CLIENTS.items():
        rows.append((f"vramshare-binpack-fair/{key}", VramshareFair(model, Policy.BINPACK), client))
    rows.append(("vramshare-spread/403-60s", Vramshare(model, Policy.SPREAD), CLIENTS["403-60s"]))
    rows += [
        ("kaapana-like", KaapanaLike(model), CLIENTS["403-60s"]),
        ("whole-gpu", WholeGpu(model), None),
        ("time-slicing", TimeSlicing(model), None),
    ]
    return rows


def run(*, smoke: bool, out: Path, seed: int = 42, show: Callable[[str], None] = print) -> dict[str, Any]:
    model = Model()
    jobs = workload(smoke, seed)
    spec = fleet(smoke)
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    ideal_makespan = 0.0
    for row, design, client in runs(model):
        r = simulate(design, jobs, spec, model, client)
        if row == "ideal":
            ideal_makespan = r.makespan_s
        results[row] = {
            "client": client.name if client else "waits (no refusal reaches Airflow)",
            "makespan_s": round(r.makespan_s, 1),
            "makespan_vs_ideal": round(r.makespan_s / ideal_makespan, 3),
            "utilisation_vs_fluid": round(r.utilisation_vs_fluid, 4),
            "utilisation_vs_ideal": round(ideal_makespan / r.makespan_s, 4),
            "wait_small": r.waits["small"],
            "wait_large": r.waits["large"],
            "oom_events": r.oom_events,
            "airflow_tries": r.tries,
            "refusals": r.refusals,
        }
        show(f"  {row}: makespan {r.makespan_s:.0f} s ({time.monotonic() - started:.0f} s so far)")
    report = {
        "workload": {
            "jobs": len(jobs),
            "large_jobs": sum(1 for j in jobs if is_large(j)),
            "seed": seed,
            "smoke": smoke,
            "fleet": [{"node": n, "gpus": c, "mib": m} for n, c, m in spec],
            "asked_mib_seconds": sum(j.asked_mib * j.duration_s for j in jobs),
        },
        "model": model.__dict__,
        "clients": {k: c.__dict__ for k, c in CLIENTS.items()},
        "designs": results,
        "starvation": starvation(model),
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


def starvation(model: Model) -> dict[str, Any]:
    """One 32 GiB task against an endless stream of 4 GiB tasks on one 40 GiB GPU (403, retry_delay
    60 s): how long the large task waits with and without refuse mode's hold."""
    small = [
        Job(name=f"s{i}", arrival_s=i * 20.0, asked_mib=4_096, peak_mib=3_500, duration_s=120.0)
        for i in range(300)
    ]
    large = Job(name="big", arrival_s=300.0, asked_mib=32_768, peak_mib=30_000, duration_s=600.0)
    jobs = sorted([*small, large], key=lambda j: j.arrival_s)
    out: dict[str, Any] = {"stream_ends_s": small[-1].arrival_s}
    for label, design in (
        ("without-hold", Vramshare(model, Policy.BINPACK)),
        ("with-hold", VramshareFair(model, Policy.BINPACK)),
    ):
        r = simulate(design, jobs, [("node-a", 1, 40_960)], model, CLIENTS["403-60s"])
        out[label] = {
            "large_wait_s": r.waits["large"]["mean_s"],
            "small_p95_wait_s": r.waits["small"]["p95_s"],
        }
    # Queue mode, arrivals through the webhook first: the head's hold seen by admissions, or not.
    for label, queue in (
        ("queue-hold-unseen", VramshareQueue(model, hold_in_ledger=False)),
        ("queue", VramshareQueue(model)),
    ):
        r = simulate(queue, jobs, [("node-a", 1, 40_960)], model)
        out[label] = {
            "large_wait_s": r.waits["large"]["mean_s"],
            "small_p95_wait_s": r.waits["small"]["p95_s"],
        }
    return out


def summary(report: dict[str, Any]) -> str:
    rows = [
        f"{'design/client':<32} {'makespan':>9} {'vs ideal':>8} {'util/fluid':>10} {'wait small':>14} "
        f"{'wait large':>14} {'OOM':>5} {'tries':>6}",
        f"{'':<32} {'':>9} {'':>8} {'':>10} {'mean/p95 (s)':>14} {'mean/p95 (s)':>14}",
    ]
    for name, r in report["designs"].items():
        small, large = r["wait_small"], r["wait_large"]
        rows.append(
            f"{name:<32} {r['makespan_s']:>8.0f}s {r['makespan_vs_ideal']:>7.2f}x "
            f"{r['utilisation_vs_fluid']:>10.1%} {small['mean_s']:>6.0f}/{small['p95_s']:<7.0f} "
            f"{large['mean_s']:>6.0f}/{large['p95_s']:<7.0f} {r['oom_events']:>5} {r['airflow_tries']:>6}"
        )
    w = report["workload"]
    st = report["starvation"]
    return (
        f"Packing: {w['jobs']} jobs ({w['large_jobs']} large) on {sum(f['gpus'] for f in w['fleet'])} GPUs "
        f"(seed {w['seed']})\n" + "\n".join(rows) + "\n"
        f"Starvation (a 32 GiB task in a stream of 4 GiB tasks ending at {st['stream_ends_s']:.0f} s): "
        f"the large task waits {st['without-hold']['large_wait_s']:.0f} s without a hold, "
        f"{st['with-hold']['large_wait_s']:.0f} s with one (small p95 wait "
        f"{st['without-hold']['small_p95_wait_s']:.0f} s -> {st['with-hold']['small_p95_wait_s']:.0f} s); "
        f"in queue mode {st['queue-hold-unseen']['large_wait_s']:.0f} s when admissions do not see the "
        f"head's hold, {st['queue']['large_wait_s']:.0f} s when it is a booking they count"
    )


def _chart(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(
        axes,
        ["makespan_vs_ideal", "airflow_tries", "oom_events"],
        ["makespan vs ideal (lower is better)", "Airflow tries spent", "OOM events"],
        strict=True,
    ):
        values = [results[n][key] for n in names]
        colours = [
            "#495057" if n == "ideal" else "#2b8a3e" if n.startswith("vramshare") else "#c92a2a"
            for n in names
        ]
        ax.bar(range(len(names)), values, color=colours)
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
