"""The controller counts each booking from its pod as the pod watch shows it (issue #45): nothing writes
a booking when its pod starts, so the inventory's figures (what a sample can show, what is not seen
yet) and the queue's decisions take the start from the pod."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.unit.domain.builders import NOW, gpu
from tests.unit.fake_kube import FakeKube, fed_state
from vramshare.domain import ReservationPhase
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import format_time, reservations_path
from vramshare.kube.sightings import LabelledPod, PodsByLabel

GPU = gpu("GPU-a")
PODS = "/api/v1/namespaces/jobs/pods"


def pod(name: str, *, label: str = "task-ab12", started: float | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending"}
    if started is not None:
        running = {"running": {"startedAt": format_time(started)}}
        status = {"phase": "Running", "containerStatuses": [{"name": "c", "state": running}]}
    return {
        "metadata": {
            "name": name,
            "namespace": "jobs",
            "uid": f"uid-{name}",
            "creationTimestamp": format_time(NOW + 1),
            "labels": {"vramshare.io/reservation": label},
            "annotations": {"vramshare.io/gpu-uuid": "GPU-a"},
        },
        "status": status,
    }


async def test_the_state_counts_a_booking_from_its_pods_start() -> None:
    kube = FakeKube(clock=lambda: NOW)
    booking = GpuReservation.new(
        name="task-ab12", namespace="jobs", pod="task", mib=4096, gpu=GPU, admission_uid="u"
    )
    await kube.create(reservations_path("jobs"), booking.to_wire())
    async with fed_state(kube) as state:
        (seen,) = state.bookings()
        assert (seen.phase, seen.pod_running_since) == (ReservationPhase.RESERVED, None)
        await kube.create(PODS, pod("task", started=NOW + 2))
        await asyncio.sleep(0.05)
        (seen,) = state.bookings()
        assert (seen.phase, seen.pod_running_since) == (ReservationPhase.BOUND, NOW + 2)
        await kube.delete(f"{PODS}/task")
        await asyncio.sleep(0.05)
        (seen,) = state.bookings()
        assert (seen.phase, seen.pod_running_since) == (ReservationPhase.RESERVED, None)


def test_pods_by_label_follows_a_pod_whose_label_changes() -> None:
    heard: list[tuple[str, str]] = []
    pods = PodsByLabel()
    pods.on_change(heard.append)
    pods.changed("jobs/p", LabelledPod.from_wire(pod("p", label="a")))
    assert [p.name for p in pods.of("jobs", "a")] == ["p"]
    pods.changed("jobs/p", LabelledPod.from_wire(pod("p", label="b")))
    assert (list(pods.of("jobs", "a")), [p.name for p in pods.of("jobs", "b")]) == ([], ["p"])
    pods.changed("jobs/p", None)
    assert list(pods.of("jobs", "b")) == []
    assert heard == [("jobs", "a"), ("jobs", "a"), ("jobs", "b"), ("jobs", "b")]


def test_pods_by_label_tells_only_of_a_changed_sighting() -> None:
    """A pod's binding, its conditions, a deletion starting: events that change nothing a sighting
    holds reach no listener (each would count its label's bookings again for nothing)."""
    heard: list[tuple[str, str]] = []
    pods = PodsByLabel()
    pods.on_change(heard.append)
    pods.changed("jobs/p", LabelledPod.from_wire(pod("p")))
    bound = pod("p")
    bound["spec"] = {"nodeName": "gpu-node-a"}
    bound["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
    pods.changed("jobs/p", LabelledPod.from_wire(bound))
    assert heard == [("jobs", "task-ab12")]
    pods.changed("jobs/p", LabelledPod.from_wire(pod("p", started=NOW + 2)))
    assert heard == [("jobs", "task-ab12")] * 2
    assert [p.running_since for p in pods.of("jobs", "task-ab12")] == [NOW + 2]
