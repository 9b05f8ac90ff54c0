"""ReservationReconciler and grants (`vramshare.domain.grants`): recorded at once, ended only once
unrenewed for their duration, by the controller's own clock."""

from __future__ import annotations

from tests.unit.controller.test_reconciler import PRESENT, fed, setup
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import reservations_path


async def test_a_grant_lapses_once_unchanged_for_its_duration_and_not_while_renewed() -> None:
    """Judged by the controller's own clock from what it sees change, never by a timestamp."""
    mono = [0.0]
    async with setup() as (kube, reconciler):
        reconciler._renewals.clock = lambda: mono[0]
        grant = a_grant("g1", lasts_s=3)
        path = reservations_path("vramshare", "g1")
        await kube.create(reservations_path("vramshare"), grant.to_wire())
        await fed()
        presence = PRESENT
        for _ in range(3):  # renewed every 2 s of its 3 + 2: it stays
            await reconciler.sweep(presence=presence)
            mono[0] += 2
            await kube.merge_patch(
                path, {"metadata": {"annotations": {"vramshare.io/grant-renewed": str(mono[0])}}}
            )
            await fed()
        await reconciler.sweep(presence=presence)
        assert kube.objects[path]["status"]["phase"] == "Granted"
        mono[0] += 4.9  # unrenewed, short of 3 + 2
        await reconciler.sweep(presence=presence)
        assert kube.objects[path]["status"]["phase"] == "Granted"
        mono[0] += 0.2
        await fed()
        await reconciler.sweep(presence=presence)
        assert kube.objects[path]["status"]["phase"] == "Expired"
        assert kube.objects[path]["status"]["reason"] == "GrantLapsed"
        assert kube.objects[path]["metadata"]["labels"]["vramshare.io/active"] == "false"


async def test_a_new_grant_is_recorded_granted_at_once() -> None:
    """Its holder books inside it only once the controller has recorded it: not at the next sweep."""
    async with setup() as (kube, reconciler):
        grant = a_grant("g2", lasts_s=15)
        created = await kube.create(reservations_path("vramshare"), grant.to_wire())
        reconciler.reservation_changed(GpuReservation.from_wire(created), presence=lambda: PRESENT)
        await fed()
        assert kube.objects[reservations_path("vramshare", "g2")]["status"]["phase"] == "Granted"


def a_grant(name: str, *, lasts_s: float) -> GpuReservation:
    """A grant of webhook-0 on GPU-a, as the webhook creates it."""
    return GpuReservation.granted(
        name=name,
        namespace="vramshare",
        mib=8192,
        gpu_uuid="GPU-a",
        node="node-a",
        gpu_index=0,
        holder="webhook-0",
        holder_hash="abc",
        lasts_s=lasts_s,
    )
