"""What the controller reads, kept in memory by LIST+WATCH instead of listed on every poll and sweep:
GpuDevices, GpuReservations, Nodes and the pods vramshare admitted (label vramshare.io/reservation).

Caches lag the API server by the time an event takes to arrive. That is harmless where the controller
writes with preconditions or compares before writing; the two conclusions that a lagging cache could
get wrong ("its pod is gone", "its pod never appeared") are confirmed with a direct read before they
are acted on (see ReservationReconciler).

The queue's ledger keeps its own copies of the GpuDevices and the active GpuReservations (with its own
decisions put in), fed by these streams (`vramshare.kube.ledger.FollowedStreams`): one watch of each
kind for the whole controller, each event decoded once.
"""

from __future__ import annotations

import asyncio

from vramshare.domain import Reservation, with_its_pod
from vramshare.domain.holds import Holder
from vramshare.domain.scheduling import NodeView
from vramshare.kube.client import KubeClient, Obj
from vramshare.kube.dra import RESOURCE_SLICES, DraGpu, served, slice_gpus
from vramshare.kube.holders import HOLDER_SELECTOR, holder_from_wire
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.pods import node_view
from vramshare.kube.resources import LABEL_RESERVATION, devices_path, pods_path, reservations_path
from vramshare.kube.sightings import LabelledPod, PodsByLabel
from vramshare.kube.watch import WatchCache


def _pod(obj: Obj) -> Obj:
    return obj


class ClusterState:
    def __init__(self, kube: KubeClient, *, namespace: str = "vramshare") -> None:
        self.devices: WatchCache[GpuDevice] = WatchCache(
            kube, devices_path(), decode=GpuDevice.from_wire, name="gpudevices"
        )
        self.reservations: WatchCache[GpuReservation] = WatchCache(
            kube, reservations_path(), decode=GpuReservation.from_wire, name="gpureservations"
        )
        self.nodes: WatchCache[NodeView] = WatchCache(kube, "/api/v1/nodes", decode=node_view, name="nodes")
        self.pods: WatchCache[Obj] = WatchCache(
            kube, "/api/v1/pods", decode=_pod, label_selector=LABEL_RESERVATION, name="pods"
        )
        self.pods_by_label = PodsByLabel()
        """The same pods as sightings by label: what the lifecycle and the accounting need of them."""
        self.pods.on_change(
            lambda key, pod, _previous: self.pods_by_label.changed(
                key, LabelledPod.from_wire(pod) if pod is not None and pod["metadata"].get("uid") else None
            )
        )
        self.namespaces: WatchCache[dict[str, str]] = WatchCache(
            kube,
            "/api/v1/namespaces",
            decode=lambda o: dict(o["metadata"].get("labels") or {}),
            name="namespaces",
        )
        """Namespace labels: each namespace's weight in the queue's fair share."""
        self.holders: WatchCache[Holder] = WatchCache(
            kube,
            # Only there: a pod elsewhere with the same labels is a tenant's, and holds nothing for us.
            pods_path(namespace),
            decode=holder_from_wire,
            label_selector=HOLDER_SELECTOR,
            name="holders",
        )
        """The holder pods in the controller's namespace (`vramshare.domain.holds`)."""
        self.resource_slices: WatchCache[tuple[DraGpu, ...]] = WatchCache(
            kube, RESOURCE_SLICES, decode=slice_gpus, name="resourceslices"
        )
        """The GPUs DRA drivers publish (`vramshare.kube.dra`); empty where resource.k8s.io/v1 is not
        served."""
        self.kube = kube
        self._caches = (
            self.devices,
            self.reservations,
            self.nodes,
            self.pods,
            self.namespaces,
            self.holders,
            self.resource_slices,
        )

    async def run(self) -> None:
        runs = [c.run() for c in self._caches if c is not self.resource_slices]
        if await served(self.kube):
            runs.append(self.resource_slices.run())
        else:  # before Kubernetes 1.34: no DRA, nothing to follow
            self.resource_slices.synced.set()
        await asyncio.gather(*runs)

    def dra_gpus(self) -> dict[str, DraGpu]:
        """UUID -> how a DRA driver publishes it."""
        return {g.uuid: g for gpus in self.resource_slices.items.values() for g in gpus}

    async def wait_synced(self) -> None:
        for cache in self._caches:
            await cache.synced.wait()

    def bookings(self) -> list[Reservation]:
        """The active bookings, each as its pod shows it (`vramshare.domain.with_its_pod`): the
        controller writes nothing when a booking's pod appears or starts (issue #45), so the start that
        dates what a sample can show is read from the pod."""
        out = []
        for res in self.reservations.items.values():
            if not res.phase.is_active:
                continue
            booking = res.to_domain()
            pods = self.pods_by_label.of(res.namespace, res.pod_label)
            out.append(with_its_pod(booking, pods) if pods else booking)
        return out

    def pods_by_reservation(self) -> dict[tuple[str, str], list[Obj]]:
        """Admitted pods grouped by (namespace, the reservation their label names)."""
        grouped: dict[tuple[str, str], list[Obj]] = {}
        for pod in self.pods.items.values():
            meta = pod["metadata"]
            grouped.setdefault((meta["namespace"], meta["labels"][LABEL_RESERVATION]), []).append(pod)
        return grouped
