"""Reading DCGM framebuffer gauges from Prometheus (prometheus-api-client), as domain `Sample`s.

One reading is four instant queries: FB_FREE, FB_USED, FB_RESERVED (absent on some exporter
versions) and `timestamp(DCGM_FI_DEV_FB_FREE)`, the time of the sample itself rather than of the
query, which is what the staleness rule needs. Each series is mapped to a Kubernetes node through a
configurable label: `Hostname` by default, but in many clusters that is the exporter pod's name and a
relabelled `node`, `hostname` or `instance` is the right one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from vramshare.domain.inventory import Sample

FREE, USED, RESERVED = "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED"


class PrometheusUnavailableError(Exception):
    pass


@dataclass(frozen=True, kw_only=True)
class DcgmReading:
    samples: list[Sample]
    skipped: list[str]
    """Series that could not be used, with why (no UUID, no node label, ...), for the log."""


def _node_of(labels: Mapping[str, str], node_label: str) -> str | None:
    node = labels.get(node_label)
    if node and node_label == "instance":
        node = node.rsplit(":", 1)[0]  # instance is host:port
    return node or None


def samples_from(
    results: Mapping[str, list[dict[str, Any]]], *, node_label: str, selector: str = ""
) -> DcgmReading:
    """Join the per-metric query results into one Sample per GPU UUID (pure; unit-tested)."""
    values: dict[str, dict[str, float]] = {}
    labels: dict[str, Mapping[str, str]] = {}
    for metric, series in results.items():
        for s in series:
            uuid = s["metric"].get("UUID")
            if not uuid:
                continue
            values.setdefault(uuid, {})[metric] = float(s["value"][1])
            if metric == FREE:
                labels[uuid] = s["metric"]
    samples, skipped = [], []
    for uuid, got in sorted(values.items()):
        meta = labels.get(uuid)
        if meta is None or USED not in got or "timestamp" not in got:
            skipped.append(f"{uuid}: incomplete series ({', '.join(sorted(got))})")
            continue
        node = _node_of(meta, node_label)
        if node is None:
            skipped.append(f"{uuid}: no {node_label!r} label to map it to a node")
            continue
        samples.append(
            Sample(
                uuid=uuid,
                node=node,
                index=int(meta.get("gpu", "0")),
                model=meta.get("modelName", ""),
                free_mib=int(got[FREE]),
                used_mib=int(got[USED]),
                driver_reserved_mib=int(got[RESERVED]) if RESERVED in got else None,
                sampled_at=got["timestamp"],
            )
        )
    return DcgmReading(samples=samples, skipped=skipped)


class DcgmSource:
    """Reads the fleet from Prometheus. `read()` runs the blocking client in a worker thread."""

    def __init__(self, *, url: str, node_label: str, selector: str = "", timeout_s: float = 10.0) -> None:
        self.url = url
        self.node_label = node_label
        self.selector = selector
        self.timeout_s = timeout_s
        # No retries inside a reading: the next poll is the retry, and an outage must be seen quickly.
        self._client = PrometheusConnect(
            url=url, disable_ssl=True, timeout=int(timeout_s), retry=Retry(total=0)
        )

    def _query(self, promql: str) -> list[dict[str, Any]]:
        try:
            result = self._client.custom_query(promql)
        except Exception as exc:  # the client raises requests' errors and its own
            raise PrometheusUnavailableError(f"{self.url}: {exc}") from exc
        return list(result)

    def read_blocking(self) -> DcgmReading:
        sel = f"{{{self.selector}}}" if self.selector else ""
        results = {m: self._query(f"{m}{sel}") for m in (FREE, USED, RESERVED)}
        results["timestamp"] = self._query(f"timestamp({FREE}{sel})")
        return samples_from(results, node_label=self.node_label)

    async def read(self) -> DcgmReading:
        return await asyncio.wait_for(asyncio.to_thread(self.read_blocking), timeout=self.timeout_s * 4 + 1)
