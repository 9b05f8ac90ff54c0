"""Following the controller's Lease for its inventory heartbeat (see `vramshare.kube.heartbeat`)."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from vramshare.domain.freshness import HeartbeatView, InventoryHeartbeat
from vramshare.kube.client import KubeClient, Obj
from vramshare.kube.heartbeat import ANNOTATION_HEARTBEAT, lease_heartbeat
from vramshare.kube.watch import WatchCache

log = structlog.get_logger("vramshare.heartbeat")


def logged_heartbeat(lease: Obj) -> InventoryHeartbeat | None:
    """The Lease's heartbeat; one that does not parse is logged and ignored."""
    meta = lease.get("metadata") or {}

    def invalid(value: str, error: str) -> None:
        log.warning(
            "inventory heartbeat ignored: stored sample times apply",
            lease=f"{meta.get('namespace')}/{meta.get('name')}",
            annotation=ANNOTATION_HEARTBEAT,
            value=value,
            error=error,
        )

    return lease_heartbeat(lease, on_invalid=invalid)


class LeaseHeartbeat:
    """The heartbeat the controller's Lease carries now, followed by a watch of that one Lease."""

    def __init__(self, kube: KubeClient, *, namespace: str, name: str) -> None:
        self.cache: WatchCache[InventoryHeartbeat | None] = WatchCache(
            kube,
            f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
            decode=logged_heartbeat,
            field_selector=f"metadata.name={name}",
            name="controller-lease",
        )
        self.key = f"{namespace}/{name}"

    async def run(self) -> None:
        await self.cache.run()

    def latest(self) -> InventoryHeartbeat | None:
        return self.cache.items.get(self.key)


class HeartbeatSource:
    """A heartbeat for the ledger: the newest published (`latest`), applied as the device view
    catches up with it (`HeartbeatView`)."""

    def __init__(self, latest: Callable[[], InventoryHeartbeat | None]) -> None:
        self.latest = latest
        self.view = HeartbeatView()

    def current(self, *, devices_seen_to: int) -> InventoryHeartbeat | None:
        """For the live view (see `HeartbeatView.current`)."""
        self.view.offer(self.latest())
        return self.view.current(devices_seen_to=devices_seen_to)

    def for_read(self, *, devices_version: int) -> InventoryHeartbeat | None:
        """For a consistent read of the devices at `devices_version`."""
        self.view.offer(self.latest())
        return self.view.for_read(devices_version=devices_version)
