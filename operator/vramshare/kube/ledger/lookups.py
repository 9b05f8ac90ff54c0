"""What the webhook looks up besides the view, each a request to the API server: a booking as stored,
its claim by a reinvocation, whether a pod exists or carries a booking, the holds in the fleet."""

from __future__ import annotations

from vramshare.kube.client import list_all
from vramshare.kube.conditional import annotate_unchanged, annotations_of, get_or_none, read_reservation
from vramshare.kube.ledger.view import ACTIVE, LedgerView
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import (
    ANNOTATION_REINVOKED,
    LABEL_HELD_FOR,
    LABEL_RESERVATION,
    pod_path,
    pods_path,
    reservations_path,
)


class LedgerLookups(LedgerView):
    """Look-ups (see the module docstring)."""

    async def get_reservation(self, namespace: str, name: str) -> GpuReservation | None:
        return await read_reservation(self.kube, namespace, name)

    async def claim_reinvocation(self, reservation: GpuReservation, *, claimant: str) -> bool:
        """Mark `reservation` as taken up by a reinvocation of its admission; False when another pass
        already did (the API server reinvokes a webhook at most once, so a second claim is a copy).
        A precondition makes the claim exclusive; a conflict from another change (the committed label
        landing meanwhile) is read again and retried."""
        if ANNOTATION_REINVOKED in reservation.meta.annotations:
            return False
        return await annotate_unchanged(
            self.kube,
            reservations_path(reservation.namespace, reservation.name),
            version=reservation.meta.resource_version,
            annotations={ANNOTATION_REINVOKED: claimant},
            still=lambda obj: ANNOTATION_REINVOKED not in annotations_of(obj),
            attempts=5,
            on_write=lambda: self.on_write("gpureservations", "patch"),
        )

    async def pod_exists(self, namespace: str, name: str) -> bool:
        """Whether a pod of that name exists (a GET, cheap beside a pod cache). Served from the API
        server's watch cache, not etcd (issue #31: one read of etcd less per admission): it may miss
        a pod created in the last moment, whose duplicate then gets a booking that ends at the TTL,
        as before this check; a loop of such creates is caught from its second try on."""
        return await get_or_none(self.kube, pod_path(namespace, name), resource_version="0") is not None

    async def active_holds(self) -> list[GpuReservation]:
        """Every hold in the fleet not ended, on a consistent read."""
        listed = await list_all(self.kube, reservations_path(), label_selector=f"{ACTIVE},{LABEL_HELD_FOR}")
        holds = [GpuReservation.from_wire(o) for o in listed.get("items", [])]
        return [h for h in holds if h.phase.is_active]

    async def pod_labels(self, namespace: str) -> set[str]:
        """The reservation labels of the namespace's GPU pods (a consistent read)."""
        pods = await list_all(self.kube, pods_path(namespace), label_selector=LABEL_RESERVATION)
        return {str(p["metadata"]["labels"][LABEL_RESERVATION]) for p in pods.get("items", [])}

    async def pod_carries(self, namespace: str, reservation: str) -> bool:
        """Whether any pod already carries the reservation's label (a consistent read)."""
        pods = await self.kube.list(pods_path(namespace), label_selector=f"{LABEL_RESERVATION}={reservation}")
        return bool(pods.get("items"))
