"""A model of what Prometheus answers to the query vramshare sends (`vramshare.dcgm_series.promql`),
over exposition texts as exporters write them: so the unit tests read the corpus the way the controller
reads a real Prometheus. The integration tests check the real Prometheus answers the same way.

Modelled: the latest scrape of each target wins, and a series missing from it is stale (gone); target
labels are attached with `honor_labels: false` (a clashing exporter label is renamed `exported_<name>`);
the three parts of the query (values tagged with their metric, their sample times, MIG markers).
Older query shapes (one metric name, `timestamp(NAME)`) are answered too, for the race test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from vramshare.dcgm_series import (
    INSTANCE_ID,
    INSTANCE_PROFILE,
    METRIC_LABEL,
    METRICS,
    PART_LABEL,
    UUID_LABELS,
    node_labels,
)

CORPUS = Path(__file__).parent / "dcgm_corpus"


def corpus(name: str) -> str:
    return (CORPUS / name).read_text()


@dataclass(frozen=True)
class Scrape:
    text: str
    at: float
    target: Mapping[str, str] = field(default_factory=dict)
    """Labels the scrape adds (job, instance, ...); the target is identified by them."""


def series_of(scrape: Scrape) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(scrape.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            for name, value in scrape.target.items():
                if name in labels:
                    labels[f"exported_{name}"] = labels.pop(name)
                labels[name] = value
            out.append((sample.name, labels, float(sample.value)))
    return out


def live(scrapes: Iterable[Scrape], at: float) -> list[tuple[str, dict[str, str], float, float]]:
    """(metric, labels, value, sample time) of every series live at `at`."""
    latest: dict[frozenset[tuple[str, str]], Scrape] = {}
    for s in scrapes:
        key = frozenset(s.target.items())
        if s.at <= at and (key not in latest or s.at > latest[key].at):
            latest[key] = s
    return [(m, labels, v, s.at) for s in latest.values() for m, labels, v in series_of(s)]


def answer(
    query: str, scrapes: Iterable[Scrape], *, at: float, node_label: str = "auto"
) -> list[dict[str, Any]]:
    """The result list of an instant query at `at`, for the query shapes vramshare sends."""
    found = live(scrapes, at)
    if query.startswith("timestamp(") and query.endswith(")") and query[10:-1] in METRICS:
        name = query[10:-1]
        return [_item(labels, t, at) for m, labels, _, t in found if m == name]
    if query in METRICS:
        return [_item({"__name__": m, **labels}, v, at) for m, labels, v, _ in found if m == query]
    out = []
    for m, labels, v, t in found:
        if m in METRICS:
            out.append(_item({"__name__": m, **labels, METRIC_LABEL: m}, v, at))
            out.append(_item({**labels, METRIC_LABEL: m, PART_LABEL: "timestamp"}, t, at))
    keep = (*UUID_LABELS, INSTANCE_ID, INSTANCE_PROFILE, *node_labels(node_label))
    groups = {
        frozenset((k, labels[k]) for k in keep if k in labels)
        for m, labels, _, _ in found
        if m.startswith("DCGM_") and labels.get(INSTANCE_ID)
    }
    out += [_item({**dict(g), PART_LABEL: "mig"}, 1, at) for g in groups]
    return out


def _item(labels: Mapping[str, str], value: float, at: float) -> dict[str, Any]:
    return {"metric": dict(labels), "value": [at, repr(float(value))]}
