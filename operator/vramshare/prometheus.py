"""Reading DCGM framebuffer gauges from Prometheus (prometheus-api-client), as domain `Sample`s.

One reading is one instant query (`vramshare.dcgm_series.promql`) evaluated at one explicit time,
`query_delay_s` in the past (so data still arriving at Thanos or Mimir does not split it): the values,
their sample times (what the staleness rule needs) and the MIG instance markers all come from that one
evaluation, and `samples_from` keeps a GPU's figures only when they come from one scrape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from vramshare.dcgm_series import AUTO, DcgmReading, promql, samples_from


class PrometheusUnavailableError(Exception):
    pass


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
        node_label: str = AUTO,
        selector: str = "",
        timeout_s: float = 10.0,
        query_delay_s: float = 1.0,
        access: PrometheusAccess | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.node_label = node_label
        self.selector = selector
        self.query_delay_s = query_delay_s
        self.clock = clock
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

    def _query(self, query: str, *, at: float) -> list[dict[str, Any]]:
        try:
            result = self._client.custom_query(query, params={"time": f"{at:.3f}"})
        except Exception as exc:  # the client raises requests' errors and its own
            raise PrometheusUnavailableError(f"{self.url}: {exc}") from exc
        return list(result)

    def read_blocking(self) -> DcgmReading:
        try:
            self._refresh_token()
        except OSError as exc:
            raise PrometheusUnavailableError(f"{self.url}: cannot read the bearer token: {exc}") from exc
        at = self.clock() - self.query_delay_s
        results = self._query(promql(selector=self.selector, node_label=self.node_label), at=at)
        return samples_from(results, node_label=self.node_label, evaluated_at=at)

    async def read(self) -> DcgmReading:
        return await asyncio.wait_for(asyncio.to_thread(self.read_blocking), timeout=self.timeout_s * 4 + 1)
