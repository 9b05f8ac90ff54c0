"""What an admission works with besides the request: the ledger port, the cluster as the watch caches
show it, the settings, the metrics and the clock, gathered once per process in a `Context`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vramshare.domain.scheduling import NodeView
from vramshare.domain.snapshot import Snapshot
from vramshare.domain.tenancy import RefusalMemory
from vramshare.kube.objects import GpuReservation
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.settings import RefusalStyle, WebhookSettings


class Ledger(Protocol):
    """The reservation ledger as the webhook uses it (`vramshare.kube.ledger.KubeLedger`)."""

    async def snapshot(self, *, fresh: bool = False) -> Snapshot: ...
    async def get_reservation(self, namespace: str, name: str) -> GpuReservation | None: ...
    async def claim_reinvocation(self, reservation: GpuReservation, *, claimant: str) -> bool: ...
    async def pod_carries(self, namespace: str, reservation: str) -> bool: ...
    async def commit(
        self,
        *,
        reservation: GpuReservation,
        token: str,
        live: bool = False,
        grant_room_mib: int | None = None,
    ) -> GpuReservation: ...
    def grant_credit(self, mib: int) -> dict[str, int]: ...
    def relieve_grants(self, room_for_others: Callable[[str], int | None]) -> None: ...
    async def enqueue(self, reservation: GpuReservation) -> GpuReservation: ...
    async def withdraw(self, created: GpuReservation) -> None: ...
    def decided(self, reservation: GpuReservation) -> None: ...
    def undecided(self, reservation: GpuReservation) -> None: ...
    async def withdraw_hold(self, namespace: str, name: str) -> None: ...
    async def pod_exists(self, namespace: str, name: str) -> bool: ...
    async def active_holds(self) -> list[GpuReservation]: ...
    async def pod_labels(self, namespace: str) -> set[str]: ...
    def release_rate(self, gpu_uuid: str | None = None) -> float: ...


def _no_labels(namespace: str) -> Mapping[str, str]:
    return {}


def _no_quotas(namespace: str) -> Iterable[dict[str, Any]]:
    return ()


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    """The cluster besides the ledger, each read from a watch cache (nothing here makes a request).
    The defaults are an empty cluster: no labels, no quotas, no Node objects, one replica."""

    namespace_labels: Callable[[str], Mapping[str, str]] = _no_labels
    """The labels of a namespace: its queue mode, refusal style, delivery mode, guardrails."""
    nodes: Callable[[], Iterable[NodeView]] = tuple
    """The Node objects; none known: only hostname pinning is honoured."""
    resource_quotas: Callable[[str], Iterable[dict[str, Any]]] = _no_quotas
    """A namespace's ResourceQuota objects: its GPU-memory quota."""
    gpu_pods: Callable[[], Iterable[tuple[str, str]]] = tuple
    """(namespace, reservation label) of every pod carrying vramshare's label: a booking whose pod
    appeared is not pending, though the controller may not have bound it."""
    replicas: Callable[[], Sequence[str]] = tuple
    """The webhook replicas up (`vramshare.kube.replicas`), among which GPUs that tie are dealt out."""
    server_clock: Callable[[], float] | None = None
    """The API server's clock (KubeClient.server_clock): the reinvocation window is measured from a
    booking's creationTimestamp, which the API server stamped. None: the webhook's own clock."""


@dataclass(frozen=True, kw_only=True)
class Context:
    """Everything a step of the admission path may use, besides the request's own values."""

    settings: WebhookSettings
    ledger: Ledger
    metrics: WebhookMetrics
    cluster: ClusterView
    clock: Callable[[], float]
    refused_tasks: RefusalMemory = field(compare=False)
    """Tasks refused lately: a hold goes only to one refused again, i.e. seen retrying."""

    def server_now(self) -> float:
        return (self.cluster.server_clock or self.clock)()

    def hint(self, style: RefusalStyle | None, retry_after_s: int | None = None) -> str:
        """A refusal's last sentence for a pod refused in `style`: how its task will be retried."""
        return self.settings.retry_hint_after(
            self.settings.retry_after_s if retry_after_s is None else retry_after_s, style
        )
