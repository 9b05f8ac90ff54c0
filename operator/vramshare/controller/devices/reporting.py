"""What a poll reports besides the GpuDevices: DCGM series it could not use (a metric every poll, the log
once), totals it rejected or took, the per-GPU gauges, and the time each step took."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import Histogram

from vramshare.controller.metrics import ControllerMetrics
from vramshare.dcgm_series import Cause, Unusable
from vramshare.domain import Reservation
from vramshare.domain.inventory import (
    DeviceState,
    Known,
    Sample,
)
from vramshare.domain.inventory import DeviceStatus as Judged

log = structlog.get_logger("vramshare.controller")


@dataclass(frozen=True, slots=True)
class _GpuSeries:
    """One GPU's series of the per-GPU gauges."""

    figures: tuple[Any, ...]
    """total, used, reserved, headroom, sample age, overused."""
    states: dict[DeviceState, Any]

    @classmethod
    def of(cls, m: ControllerMetrics, labels: tuple[str, str]) -> _GpuSeries:
        gauges = (m.total, m.used, m.reserved, m.headroom, m.sample_age, m.overused)
        return cls(
            figures=tuple(g.labels(*labels) for g in gauges),
            states={state: m.state.labels(*labels, state.value) for state in DeviceState},
        )


class PollSteps:
    """Times a poll's steps one after the other into `vramshare_inventory_poll_step_seconds`."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.since = time.monotonic()

    def done(self, step: str) -> None:
        now = time.monotonic()
        self.histogram.labels(step).observe(now - self.since)
        self.since = now


class InventoryReport:
    """The inventory's metrics and log lines (see the module docstring)."""

    def __init__(self, metrics: ControllerMetrics) -> None:
        self.metrics = metrics
        self._causes_logged: set[Cause] = set()
        self._series: dict[tuple[str, str], _GpuSeries] = {}
        """Each exported GPU's gauge series, by (node, uuid)."""

    def unusable(self, unusable: list[Unusable]) -> None:
        """Each cause in a metric every poll, and in the log once: when it first appears (with every
        GPU it concerns then) and when it is gone."""
        by_cause: dict[Cause, list[str]] = {}
        for u in unusable:
            by_cause.setdefault(u.cause, []).append(u.detail)
        self.metrics.unusable_series.clear()
        for cause in Cause:
            self.metrics.unusable_series.labels(cause.value).set(len(by_cause.get(cause, [])))
        for cause, details in by_cause.items():
            if cause not in self._causes_logged:
                self._causes_logged.add(cause)
                log.warning(
                    "DCGM series unusable", cause=cause.value, count=len(details), problems=details[:20]
                )
        for cause in sorted(self._causes_logged - set(by_cause)):
            self._causes_logged.discard(cause)
            log.info("DCGM series usable again", cause=cause.value)

    @staticmethod
    def on_kubernetes_nodes(samples: list[Sample], nodes: set[str]) -> tuple[list[Sample], list[Unusable]]:
        """The samples on nodes that exist, and why the others are left out: a node label that names no
        Kubernetes node (an exporter that writes its pod's name there, a wrong node_label) must not
        create a GPU on a phantom node or move a known one there; a known GPU is judged as unreported
        (Stale, as in an exporter outage; Missing if its own node is gone)."""
        if not nodes:  # no Node objects at all: nothing to compare with
            return samples, []
        kept, out = [], []
        shown = ", ".join(sorted(nodes)[:5]) + (", ..." if len(nodes) > 5 else "")
        for s in samples:
            if s.node in nodes:
                kept.append(s)
                continue
            out.append(
                Unusable(
                    cause=Cause.UNKNOWN_NODE,
                    detail=f"{s.uuid}: its node label says {s.node!r}, which is not a Kubernetes node "
                    f"({shown}). Exporters before 2023 wrote their own pod's name in Hostname: relabel "
                    "the node name (e.g. from __meta_kubernetes_pod_node_name) into a label and set "
                    "node_label to it",
                )
            )
        return kept, out

    def export(self, statuses: list[Judged], reservations: list[Reservation], now: float) -> None:
        m = self.metrics
        gauges = (m.total, m.used, m.reserved, m.headroom, m.sample_age, m.overused)
        exported = {}
        for s in statuses:
            labels = (s.gpu.node, s.gpu.uuid)
            # Each GPU's series looked up once, not every poll: labels() validates and hashes its
            # arguments, and a thousand GPUs' nine series cost a third of a second a poll.
            series = self._series.pop(labels, None) or _GpuSeries.of(m, labels)
            exported[labels] = series
            values = (
                s.gpu.total_mib,
                s.gpu.used_mib,
                s.headroom.reserved_mib,
                s.headroom.headroom_mib,
                max(0.0, now - s.gpu.sampled_at),
                s.overused_mib,
            )
            for child, value in zip(series.figures, values, strict=True):
                child.set(value)
            for state, child in series.states.items():
                child.set(1 if s.state is state else 0)
        for labels in self._series:  # GPUs gone since the last poll
            for gauge in gauges:
                gauge.remove(*labels)
            for state in DeviceState:
                m.state.remove(*labels, state.value)
        self._series = exported
        m.mig_gpus.set(sum(1 for s in statuses if s.gpu.mig_enabled))
        counts = Counter(r.phase.value for r in reservations)
        m.reservations.clear()
        for phase, n in counts.items():
            m.reservations.labels(phase).set(n)

    def totals(self, statuses: list[Judged], known: list[Known]) -> list[Unusable]:
        """Log each rejected reading's first rejection and each new total taken; the rejections as
        unusable readings."""
        before = {k.gpu.uuid: k for k in known}
        out = []
        for j in statuses:
            previous = before.get(j.gpu.uuid)
            if j.rejected:
                out.append(Unusable(cause=Cause.TOTAL_DRIFT, detail=f"{j.gpu.uuid}: {j.rejected}"))
                if j.drift is not None and j.drift.readings == 1:
                    log.warning("DCGM reading rejected", uuid=j.gpu.uuid, node=j.gpu.node, why=j.rejected)
            elif (
                previous is not None
                and previous.drift is not None
                and previous.gpu.total_mib != j.gpu.total_mib
            ):
                log.info(
                    "GPU total changed",
                    uuid=j.gpu.uuid,
                    node=j.gpu.node,
                    total_mib=j.gpu.total_mib,
                    previous_mib=previous.gpu.total_mib,
                )
        return out
