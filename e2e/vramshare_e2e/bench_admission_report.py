"""The admission benchmark's report: the summary printed and the chart drawn from its results."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def chart(report: dict[str, Any], path: Path) -> None:
    """Pod creation latency (p50 and p99) against concurrency: plain, null webhook, the one-write
    floor, vramshare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["levels"], key=int)
    x = [int(level) for level in levels]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, quantile in zip(axes, ("p50_ms", "p99_ms"), strict=True):
        for case, label, colour in (
            ("baseline", "plain pod (no webhook called)", "#495057"),
            ("null_webhook", "null webhook (TLS round trip, no work)", "#1971c2"),
            ("one_write_floor", "one-write webhook (the floor: one booking, watched)", "#e8590c"),
            ("pinned_floor", "pinned floor (one booking, the pod pinned, pods watched)", "#ae3ec9"),
            ("vramshare", "vramshare (decide + commit)", "#2b8a3e"),
        ):
            if all(case in report["levels"][lv] for lv in levels):
                ax.plot(
                    x,
                    [report["levels"][lv][case][quantile] for lv in levels],
                    "o-",
                    label=label,
                    color=colour,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel("concurrent pod creations")
        ax.set_ylabel(f"{quantile.removesuffix('_ms')} latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Pod creation on one API server ({report['pods_per_level']} pods per point)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio_text(ratios: dict[str, float]) -> str:
    return f"{ratios['ratio_p50']:.2f}x / {ratios['ratio_p99']:.2f}x / {ratios['throughput_ratio']:.2f}x"


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"Admission: {report['pods_per_level']} pods per level; "
        "plain, null webhook and vramshare on one API server; "
        f"CPUs {report.get('layout', 'shared')}; the scheduler {report.get('scheduler', 'running')}",
        f"{'conc':>4}  {'plain p50':>9} {'p99':>8} {'pods/s':>7}  {'null p50':>9} {'p99':>8}  "
        f"{'vram p50':>9} {'p99':>8} {'pods/s':>7}  {'r50':>5} {'r99':>5} {'thr':>5}  "
        f"{'decision p50/p99':>17}  writes/adm  conflicts  rebased",
    ]
    for level, r in report["levels"].items():
        b, n, v, d = r["baseline"], r["null_webhook"], r["vramshare"], r["webhook_decision"]
        lines.append(
            f"{level:>4}  {b['p50_ms']:>7.1f}ms {b['p99_ms']:>6.1f}ms {b['pods_per_s']:>7.1f}  "
            f"{n['p50_ms']:>7.1f}ms {n['p99_ms']:>6.1f}ms  "
            f"{v['p50_ms']:>7.1f}ms {v['p99_ms']:>6.1f}ms {v['pods_per_s']:>7.1f}  "
            f"{r['ratio_p50']:>5.2f} {r['ratio_p99']:>5.2f} {r['throughput_ratio']:>5.2f}  "
            f"<={d['p50_ms_at_most']:>5.1f}/<={d['p99_ms_at_most']:>5.1f}ms  "
            f"{r['api_writes_per_admission']!s:>10}  {r['conflicts_retried']:>9.0f}  "
            f"{r.get('commits_rebased', 0):>7.0f}"
        )
        f = r["one_write_floor"]
        lines.append(
            f"      one-write floor: p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, "
            f"{f['pods_per_s']:.1f} pods/s ({_ratio_text(r['floor_vs_baseline'])} plain); "
            f"vramshare against it {_ratio_text(r['against_floor'])} (p50 / p99 / throughput)"
        )
        if "pinned_floor" in r:
            p = r["pinned_floor"]
            lines.append(
                f"      pinned floor: p50 {p['p50_ms']:.1f} ms, p99 {p['p99_ms']:.1f} ms, "
                f"{p['pods_per_s']:.1f} pods/s ({_ratio_text(r['pinned_floor_vs_floor'])} the floor); "
                f"vramshare against it {_ratio_text(r['against_pinned_floor'])}"
            )
        c, w = r["webhook_choose"], r["webhook_commit"]
        lines.append(
            f"      of the answer: choosing p50 <= {c['p50_ms_at_most']:.2f} ms (mean {c['mean_ms']:.2f}), "
            f"committing p50 <= {w['p50_ms_at_most']:.1f} ms (mean {w['mean_ms']:.1f}); "
            f"consistent reads {r['consistent_reads']:.0f}"
        )
        for case, cost in r.get("cost_per_pod", {}).items():
            cpu = cost["cpu_ms"]
            unsettled = cost.get("pods_not_running")
            machine = cost.get("machine_cpu_ms")
            creating = cost.get("cpu_ms_while_creating") or {}
            lines.append(
                f"      per pod, {case}: {cost['api_requests_total']:.2f} API requests "
                f"({', '.join(f'{k} {v:g}' for k, v in cost['api_requests'].items())}); CPU ms "
                + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
                + (
                    f"; the whole machine {machine['while_creating']:.1f} ms while creating, "
                    f"{machine['after']:.1f} after"
                    if machine
                    else ""
                )
                + (
                    "; of which while creating "
                    + ", ".join(f"{k} {v:.1f}" for k, v in creating.items() if v >= 0.05)
                    if creating
                    else ""
                )
                + (f"; {unsettled} pods not running when counted" if unsettled else "")
            )
    for scale in report.get("scale", []):
        d = scale["webhook_decision"]
        c = scale["webhook_choose"]
        lines.append(
            f"with {scale['active_reservations']} active reservations: create p50 "
            f"{scale['vramshare']['p50_ms']:.1f} ms ({scale['create_ratio_p50']:.2f}x plain), answer p50 "
            f"<= {d['p50_ms_at_most']:.1f} ms, of which choosing p50 <= {c['p50_ms_at_most']:.2f} ms "
            f"(mean {c['mean_ms']:.2f} ms); webhook RSS {scale['webhook_rss_mib']} MiB, "
            f"controller RSS {scale['controller_rss_mib']} MiB"
        )
    if "no_gpu" in report:
        ng = report["no_gpu"]
        lines.append(
            f"pods asking no GPU at concurrency {ng['concurrency']}: p50/p99 ms no webhook "
            f"{ng['no_webhook']['p50_ms']:.1f}/{ng['no_webhook']['p99_ms']:.1f}, unmanaged namespace "
            f"{ng['unmanaged']['p50_ms']:.1f}/{ng['unmanaged']['p99_ms']:.1f} "
            f"({ng['unmanaged_vs_no_webhook']['ratio_p50']:.2f}x), GPUs hidden "
            f"{ng['hidden']['p50_ms']:.1f}/{ng['hidden']['p99_ms']:.1f} "
            f"({ng['hidden_vs_no_webhook']['ratio_p50']:.2f}x p50, "
            f"{ng['hidden_vs_no_webhook']['throughput_ratio']:.2f}x throughput), "
            f"GPUs hidden in the API server "
            f"{ng['hidden_in_process']['p50_ms']:.1f}/{ng['hidden_in_process']['p99_ms']:.1f} "
            f"({ng['hidden_in_process_vs_no_webhook']['ratio_p50']:.2f}x p50, "
            f"{ng['hidden_in_process_vs_no_webhook']['throughput_ratio']:.2f}x throughput)"
        )
    lines.append(f"peak RSS MiB: {report['peak_rss_mib']}")
    lines.append(
        "choose() median ms (GPUs x reservations): "
        + ", ".join(f"{k}: {v}" for k, v in report["decision_curve"]["ms"].items())
    )
    return "\n".join(lines)
