"""The decision's own cost, without a cluster: `choose` timed over fleets and ledgers of growing size, from
the ledger index as the webhook keeps it."""

from __future__ import annotations

import statistics
import time
from typing import Any

from vramshare.domain import (
    AllocationRequest,
    Gpu,
    LedgerIndex,
    Reservation,
    ReservationPhase,
    choose,
)
from vramshare_e2e.bench_measure import (
    percentile,
)
from vramshare_webhook.settings import WebhookSettings

NOW = 1_800_000_000.0


def decision_curve(*, smoke: bool) -> dict[str, Any]:
    """Time of `choose()` (with headroom) for fleets and ledgers of growing size: `ms`, the median with
    the ledger as a list (summed per GPU on every call); `indexed_ms`, p50 and p99 with the ledger the
    way the webhook holds it (a `LedgerIndex`, summed per GPU as bookings come and go), which is what
    an admission pays, with the webhook's own default settings and a replica's preference among two
    replicas up (ties dealt out between them, then its own hashed order). 1000 GPUs x 10 000
    bookings is the fleet of issue #31 (125 nodes x 8). The fastest run is reported too: this
    machine's noise shows as the gap between it and the median."""
    settings = WebhookSettings().allocation
    gpu_sizes = [8, 64] if smoke else [8, 64, 512, 1000, 4096]
    reservation_sizes = [100, 1_000] if smoke else [100, 10_000, 100_000]
    out: dict[str, Any] = {"ms": {}, "indexed_ms": {}}
    for n_gpus in gpu_sizes:
        gpus = [
            Gpu(
                uuid=f"GPU-{i}",
                node=f"node-{i // 8}",
                index=i % 8,
                model="sim",
                total_mib=81_920,
                used_mib=1_000,
                free_mib=80_920,
                sampled_at=NOW,
            )
            for i in range(n_gpus)
        ]
        for n_res in reservation_sizes:
            ledger = [
                Reservation(
                    name=f"r{i}",
                    namespace="ns",
                    pod=f"p{i}",
                    mib=1,
                    node="node-0",
                    gpu_uuid=f"GPU-{i % n_gpus}",
                    gpu_index=0,
                    phase=ReservationPhase.BOUND,
                    reserved_at=NOW - 100,
                    pod_running_since=NOW - 100,
                )
                for i in range(n_res)
            ]
            request = AllocationRequest(mib=4_096, namespace="ns", pod="p")
            runs = []
            for _ in range(3 if n_res >= 100_000 else 7):
                started = time.perf_counter()
                choose(request, gpus, ledger, settings=settings, now=NOW)
                runs.append(time.perf_counter() - started)
            out["ms"][f"{n_gpus}x{n_res}"] = round(statistics.median(runs) * 1000, 3)
            index = LedgerIndex()
            for r in ledger:
                index.put(f"{r.namespace}/{r.name}", r)
            runs = []
            for _ in range(20 if smoke else 200):
                started = time.perf_counter()
                choose(
                    request,
                    gpus,
                    (),
                    settings=settings,
                    now=NOW,
                    index=index,
                    prefer="webhook-a",
                    replicas=("webhook-a", "webhook-b"),
                )
                runs.append(time.perf_counter() - started)
            out["indexed_ms"][f"{n_gpus}x{n_res}"] = {
                "min": round(min(runs) * 1000, 3),
                "p50": round(percentile(runs, 0.5) * 1000, 3),
                "p99": round(percentile(runs, 0.99) * 1000, 3),
            }
    return out
