"""A reading is one query at one evaluation time: a scrape that lands while the controller reads cannot
split it. The PromQL answers come from tests/unit/promql_model.py (no HTTP), so the interleaving is
exact: the grown pod's scrape lands right after the first query is answered."""

from __future__ import annotations

from typing import Any

from tests.unit.promql_model import Scrape, answer
from vramshare.prometheus import DcgmSource

T = 1_800_000_000.0
GPU = 'gpu="0",UUID="GPU-1",modelName="NVIDIA A100-SXM4-40GB",hostname="gpu-node-a"'


def exposition(*, free: int, used: int) -> str:
    return (
        f"DCGM_FI_DEV_FB_FREE{{{GPU}}} {free}\n"
        f"DCGM_FI_DEV_FB_USED{{{GPU}}} {used}\n"
        f"DCGM_FI_DEV_FB_RESERVED{{{GPU}}} 512\n"
    )


class Prometheus:
    """Answers queries from scrapes; `after_first` lands (is scraped) once the first answer is out."""

    def __init__(self, scrapes: list[Scrape], *, after_first: Scrape, now: float) -> None:
        self.scrapes = scrapes
        self.after_first: Scrape | None = after_first
        self.now = now
        self.queries: list[tuple[str, float]] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        at = float((params or {}).get("time", self.now))
        self.queries.append((query, at))
        result = answer(query, self.scrapes, at=at)
        if self.after_first is not None:
            self.scrapes.append(self.after_first)
            self.after_first = None
        return result


def test_a_scrape_landing_mid_reading_cannot_inflate_the_total() -> None:
    """40 GB card, a pod grows 10 GiB inside its booking (used 28 000 -> 38 240 MiB) just as the
    controller reads. Four queries at four moments summed FREE from before and USED from after into a
    51 200 MiB card; one query at one time sees one scrape."""
    before = Scrape(exposition(free=40_448 - 28_000, used=28_000), at=T)
    grown = Scrape(exposition(free=40_448 - 38_240, used=38_240), at=T + 1.5)
    prometheus = Prometheus([before], after_first=grown, now=T + 2)
    source = DcgmSource(url="http://prometheus.invalid", query_delay_s=1.0, clock=lambda: prometheus.now)
    source._client = prometheus  # type: ignore[assignment]

    (first,) = source.read_blocking().samples
    assert (first.used_mib, first.free_mib, first.total_mib) == (28_000, 12_448, 40_960)
    assert len(prometheus.queries) == 1
    assert prometheus.queries[0][1] == T + 1  # evaluated query_delay_s in the past

    prometheus.now = T + 3
    (second,) = source.read_blocking().samples
    assert (second.used_mib, second.free_mib, second.total_mib) == (38_240, 2_208, 40_960)
    assert second.sampled_at == T + 1.5
