"""The packing benchmark's world: the timing model, the clients that retry, the jobs and the cards."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Model:
    scrape_interval_s: float = 15.0
    scrape_lag_s: float = 30.0
    ramp_s: float = 20.0
    context_mib: int = 300
    kaapana_refresh_s: float = 5.0
    time_slices: int = 4
    safety_margin_mib: int = 512
    settle_s: float = 60.0  # vramshare: covers ramp + scrape lag
    hold_limit_s: float = 900.0  # vramshare-queue: the head's hold on one GPU; refuse mode's holds
    hold_min_mib: int = 10_240  # refuse mode: refused requests this large get a hold...
    max_holds: int = 1  # ...at most this many at once


@dataclass(frozen=True, kw_only=True)
class Client:
    """How an Airflow client meets a refused pod creation."""

    name: str
    retry_delay_s: float
    """After a failed try, the task's next try starts this much later (Airflow's retry_delay)."""
    attempts_per_try: int = 1
    """Creations tried inside one try before it fails (KubernetesPodOperator on 429: 5)."""
    retry_after_s: float = 0.0
    """Wait between attempts inside a try (the webhook's Retry-After)."""


CLIENTS = {
    "403-60s": Client(name="KubernetesPodOperator, 403, retry_delay 60 s", retry_delay_s=60.0),
    "403-300s": Client(
        name="KubernetesPodOperator or KubernetesExecutor (defaults), 403, retry_delay 300 s",
        retry_delay_s=300.0,
    ),
    "429": Client(
        name="KubernetesPodOperator, 429 with Retry-After 60 s (5 attempts per try), retry_delay 300 s",
        retry_delay_s=300.0,
        attempts_per_try=5,
        retry_after_s=60.0,
    ),
}
"""The KubernetesExecutor with its defaults (task_publish_max_retries 0) fails the try on a 403 like
the operator does, so "403-300s" stands for both."""


@dataclass(frozen=True, kw_only=True)
class Job:
    name: str
    arrival_s: float
    asked_mib: int
    peak_mib: int
    """Real use at the end of the ramp: context + model, at most what was asked for most jobs."""
    duration_s: float


@dataclass(kw_only=True)
class Card:
    uuid: str
    node: str
    index: int
    total_mib: int
    running: list[Running] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)
    """(time, used MiB) as DCGM took them."""


@dataclass(kw_only=True)
class Running:
    job: Job
    started_s: float

    def usage(self, now: float, ramp_s: float) -> int:
        return (
            int(self.job.peak_mib * min(1.0, (now - self.started_s) / ramp_s))
            if ramp_s > 0
            else self.job.peak_mib
        )
