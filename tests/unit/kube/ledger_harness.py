"""What the ledger's unit tests share: a fake API server with one GPU, bookings, and a ledger fed
from it (the fixtures that run one are in `conftest.py`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tests.unit.domain.builders import gpu
from tests.unit.fake_kube import FakeKube, add_idle_gpu
from vramshare.controller.state import ClusterState
from vramshare.domain.snapshot import Snapshot
from vramshare.kube.ledger import FollowedStreams, KubeLedger
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import ANNOTATION_LEDGER, devices_path, reservations_path
from vramshare.kube.watch import WatchCache

GPU = gpu("GPU-a", total=16_384)
DEVICE = devices_path("gpu-a")


async def cluster() -> FakeKube:
    kube = FakeKube()
    await add_idle_gpu(kube, GPU)
    return kube


def booking(name: str = "task-1", mib: int = 4096) -> GpuReservation:
    return GpuReservation.new(name=name, namespace="jobs", pod="task", mib=mib, gpu=GPU, admission_uid="u1")


def hold(name: str = "hold-1", mib: int = 4096) -> GpuReservation:
    """Memory kept for a refused task's next try: a booking with no pod."""
    return GpuReservation.new(
        name=name, namespace="jobs", pod="task", mib=mib, gpu=GPU, admission_uid="u1", held_for="jobs/task"
    )


def reservations(kube: FakeKube) -> list[str]:
    return [p for p in kube.objects if p.startswith(reservations_path("jobs") + "/")]


def names(snapshot: Snapshot) -> set[str]:
    """The reservations a view counts (a live view keeps them in its per-GPU index)."""
    listed = snapshot.index.reservations() if snapshot.index is not None else snapshot.reservations
    return {r.name for r in listed}


def lists(kube: FakeKube) -> int:
    return sum(op == "list" for op, _ in kube.calls)


@contextlib.asynccontextmanager
async def fed(ledger: KubeLedger, *streams: WatchCache[Any]) -> AsyncIterator[KubeLedger]:
    """`ledger` running, and the `streams` its view follows (`FollowedStreams`), if any."""
    tasks = [asyncio.create_task(c.run()) for c in (ledger, *streams)]
    await asyncio.wait_for(ledger.devices.synced.wait(), 2)
    await asyncio.wait_for(ledger.reservations.synced.wait(), 2)
    yield ledger
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def streams_of(kube: FakeKube) -> FollowedStreams:
    """The controller state's GpuDevice and GpuReservation streams, for a ledger to follow as the
    controller's queue does."""
    state = ClusterState(kube)  # type: ignore[arg-type]
    return FollowedStreams(devices=state.devices, reservations=state.reservations)


async def settle() -> None:
    """Let the watch streams deliver what was just written."""
    await asyncio.sleep(0.05)


async def commit_elsewhere(kube: FakeKube, name: str, mib: int) -> None:
    """Another replica's commit on the GPU: its reservation, then the token naming it."""
    created = await kube.create(reservations_path("jobs"), booking(name, mib).to_wire())
    mark = f"jobs/{name}@{created['metadata']['resourceVersion']}"
    await kube.merge_patch(DEVICE, {"metadata": {"annotations": {ANNOTATION_LEDGER: mark}}})


def deletes(kube: FakeKube) -> int:
    return sum(op == "delete" for op, _ in kube.calls)


async def queue_entry(kube: FakeKube, name: str = "waiting") -> GpuReservation:
    entry = GpuReservation.queued(name=name, namespace="jobs", pod=name, mib=4096, admission_uid="u1")
    return GpuReservation.from_wire(await kube.create(reservations_path("jobs"), entry.to_wire()))
