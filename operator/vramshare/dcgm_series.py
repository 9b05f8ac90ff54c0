"""DCGM framebuffer series as NVIDIA's exporters write them, turned into one `Sample` per GPU (pure).

What the exporters of 2024-2026 differ in, and how each is read (sources in
tests/unit/dcgm_corpus/README.md):

- **The node label**: `Hostname` up to dcgm-exporter 4.5.3-4.8.2, `hostname` from 4.6.0-4.8.3 on
  (NVIDIA/dcgm-exporter PR #655). `node_label: auto` (the default) takes `hostname`, then `Hostname`;
  any other label (a relabelled `node`, `instance` as host:port) can be named instead.
- **Two metric families**: the MiB gauges the exporter's CSVs collect by default
  (`DCGM_FI_DEV_FB_FREE`, `_USED`, `_RESERVED`, and `_TOTAL` where collected) and the byte-exact
  fields of DCGM 4.7 (`DCGM_FI_DEV_FB_FREE_BYTES`, `_USED_BYTES`, `_RESERVED_BYTES`,
  `DCGM_FI_DEV_FB_CAPACITY_BYTES`). A GPU is read from one family, bytes where complete, never mixed;
  the capacity metric is its total where present.
- **MIG**: a MIG-enabled GPU is reported as one series per GPU instance, each with the *parent's*
  UUID plus `GPU_I_PROFILE` and `GPU_I_ID`. Instances are kept apart (identity = UUID + GPU_I_ID) and
  the GPU is marked MIG-enabled, never merged into one small "GPU"; a marker part of the query finds
  instances whose framebuffer fields the exporter omits (dcgm-exporter #512).
- **Duplicates**: two scrape jobs, an HA pair behind a non-deduplicating querier, pod-attribution
  labels: every distinct label set is a *source*; a GPU takes the freshest consistent source whole,
  never a sum and never a mix of sources; two sources with the same time and different figures are
  reported as a conflict (the one with the least free memory is taken).
- **One reading**: one PromQL query evaluated at one time returns every value *and* its sample time
  (`promql()` below); a source counts only when all its figures come from one scrape (one timestamp).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from vramshare.domain.inventory import Sample
from vramshare.domain.models import MigInstance

MIB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """One naming of the framebuffer gauges, with the unit they are written in."""

    name: str
    free: str
    used: str
    reserved: str
    capacity: str
    bytes_per_unit: int

    @property
    def metrics(self) -> tuple[str, str, str, str]:
        return (self.free, self.used, self.reserved, self.capacity)


MIB_FAMILY = Family(
    name="MiB",
    free="DCGM_FI_DEV_FB_FREE",
    used="DCGM_FI_DEV_FB_USED",
    reserved="DCGM_FI_DEV_FB_RESERVED",
    capacity="DCGM_FI_DEV_FB_TOTAL",
    bytes_per_unit=MIB,
)
BYTES_FAMILY = Family(
    name="bytes",
    free="DCGM_FI_DEV_FB_FREE_BYTES",
    used="DCGM_FI_DEV_FB_USED_BYTES",
    reserved="DCGM_FI_DEV_FB_RESERVED_BYTES",
    capacity="DCGM_FI_DEV_FB_CAPACITY_BYTES",
    bytes_per_unit=1,
)
FAMILIES = (BYTES_FAMILY, MIB_FAMILY)
"""In order of preference: a GPU whose byte gauges are complete is read from them."""
METRICS = tuple(m for f in FAMILIES for m in f.metrics)

AUTO = "auto"
AUTO_NODE_LABELS = ("hostname", "Hostname")
UUID_LABELS = ("UUID", "uuid")
"""`uuid` where the exporter runs with --use-old-namespace."""
INSTANCE_ID, INSTANCE_PROFILE = "GPU_I_ID", "GPU_I_PROFILE"

METRIC_LABEL = "vramshare_metric"
PART_LABEL = "vramshare_part"
"""Labels the query adds: which metric a series is, and which part of the query it answers."""
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def valid_node_label(value: str) -> bool:
    return value == AUTO or bool(_LABEL_NAME.match(value))


def node_labels(node_label: str) -> tuple[str, ...]:
    return AUTO_NODE_LABELS if node_label == AUTO else (node_label,)


def promql(*, selector: str = "", node_label: str = AUTO) -> str:
    """One query for a whole reading: every framebuffer series (tagged with its metric name), its
    sample time, and one marker per MIG GPU instance (any DCGM metric carrying GPU_I_ID, for exporters
    that omit the framebuffer fields of instances). Evaluated at one time, so all parts agree.

    `timestamp()` gives a sample's own time only when applied to a plain selector (of anything else
    it gives the evaluation time), and a selector over several names would leave series that differ
    only in their dropped name: so each metric's times are a part of their own."""
    extra = f",{selector}" if selector else ""
    names = "|".join(METRICS)
    parts = [f'label_replace({{__name__=~"{names}"{extra}}}, "{METRIC_LABEL}", "$1", "__name__", "(.+)")']
    for metric in METRICS:
        tagged = f'label_replace(timestamp({metric}{{{selector}}}), "{METRIC_LABEL}", "{metric}", "", "")'
        parts.append(f'label_replace({tagged}, "{PART_LABEL}", "timestamp", "", "")')
    keep = ", ".join(dict.fromkeys((*UUID_LABELS, INSTANCE_ID, INSTANCE_PROFILE, *node_labels(node_label))))
    marker = f'{{__name__=~"DCGM_.+",{INSTANCE_ID}!=""{extra}}}'
    parts.append(f'label_replace(group by ({keep}) ({marker}), "{PART_LABEL}", "mig", "", "")')
    return " or ".join(parts)


class Cause(StrEnum):
    """Why series could not be used; the label of `vramshare_dcgm_series_unusable`."""

    NO_UUID = "no-uuid"
    NO_NODE = "no-node-label"
    NOT_A_NUMBER = "not-a-number"
    INCOMPLETE = "incomplete"
    INCONSISTENT = "inconsistent"
    CONFLICT = "conflicting-duplicates"
    UNKNOWN_NODE = "unknown-node"
    TOTAL_DRIFT = "total-drift"


@dataclass(frozen=True, slots=True, kw_only=True)
class Unusable:
    cause: Cause
    detail: str
    """Names the GPU (or series) and says what was wrong, for the log."""


@dataclass(frozen=True, kw_only=True)
class DcgmReading:
    samples: list[Sample]
    unusable: list[Unusable] = field(default_factory=list)
    """Series that could not be used (or were resolved with a warning, like conflicting duplicates)."""
    evaluated_at: float = 0.0

    @property
    def skipped(self) -> list[str]:
        return [f"{u.cause.value}: {u.detail}" for u in self.unusable]


@dataclass(frozen=True, slots=True)
class _Figures:
    """One source's consistent figures for one identity, in MiB."""

    at: float
    free: int
    used: int
    reserved: int | None
    capacity: int | None
    labels: Mapping[str, str]
    family: str


def _uuid_of(labels: Mapping[str, str]) -> str:
    return next((labels[k] for k in UUID_LABELS if labels.get(k)), "")


def _node_of(labels: Mapping[str, str], node_label: str) -> str | None:
    for name in node_labels(node_label):
        node = labels.get(name)
        if node:
            return node.rsplit(":", 1)[0] if name == "instance" else node  # instance is host:port
    return None


def _mib(value: float, family: Family) -> int:
    """Whole MiB, rounded down (a byte count that is not a whole MiB never adds headroom)."""
    return int(value * family.bytes_per_unit // MIB)


def _figures(metrics: Mapping[str, tuple[float, float]], labels: Mapping[str, str]) -> _Figures | str:
    """A source's figures from one family and one scrape, or why there are none."""
    for family in FAMILIES:
        if family.free not in metrics or family.used not in metrics:
            continue
        wanted = [m for m in family.metrics if m in metrics]
        times = {metrics[m][1] for m in wanted}
        if len(times) > 1:
            spread = ", ".join(f"{m} at {metrics[m][1]:.3f}" for m in wanted)
            return f"its figures come from different scrapes ({spread}); the next reading is used"
        value = {m: _mib(metrics[m][0], family) for m in wanted}
        return _Figures(
            at=times.pop(),
            free=value[family.free],
            used=value[family.used],
            reserved=value.get(family.reserved),
            capacity=value.get(family.capacity),
            labels=labels,
            family=family.name,
        )
    return f"incomplete series ({', '.join(sorted(metrics)) or 'none'}): FB free and used are both needed"


def _freshest(identity: str, sources: list[_Figures], unusable: list[Unusable]) -> _Figures:
    newest = max(f.at for f in sources)
    tied = [f for f in sources if f.at == newest]
    chosen = min(tied, key=lambda f: (f.free, -f.used))
    figures = {(f.free, f.used, f.reserved, f.capacity) for f in tied}
    if len(figures) > 1:
        shown = "; ".join(f"free {f[0]} used {f[1]} MiB" for f in sorted(figures, key=str))
        unusable.append(
            Unusable(
                cause=Cause.CONFLICT,
                detail=f"{identity}: {len(tied)} series at the same time disagree ({shown}); the one with "
                "the least free memory is used. Check for two exporters or Prometheus replicas with "
                "different data",
            )
        )
    return chosen


def samples_from(
    results: Iterable[Mapping[str, Any]], *, node_label: str = AUTO, evaluated_at: float = 0.0
) -> DcgmReading:
    """One Sample per GPU from the result of `promql()` (a list of {"metric": labels, "value": [t, v]})."""
    unusable: list[Unusable] = []
    values: dict[frozenset[tuple[str, str]], tuple[str, float]] = {}
    times: dict[frozenset[tuple[str, str]], float] = {}
    markers: dict[str, dict[int, str]] = defaultdict(dict)
    marker_nodes: dict[str, str] = {}
    for item in results:
        labels = dict(item["metric"])
        part = labels.pop(PART_LABEL, "")
        raw = float(item["value"][1])
        if part == "mig":
            uuid = _uuid_of(labels)
            instance = labels.get(INSTANCE_ID, "")
            if uuid and instance.isdigit():
                markers[uuid][int(instance)] = labels.get(INSTANCE_PROFILE, "")
                node = _node_of(labels, node_label)
                if node:
                    marker_nodes[uuid] = node
            continue
        labels.pop("__name__", None)
        key = frozenset(labels.items())
        if part == "timestamp":
            times[key] = raw
        else:
            values[key] = (labels.get(METRIC_LABEL, ""), raw)

    # identity (UUID, GPU instance) -> source (its labels bar the metric's) -> metric -> (value, time)
    by_identity: dict[
        tuple[str, int | None], dict[frozenset[tuple[str, str]], dict[str, tuple[float, float]]]
    ]
    by_identity = defaultdict(lambda: defaultdict(dict))
    source_labels: dict[frozenset[tuple[str, str]], dict[str, str]] = {}
    noted: set[tuple[Cause, str]] = set()

    def note(cause: Cause, key: str, detail: str) -> None:
        if (cause, key) not in noted:
            noted.add((cause, key))
            unusable.append(Unusable(cause=cause, detail=detail))

    for key, (metric, value) in values.items():
        labels = {k: v for k, v in key if k != METRIC_LABEL}
        uuid = _uuid_of(labels)
        if not uuid:
            note(Cause.NO_UUID, metric, f"{metric} series without a UUID label: {_short(labels)}")
            continue
        if math.isnan(value) or math.isinf(value) or value < 0:
            note(Cause.NOT_A_NUMBER, uuid, f"{uuid}: {metric} is {value} (DCGM has no value)")
            continue
        instance = labels.get(INSTANCE_ID, "")
        identity = (uuid, int(instance) if instance.isdigit() else None)
        source = frozenset(labels.items())
        source_labels[source] = labels
        sample_time = times.get(key)
        if sample_time is None:  # a result without its timestamp part: not from promql()
            sample_time = evaluated_at
        by_identity[identity][source][metric] = (value, sample_time)

    chosen: dict[tuple[str, int | None], _Figures] = {}
    for identity, sources in sorted(by_identity.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        name = identity[0] if identity[1] is None else f"{identity[0]} GPU instance {identity[1]}"
        usable, problems = [], []
        for source, metrics in sources.items():
            got = _figures(metrics, source_labels[source])
            if isinstance(got, str):
                problems.append(got)
            else:
                usable.append(got)
        if not usable:
            cause = (
                Cause.INCONSISTENT if any("different scrapes" in p for p in problems) else Cause.INCOMPLETE
            )
            note(cause, name, f"{name}: {problems[0]}")
            continue
        chosen[identity] = _freshest(name, usable, unusable)

    samples = []
    uuids = sorted({uuid for uuid, _ in chosen} | set(markers))
    for uuid in uuids:
        whole = chosen.get((uuid, None))
        parts = {i: f for (u, i), f in chosen.items() if u == uuid and i is not None}
        profiles = dict(markers.get(uuid, {}))
        for i, f in parts.items():
            profiles.setdefault(i, f.labels.get(INSTANCE_PROFILE, ""))
        mig = tuple(
            MigInstance(
                profile=profiles[i],
                instance_id=i,
                used_mib=parts[i].used if i in parts else None,
                free_mib=parts[i].free if i in parts else None,
            )
            for i in sorted(profiles)
        )
        first = whole or (parts[min(parts)] if parts else None)
        node = _node_of(first.labels, node_label) if first is not None else marker_nodes.get(uuid)
        if node is None:
            names = " or ".join(repr(n) for n in node_labels(node_label))
            seen: Mapping[str, str] = first.labels if first is not None else {}
            note(
                Cause.NO_NODE,
                uuid,
                f"{uuid}: no {names} label to map it to a node ({_short(seen)}); set node_label to the "
                "label that holds the Kubernetes node name",
            )
            continue
        if whole is not None:
            free, used, reserved, capacity, at = (
                whole.free,
                whole.used,
                whole.reserved,
                whole.capacity,
                whole.at,
            )
        elif parts:
            free = sum(f.free for f in parts.values())
            used = sum(f.used for f in parts.values())
            known_reserved = [f.reserved for f in parts.values() if f.reserved is not None]
            reserved = sum(known_reserved) if known_reserved else None
            capacity, at = None, min(f.at for f in parts.values())
        else:  # instances with no framebuffer fields at all
            free, used, reserved, capacity, at = 0, 0, None, None, evaluated_at
        meta: Mapping[str, str] = first.labels if first is not None else {}
        samples.append(
            Sample(
                uuid=uuid,
                node=node,
                index=int(meta["gpu"]) if meta.get("gpu", "").isdigit() else 0,
                model=meta.get("modelName", ""),
                free_mib=free,
                used_mib=used,
                driver_reserved_mib=reserved,
                sampled_at=at,
                capacity_mib=capacity,
                mig=mig,
            )
        )
    return DcgmReading(samples=samples, unusable=unusable, evaluated_at=evaluated_at)


def _short(labels: Mapping[str, str]) -> str:
    shown = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in (METRIC_LABEL, PART_LABEL))
    return "{" + (shown[:300] + "…" if len(shown) > 300 else shown) + "}"
