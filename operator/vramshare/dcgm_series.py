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
POD_LABELS = (("exported_namespace", "exported_pod"), ("namespace", "pod"), ("pod_namespace", "pod_name"))
"""Where dcgm-exporter's Kubernetes mapping names the pod using a GPU: `namespace`/`pod` (older releases:
`pod_namespace`/`pod_name`), renamed `exported_*` by Prometheus where the scrape's own target labels
(prometheus-operator's, a kubernetes_sd relabel) take those names; then the plain ones name the
exporter's own pod, which the controller's check (a device-plugin pod on that node) sets aside."""
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


@dataclass(frozen=True, slots=True)
class _Figures:
    """One source's consistent figures for one identity, in MiB."""

    at: float
    free: int
    used: int
    reserved: int | None
    capacity: int | None
    labels: Mapping[str, str]


def _attributed(labels: Mapping[str, str]) -> tuple[str, str] | None:
    for namespace, pod in POD_LABELS:
        if labels.get(pod) and labels.get(namespace):
            return labels[namespace], labels[pod]
    return None


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


def _figures(
    metrics: Mapping[str, tuple[float, float]], labels: Mapping[str, str]
) -> _Figures | tuple[Cause, str]:
    """A source's figures from one family and one scrape, or why there are none."""
    for family in FAMILIES:
        if family.free not in metrics or family.used not in metrics:
            continue
        wanted = [m for m in family.metrics if m in metrics]
        times = {metrics[m][1] for m in wanted}
        if len(times) > 1:
            spread = ", ".join(f"{m} at {metrics[m][1]:.3f}" for m in wanted)
            return (
                Cause.INCONSISTENT,
                f"its figures come from different scrapes ({spread}); the next reading is used",
            )
        value = {m: _mib(metrics[m][0], family) for m in wanted}
        return _Figures(
            at=times.pop(),
            free=value[family.free],
            used=value[family.used],
            reserved=value.get(family.reserved),
            capacity=value.get(family.capacity),
            labels=labels,
        )
    return (
        Cause.INCOMPLETE,
        f"incomplete series ({', '.join(sorted(metrics)) or 'none'}): FB free and used are both needed",
    )


def _freshest(identity: str, sources: list[_Figures], notes: _Notes) -> _Figures:
    newest = max(f.at for f in sources)
    tied = [f for f in sources if f.at == newest]
    chosen = min(tied, key=lambda f: (f.free, -f.used))
    figures = {(f.free, f.used, f.reserved, f.capacity) for f in tied}
    if len(figures) > 1:
        shown = "; ".join(f"free {f[0]} used {f[1]} MiB" for f in sorted(figures, key=str))
        notes.add(
            Cause.CONFLICT,
            identity,
            f"{identity}: {len(tied)} series at the same time disagree ({shown}); the one with the least "
            "free memory is used. Check for two exporters or Prometheus replicas with different data",
        )
    return chosen


Labels = frozenset[tuple[str, str]]
Identity = tuple[str, int | None]
"""A GPU (UUID, None) or one GPU instance of a MIG-enabled GPU (UUID, GPU_I_ID)."""


@dataclass(slots=True)
class _Parts:
    """The query's result split into its parts."""

    values: dict[Labels, tuple[str, float]] = field(default_factory=dict)
    """Series (labels without __name__) -> (metric, value)."""
    times: dict[Labels, float] = field(default_factory=dict)
    markers: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    """UUID -> GPU_I_ID -> GPU_I_PROFILE, for every MIG instance any DCGM metric reports."""
    marker_nodes: dict[str, str] = field(default_factory=dict)
    pods: dict[str, set[tuple[str, str]]] = field(default_factory=lambda: defaultdict(set))
    """UUID -> the pods DCGM attributes it to (see POD_LABELS)."""


class _Notes:
    """The unusable list, with each (cause, subject) once."""

    def __init__(self) -> None:
        self.items: list[Unusable] = []
        self._seen: set[tuple[Cause, str]] = set()

    def add(self, cause: Cause, subject: str, detail: str) -> None:
        if (cause, subject) not in self._seen:
            self._seen.add((cause, subject))
            self.items.append(Unusable(cause=cause, detail=detail))


def samples_from(
    results: Iterable[Mapping[str, Any]], *, node_label: str = AUTO, evaluated_at: float = 0.0
) -> DcgmReading:
    """One Sample per GPU from the result of `promql()` (a list of {"metric": labels, "value": [t, v]})."""
    notes = _Notes()
    parts = _split(results, node_label=node_label)
    sources = _sources(parts, notes, evaluated_at=evaluated_at)
    chosen = _choose(sources, notes)
    samples = _assemble(chosen, parts, notes, node_label=node_label, evaluated_at=evaluated_at)
    return DcgmReading(samples=samples, unusable=notes.items, evaluated_at=evaluated_at)


def _split(results: Iterable[Mapping[str, Any]], *, node_label: str) -> _Parts:
    parts = _Parts()
    for item in results:
        labels = dict(item["metric"])
        part = labels.pop(PART_LABEL, "")
        raw = float(item["value"][1])
        if part == "mig":
            uuid, instance = _uuid_of(labels), labels.get(INSTANCE_ID, "")
            if uuid and instance.isdigit():
                parts.markers[uuid][int(instance)] = labels.get(INSTANCE_PROFILE, "")
                node = _node_of(labels, node_label)
                if node:
                    parts.marker_nodes[uuid] = node
            continue
        labels.pop("__name__", None)
        attributed = _attributed(labels)
        if attributed is not None and _uuid_of(labels):
            parts.pods[_uuid_of(labels)].add(attributed)
        key = frozenset(labels.items())
        if part == "timestamp":
            parts.times[key] = raw
        else:
            parts.values[key] = (labels.get(METRIC_LABEL, ""), raw)
    return parts


def _sources(
    parts: _Parts, notes: _Notes, *, evaluated_at: float
) -> dict[Identity, dict[Labels, dict[str, tuple[float, float]]]]:
    """identity -> source (its labels, the metric's aside) -> metric -> (value, sample time)."""
    out: dict[Identity, dict[Labels, dict[str, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for key, (metric, value) in parts.values.items():
        labels = {k: v for k, v in key if k != METRIC_LABEL}
        uuid = _uuid_of(labels)
        if not uuid:
            notes.add(Cause.NO_UUID, metric, f"{metric} series without a UUID label: {_short(labels)}")
            continue
        if math.isnan(value) or math.isinf(value) or value < 0:
            notes.add(Cause.NOT_A_NUMBER, uuid, f"{uuid}: {metric} is {value} (DCGM has no value)")
            continue
        instance = labels.get(INSTANCE_ID, "")
        identity = (uuid, int(instance) if instance.isdigit() else None)
        # A result without its timestamp part (not from promql()) counts as sampled when evaluated.
        out[identity][frozenset(labels.items())][metric] = (value, parts.times.get(key, evaluated_at))
    return out


def _choose(
    sources: Mapping[Identity, Mapping[Labels, Mapping[str, tuple[float, float]]]], notes: _Notes
) -> dict[Identity, _Figures]:
    """Each identity's freshest consistent source, whole."""
    chosen = {}
    for identity, by_source in sorted(sources.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        name = identity[0] if identity[1] is None else f"{identity[0]} GPU instance {identity[1]}"
        usable: list[_Figures] = []
        problems: list[tuple[Cause, str]] = []
        for source, metrics in by_source.items():
            got = _figures(metrics, dict(source))
            if isinstance(got, _Figures):
                usable.append(got)
            else:
                problems.append(got)
        if not usable:
            # A source split across scrapes says more than one missing a metric.
            cause, why = min(problems, key=lambda p: p[0] is not Cause.INCONSISTENT)
            notes.add(cause, name, f"{name}: {why}")
            continue
        chosen[identity] = _freshest(name, usable, notes)
    return chosen


def _assemble(
    chosen: Mapping[Identity, _Figures], parts: _Parts, notes: _Notes, *, node_label: str, evaluated_at: float
) -> list[Sample]:
    """One Sample per UUID: a whole GPU's figures, or a MIG GPU's instances (and their sums)."""
    samples = []
    # Grouped once: looking each UUID's instances up in all of `chosen` was quadratic (1000 GPUs:
    # a million steps per poll, issue #31).
    by_uuid: dict[str, dict[int, _Figures]] = defaultdict(dict)
    for (u, i), f in chosen.items():
        if i is not None:
            by_uuid[u][i] = f
    for uuid in sorted({uuid for uuid, _ in chosen} | set(parts.markers)):
        whole = chosen.get((uuid, None))
        instances = by_uuid.get(uuid, {})
        profiles = dict(parts.markers.get(uuid, {}))
        for i, f in instances.items():
            profiles.setdefault(i, f.labels.get(INSTANCE_PROFILE, ""))
        mig = tuple(
            MigInstance(
                profile=profiles[i],
                instance_id=i,
                used_mib=instances[i].used if i in instances else None,
                free_mib=instances[i].free if i in instances else None,
            )
            for i in sorted(profiles)
        )
        first = whole or (instances[min(instances)] if instances else None)
        meta: Mapping[str, str] = first.labels if first is not None else {}
        node = _node_of(meta, node_label) if first is not None else parts.marker_nodes.get(uuid)
        if node is None:
            names = " or ".join(repr(n) for n in node_labels(node_label))
            notes.add(
                Cause.NO_NODE,
                uuid,
                f"{uuid}: no {names} label to map it to a node ({_short(meta)}); set node_label to the "
                "label that holds the Kubernetes node name",
            )
            continue
        figures = whole or _summed(instances.values(), evaluated_at=evaluated_at)
        samples.append(
            Sample(
                uuid=uuid,
                node=node,
                index=int(meta["gpu"]) if meta.get("gpu", "").isdigit() else 0,
                model=meta.get("modelName", ""),
                free_mib=figures.free,
                used_mib=figures.used,
                driver_reserved_mib=figures.reserved,
                sampled_at=figures.at,
                capacity_mib=figures.capacity,
                mig=mig,
                pods=tuple(sorted(parts.pods.get(uuid, ()))),
            )
        )
    return samples


def _summed(instances: Iterable[_Figures], *, evaluated_at: float) -> _Figures:
    """A MIG GPU's figures as its instances' sums (zero where the exporter gives instances none), as
    old as its oldest instance's sample."""
    listed = list(instances)
    reserved = [f.reserved for f in listed if f.reserved is not None]
    return _Figures(
        at=min((f.at for f in listed), default=evaluated_at),
        free=sum(f.free for f in listed),
        used=sum(f.used for f in listed),
        reserved=sum(reserved) if reserved else None,
        capacity=None,
        labels={},
    )


def _short(labels: Mapping[str, str]) -> str:
    shown = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in (METRIC_LABEL, PART_LABEL))
    return "{" + (shown[:300] + "…" if len(shown) > 300 else shown) + "}"
