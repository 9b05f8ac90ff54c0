"""The gate lift of a queue placement against the next leader (issue #30, 2): leader L1 placed an entry
and stalled with the pod's release on its way; leader L2 sees the placement unlabelled and takes it
back. Exactly one of the two writes lands, both being conditional on the same version of the pod, and a
release that lost is not retried."""

from __future__ import annotations

import copy
from typing import Any

from tests.unit.domain.builders import gpu
from tests.unit.fake_kube import FakeKube, fed_state
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.queue import QueueLoop
from vramshare.controller.settings import ControllerSettings
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.objects import GpuReservation
from vramshare.kube.pods import PLACEMENT_WITHDRAWN, QUEUE_GATE
from vramshare.kube.resources import ANNOTATION_GPU_UUID, LABEL_RESERVATION, reservations_path

GPU = gpu("GPU-a")
POD = "/api/v1/namespaces/jobs/pods/task"


async def placed_entry_with_gated_pod(kube: FakeKube) -> tuple[GpuReservation, dict[str, Any]]:
    entry = GpuReservation.queued(name="task-ab12", namespace="jobs", pod="task", mib=4096, admission_uid="u")
    await kube.create(reservations_path("jobs"), entry.placed_on(GPU).to_wire())
    pod = await kube.create(
        "/api/v1/namespaces/jobs/pods",
        {
            "metadata": {
                "name": "task",
                "namespace": "jobs",
                "uid": "uid-task",
                "labels": {LABEL_RESERVATION: "task-ab12"},
                "annotations": {"vramshare.io/reservation": "task-ab12"},
            },
            "spec": {"schedulingGates": [{"name": QUEUE_GATE}], "containers": [{"name": "c", "image": "x"}]},
        },
    )
    placed = GpuReservation.from_wire(kube.objects[reservations_path("jobs", "task-ab12")])
    return placed, pod


def leader(kube: FakeKube, state: Any, name: str) -> QueueLoop:
    return QueueLoop(
        kube=kube,  # type: ignore[arg-type]
        ledger=KubeLedger(kube),  # type: ignore[arg-type]
        state=state,
        settings=ControllerSettings(identity=name),
        metrics=ControllerMetrics(),
    )


def gates(kube: FakeKube) -> list[str]:
    return [g["name"] for g in kube.objects[POD]["spec"].get("schedulingGates") or []]


async def test_a_placement_taken_back_is_not_released_by_the_leader_that_stalled() -> None:
    kube = FakeKube()
    placed, pod = await placed_entry_with_gated_pod(kube)
    async with fed_state(kube) as state:
        l1, l2 = leader(kube, state, "l1"), leader(kube, state, "l2")
        as_l1_read_it = copy.deepcopy(pod)
        assert await l2._fence(placed, pod)  # L2 takes it back first ...
        await l1._release(placed, as_l1_read_it)  # ... then L1's release, on its way, arrives
    assert gates(kube) == [QUEUE_GATE]  # the pod still waits
    annotations = kube.objects[POD]["metadata"]["annotations"]
    assert ANNOTATION_GPU_UUID not in annotations  # and never got the GPU nobody books for it now
    assert annotations[PLACEMENT_WITHDRAWN] == f"task-ab12@{placed.meta.generation}"  # which placement


async def test_a_release_that_got_there_first_stands_and_is_not_taken_back() -> None:
    kube = FakeKube()
    placed, pod = await placed_entry_with_gated_pod(kube)
    async with fed_state(kube) as state:
        l1, l2 = leader(kube, state, "l1"), leader(kube, state, "l2")
        as_l2_read_it = copy.deepcopy(pod)
        await l1._release(placed, pod)
        assert not await l2._fence(placed, as_l2_read_it)  # the pod no longer waits: L2 leaves it
    assert gates(kube) == []
    assert kube.objects[POD]["metadata"]["annotations"][ANNOTATION_GPU_UUID] == "GPU-a"
    assert PLACEMENT_WITHDRAWN not in kube.objects[POD]["metadata"]["annotations"]
