"""The webhook's Prometheus metrics (served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vramshare.metrics_common import register_standard


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        register_standard(self.registry, component="webhook")
        self.decisions = Counter(
            "vramshare_webhook_decisions",
            "Admission decisions by outcome (admitted, refused, invalid, hidden, skipped, error) and reason.",
            ["outcome", "reason"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "vramshare_webhook_decision_seconds",
            "Time from receiving an AdmissionReview to answering it.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.choose_seconds = Histogram(
            "vramshare_webhook_choose_seconds",
            "Time to read the view (from the watch caches) and choose a GPU, without the commit's writes.",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "vramshare_webhook_commit_seconds",
            "Time to commit a reservation: create it and move its GPU's token (two API writes).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.api_writes = Counter(
            "vramshare_webhook_api_writes",
            "Writes to the API server by the webhook's ledger, by resource and verb.",
            ["resource", "verb"],
            registry=self.registry,
        )
        self.consistent_reads = Counter(
            "vramshare_webhook_consistent_reads",
            "Quorum reads of the inventory and ledger (refusals are decided on one; concurrent ones share).",
            registry=self.registry,
        )
        self.conflicts = Counter(
            "vramshare_webhook_commit_conflicts",
            "Reservation commits decided again: another commit on their GPU left no room, or it kept "
            "changing.",
            registry=self.registry,
        )
        self.rebased_commits = Counter(
            "vramshare_webhook_commit_rebases",
            "Commits that lost their race on a GPU to one that left room for them, and stood on the "
            "newer ledger token without deciding again.",
            registry=self.registry,
        )
        self.grant_bookings = Counter(
            "vramshare_webhook_grant_bookings",
            "Pods booked inside one of this replica's grants: a create alone, no ledger token bump "
            "(grant_pods).",
            registry=self.registry,
        )
        self.grants_held = Gauge(
            "vramshare_webhook_grants_held",
            "Grants this replica holds (committed or on their way): room on a GPU it books its own pods in.",
            registry=self.registry,
        )
        self.replicas_up = Gauge(
            "vramshare_webhook_replicas_up",
            "Webhook replicas this one sees up (pods ready behind its Service with replica_service, or "
            "Leases renewed with replica_lease_s); GPUs that tie are dealt out among them. 0 while "
            "unknown or with neither set.",
            registry=self.registry,
        )
