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
from pathlib import Path
from typing import Any

import requests
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


@dataclass(frozen=True, kw_only=True)
class PrometheusAccess:
    """How to reach Prometheus as production setups (Thanos, Mimir, managed Prometheus) require."""

    ca_file: str = ""
    """Verify the server against this CA bundle (default: the system's CAs)."""
    insecure_skip_verify: bool = False
    bearer_token_file: str = ""
    """Sent as `Authorization: Bearer <token>`; read again for each reading, so a rotated token is used."""
    basic_auth_username: str = ""
    basic_auth_password_file: str = ""
    headers: Mapping[str, str] | None = None
    """Extra headers on every query, e.g. {"X-Scope-OrgID": "ml"} for a Mimir tenant."""


class DcgmSource:
    """Reads the fleet from Prometheus. `read()` runs the blocking client in a worker thread, so the
    event loop (kopf's handlers, the lease) never waits on Prometheus."""

    def __init__(
        self,
        *,
        url: str,
        node_label: str,
        selector: str = "",
        timeout_s: float = 10.0,
        access: PrometheusAccess | None = None,
    ) -> None:
        self.url = url
        self.node_label = node_label
        self.selector = selector
        self.timeout_s = timeout_s
        self.access = access or PrometheusAccess()
        # No retries inside a reading: the next poll is the retry, and an outage must be seen quickly.
        session = requests.Session()
        session.verify = False if self.access.insecure_skip_verify else (self.access.ca_file or True)
        auth = None
        if self.access.basic_auth_username:
            password = Path(self.access.basic_auth_password_file).read_text().strip()
            auth = (self.access.basic_auth_username, password)
        self._client = PrometheusConnect(
            url=url,
            session=session,
            auth=auth,
            timeout=int(timeout_s),
            retry=Retry(total=0),
            headers=dict(self.access.headers or {}),
        )

    def _refresh_token(self) -> None:
        if self.access.bearer_token_file:
            token = Path(self.access.bearer_token_file).read_text().strip()
            self._client.headers["Authorization"] = f"Bearer {token}"

    def _query(self, promql: str) -> list[dict[str, Any]]:
        try:
            result = self._client.custom_query(promql)
        except Exception as exc:  # the client raises requests' errors and its own
            raise PrometheusUnavailableError(f"{self.url}: {exc}") from exc
        return list(result)

    def read_blocking(self) -> DcgmReading:
        try:
            self._refresh_token()
        except OSError as exc:
            raise PrometheusUnavailableError(f"{self.url}: cannot read the bearer token: {exc}") from exc
        sel = f"{{{self.selector}}}" if self.selector else ""
        results = {m: self._query(f"{m}{sel}") for m in (FREE, USED, RESERVED)}
        results["timestamp"] = self._query(f"timestamp({FREE}{sel})")
        return samples_from(results, node_label=self.node_label)

    async def read(self) -> DcgmReading:
        return await asyncio.wait_for(asyncio.to_thread(self.read_blocking), timeout=self.timeout_s * 4 + 1)
