"""The webhooks' view counts a booking from its pod as the pod watch shows it (issue #45): a Reserved
booking whose pod exists is Bound (not pending), dated by its pod's start, before the controller writes
either; a pod that is not the booking's own changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio

from tests.unit.domain.builders import gpu
from tests.unit.fake_kube import NOW_STAMP, FakeKube, add_idle_gpu
from vramshare.domain import ReservationPhase
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import ANNOTATION_GPU_UUID, LABEL_RESERVATION, parse_time

GPU = gpu("GPU-a", total=16_384)
PODS = "/api/v1/namespaces/jobs/pods"
KEY = "jobs/task-1"


@pytest_asyncio.fixture(loop_scope="function")
async def watching() -> AsyncIterator[tuple[FakeKube, KubeLedger]]:
    """A webhook's ledger (pods watched) with one committed booking, jobs/task-1 for pod "task"."""
    kube = FakeKube()
    await add_idle_gpu(kube, GPU)
    ledger = KubeLedger(kube, watch_pods=True)  # type: ignore[arg-type]
    task = asyncio.create_task(ledger.run())
    assert ledger.pods is not None
    for cache in (ledger.devices, ledger.reservations, ledger.pods):
        await asyncio.wait_for(cache.synced.wait(), 2)
    snap = await ledger.snapshot()
    booking = GpuReservation.new(
        name="task-1", namespace="jobs", pod="task", mib=4096, gpu=GPU, admission_uid="u1"
    )
    await ledger.commit(reservation=booking, token=snap.tokens[GPU.uuid])
    await settle()
    yield kube, ledger
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def settle() -> None:
    await asyncio.sleep(0.05)


def pod(
    name: str = "task",
    *,
    namespace: str = "jobs",
    label: str = "task-1",
    gpu_uuid: str = GPU.uuid,
    started: str | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending"}
    if started is not None:
        status = {
            "phase": "Running",
            "containerStatuses": [{"name": "main", "state": {"running": {"startedAt": started}}}],
        }
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {LABEL_RESERVATION: label},
            "annotations": {ANNOTATION_GPU_UUID: gpu_uuid},
        },
        "status": status,
    }


async def test_a_booking_whose_pod_exists_counts_as_bound_and_from_its_start(
    watching: tuple[FakeKube, KubeLedger],
) -> None:
    kube, ledger = watching
    counted = ledger.index.get(KEY)
    assert counted is not None
    assert counted.phase is ReservationPhase.RESERVED
    assert [r.name for r in (await ledger.snapshot()).pending_bookings()] == ["task-1"]

    await kube.create(PODS, pod())
    await settle()
    counted = ledger.index.get(KEY)
    assert counted is not None
    assert (counted.phase, counted.pod_seen, counted.pod_running_since) == (
        ReservationPhase.BOUND,
        True,
        None,
    )
    snap = await ledger.snapshot()
    assert list(snap.pending_bookings()) == []
    assert snap.holdings("jobs").bound_mib == 4096
    # The reservation object itself is untouched: nothing was written.
    assert ledger.reservations.items[KEY].phase is ReservationPhase.RESERVED

    await kube.merge_patch(f"{PODS}/task/status", {"status": pod(started=NOW_STAMP)["status"]})
    await settle()
    counted = ledger.index.get(KEY)
    assert counted is not None
    assert counted.pod_running_since == parse_time(NOW_STAMP)

    await kube.delete(f"{PODS}/task")
    await settle()
    counted = ledger.index.get(KEY)
    assert counted is not None
    assert counted.phase is ReservationPhase.RESERVED
    assert counted.pod_running_since is None


async def test_a_pod_that_is_not_the_bookings_own_changes_nothing(
    watching: tuple[FakeKube, KubeLedger],
) -> None:
    """Its label copied, but another name, or another GPU in its placement."""
    kube, ledger = watching
    await kube.create(PODS, pod("someone-else", started=NOW_STAMP))
    await kube.create("/api/v1/namespaces/other/pods", pod(namespace="other", started=NOW_STAMP))
    await settle()
    counted = ledger.index.get(KEY)
    assert counted is not None
    assert counted.phase is ReservationPhase.RESERVED
    assert counted.pod_running_since is None
    await kube.create(PODS, pod(gpu_uuid="GPU-b", started=NOW_STAMP))
    await settle()
    counted = ledger.index.get(KEY)
    assert counted is not None
    assert counted.phase is ReservationPhase.RESERVED


async def test_a_booking_made_after_its_pod_was_seen_is_counted_from_it(
    watching: tuple[FakeKube, KubeLedger],
) -> None:
    """The pod event may come before the booking's own (two streams): the booking still finds it."""
    kube, ledger = watching
    await kube.create(
        PODS,
        pod("task-2", label="task-2", started=NOW_STAMP),
    )
    await settle()
    snap = await ledger.snapshot()
    second = GpuReservation.new(
        name="task-2", namespace="jobs", pod="task-2", mib=1024, gpu=GPU, admission_uid="u2"
    )
    await ledger.commit(reservation=second, token=snap.tokens[GPU.uuid])
    await settle()
    counted = ledger.index.get("jobs/task-2")
    assert counted is not None
    assert (counted.phase, counted.pod_running_since) == (ReservationPhase.BOUND, parse_time(NOW_STAMP))


async def test_without_the_pod_watch_the_view_counts_the_reservation_as_written() -> None:
    kube = FakeKube()
    await add_idle_gpu(kube, GPU)
    ledger = KubeLedger(kube)  # type: ignore[arg-type]
    assert ledger.pods is None
    task = asyncio.create_task(ledger.run())
    await asyncio.wait_for(ledger.reservations.synced.wait(), 2)
    await asyncio.wait_for(ledger.devices.synced.wait(), 2)
    snap = await ledger.snapshot()
    booking = GpuReservation.new(
        name="task-1", namespace="jobs", pod="task", mib=4096, gpu=GPU, admission_uid="u1"
    )
    await ledger.commit(reservation=booking, token=snap.tokens[GPU.uuid])
    await kube.create(PODS, pod(started=NOW_STAMP))
    await settle()
    counted = ledger.index.get(KEY)
    assert counted is not None
    assert counted.phase is ReservationPhase.RESERVED
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
