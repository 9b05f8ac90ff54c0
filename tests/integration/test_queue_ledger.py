"""Placing a queue entry through the ledger against the real API server: the CRD's rules for the
placement (written once, withdrawn only as a whole) and the commit's conflict path, which fakes cannot
vouch for."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.unit.domain.builders import gpu
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.queue import QueueLoop
from vramshare.controller.settings import ControllerSettings
from vramshare.controller.state import ClusterState
from vramshare.domain import ReservationPhase
from vramshare.domain.snapshot import CommitConflictError
from vramshare.kube.client import ApiError, Connection, KubeClient, Obj
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.objects import DeviceSpec, GpuDevice, GpuReservation
from vramshare.kube.pods import PLACEMENT_WITHDRAWN, QUEUE_GATE
from vramshare.kube.resources import (
    ANNOTATION_GPU_UUID,
    ANNOTATION_LEDGER,
    ANNOTATION_RESERVATION,
    LABEL_COMMITTED,
    LABEL_GPU,
    LABEL_RESERVATION,
    device_name,
    devices_path,
    reservations_path,
)
from vramshare_e2e.cluster import LocalCluster

pytestmark = pytest.mark.cluster

UUID = "GPU-queue-ledger-0001"


@pytest_asyncio.fixture(loop_scope="function")
async def kube(cluster: LocalCluster) -> AsyncIterator[KubeClient]:
    async with KubeClient(Connection.load(kubeconfig=str(cluster.kubeconfig))) as client:
        yield client


async def gone(kube: KubeClient, path: str) -> None:
    """Delete a booking no controller here will let go: its finalizer removed first."""
    await kube.merge_patch(path, {"metadata": {"finalizers": None}})
    await kube.delete(path)


async def test_a_queue_entry_is_placed_once_and_a_lost_race_puts_it_back_in_the_queue(
    cluster: LocalCluster, kube: KubeClient, namespace: str
) -> None:
    card = gpu(UUID, node="gpu-node-a", index=7, total=16_384)
    device = await kube.create(
        devices_path(), GpuDevice.new(DeviceSpec(uuid=UUID, node_name="gpu-node-a", index=7)).to_wire()
    )
    try:
        ledger = KubeLedger(kube)
        first, second = [
            await ledger.enqueue(
                GpuReservation.queued(name=n, namespace=namespace, pod=n, mib=4096, admission_uid="uid")
            )
            for n in ("first", "second")
        ]
        assert "gpuUUID" not in (await kube.get(reservations_path(namespace, "first")))["spec"]
        stale = device["metadata"]["resourceVersion"]
        placed = await ledger.place(entry=first, gpu=card, token=stale)
        assert (placed.spec.gpu_uuid, placed.spec.node_name, placed.spec.gpu_index) == (UUID, "gpu-node-a", 7)
        bumped = await kube.get(devices_path(device_name(UUID)))
        assert bumped["metadata"]["annotations"][ANNOTATION_LEDGER] == (
            f"{namespace}/first@{placed.meta.resource_version}"
        )
        # The second decided on the token the first moved: its placement is written, then withdrawn.
        with pytest.raises(CommitConflictError):
            await ledger.place(entry=second, gpu=card, token=stale)
        back = await kube.get(reservations_path(namespace, "second"))
        assert not {"gpuUUID", "nodeName", "gpuIndex"} & set(back["spec"])
        assert "vramshare.io/gpu" not in back["metadata"].get("labels", {})
        # Placing the first again with its old resourceVersion conflicts (two controllers cannot both place).
        with pytest.raises(ApiError) as twice:
            await ledger.place(entry=first, gpu=card, token=bumped["metadata"]["resourceVersion"])
        assert twice.value.conflict
        # The placement is written once: moving it elsewhere is refused by the CRD.
        moved = cluster.kubectl(
            "patch",
            "gpures",
            "first",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"gpuUUID": "GPU-other"}}),
            check=False,
        )
        assert "the placement (gpuUUID, nodeName, gpuIndex) is written once" in moved
        half = cluster.kubectl(
            "patch",
            "gpures",
            "second",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"gpuUUID": UUID}}),
            check=False,
        )
        assert "gpuUUID, nodeName and gpuIndex are set together" in half
    finally:
        await kube.delete(devices_path(device_name(UUID)))
        for name in ("first", "second"):
            await gone(kube, reservations_path(namespace, name))


async def test_a_placement_stands_when_its_leader_stops_and_is_withdrawn_only_as_it_was_left(
    cluster: LocalCluster, kube: KubeClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleavings the ledger's unit tests fake, on the real API server: a leader whose term
    ends just after its commit moved the GPU's token; a withdrawal carrying a resourceVersion that
    another leader's change made stale; and an entry recorded Bound before its placement went."""
    card = gpu(UUID, node="gpu-node-a", index=7, total=16_384)
    device = await kube.create(
        devices_path(), GpuDevice.new(DeviceSpec(uuid=UUID, node_name="gpu-node-a", index=7)).to_wire()
    )
    try:
        ledger = KubeLedger(kube)
        entry = await ledger.enqueue(
            GpuReservation.queued(name="stays", namespace=namespace, pod="stays", mib=4096, admission_uid="u")
        )
        path = reservations_path(namespace, "stays")
        patch = kube.merge_patch
        caller: list[asyncio.Task[GpuReservation]] = []

        async def term_ends_after_the_bump(target: str, body: dict[str, Any]) -> dict[str, Any]:
            result = await patch(target, body)
            if target == devices_path(device_name(UUID)):
                caller[0].cancel()
            return result

        monkeypatch.setattr(kube, "merge_patch", term_ends_after_the_bump)
        caller.append(
            asyncio.create_task(
                ledger.place(entry=entry, gpu=card, token=device["metadata"]["resourceVersion"])
            )
        )
        with pytest.raises(asyncio.CancelledError):
            await caller[0]
        monkeypatch.setattr(kube, "merge_patch", patch)
        for _ in range(50):  # the label is written off the caller's path
            if GpuReservation.from_wire(await kube.get(path)).committed:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)  # any withdrawal the ledger started with it has landed by now
        placed = GpuReservation.from_wire(await kube.get(path))
        assert placed.spec.gpu_uuid == UUID
        assert placed.committed
        # Another leader records the pod (as the reconciler does): a withdrawal from before that fails.
        bound = await kube.merge_patch(f"{path}/status", {"status": {"phase": "Bound", "podUID": "pod-uid"}})
        assert not await ledger.unplace(placed)
        assert (await kube.get(path))["spec"]["gpuUUID"] == UUID
        # Withdrawn as it now is: back in the queue, though its status last said Bound.
        assert await ledger.unplace(GpuReservation.from_wire(bound))
        back = await kube.get(path)
        assert not {"gpuUUID", "nodeName", "gpuIndex"} & set(back["spec"])
        assert not {LABEL_GPU, LABEL_COMMITTED} & set(back["metadata"].get("labels", {}))
        assert back["status"]["phase"] == "Bound"
        assert GpuReservation.from_wire(back).phase is ReservationPhase.QUEUED
    finally:
        await kube.delete(devices_path(device_name(UUID)))
        await gone(kube, reservations_path(namespace, "stays"))


# -- the gate lift of a placement against the next leader (issue #30, 2), on the real API server ----


async def _placed_entry_with_gated_pod(kube: KubeClient, namespace: str) -> tuple[GpuReservation, Obj]:
    card = gpu(UUID, node="gpu-node-a", index=7, total=16_384)
    entry = GpuReservation.queued(
        name="task-ab12", namespace=namespace, pod="task", mib=4096, admission_uid="u"
    )
    placed = GpuReservation.from_wire(
        await kube.create(reservations_path(namespace), entry.placed_on(card).to_wire())
    )
    pod = await kube.create(
        f"/api/v1/namespaces/{namespace}/pods",
        {
            "metadata": {
                "name": "task",
                "labels": {LABEL_RESERVATION: "task-ab12"},
                "annotations": {ANNOTATION_RESERVATION: "task-ab12"},
            },
            "spec": {"schedulingGates": [{"name": QUEUE_GATE}], "containers": [{"name": "c", "image": "x"}]},
        },
    )
    return placed, pod


def _leader(kube: KubeClient, name: str) -> QueueLoop:
    return QueueLoop(
        kube=kube,
        ledger=KubeLedger(kube),
        state=ClusterState(kube),
        settings=ControllerSettings(identity=name),
        metrics=ControllerMetrics(),
    )


@contextlib.asynccontextmanager
async def two_leaders(cluster: LocalCluster) -> AsyncIterator[tuple[QueueLoop, QueueLoop]]:
    """L1 and L2, each with a connection of its own, as two controller replicas in turn."""
    connection = Connection.load(kubeconfig=str(cluster.kubeconfig))
    async with KubeClient(connection) as k1, KubeClient(connection) as k2:
        yield _leader(k1, "l1"), _leader(k2, "l2")


async def test_a_placement_taken_back_is_not_released_by_the_leader_that_stalled(
    cluster: LocalCluster, kube: KubeClient, namespace: str
) -> None:
    """L1 placed the entry and stalled with the pod's release on its way (read before L2 acted); L2
    sees the placement unlabelled and takes it back. L1's release then arrives: it must not lift the
    gate with the GPU nobody books for the pod any more."""
    placed, pod = await _placed_entry_with_gated_pod(kube, namespace)
    try:
        async with two_leaders(cluster) as (l1, l2):
            as_l1_read_it = copy.deepcopy(pod)
            assert await l2._fence(placed, pod)  # L2 takes it back first ...
            await l1._release(placed, as_l1_read_it)  # ... then L1's release arrives
        now = await kube.get(f"/api/v1/namespaces/{namespace}/pods/task")
        assert [g["name"] for g in now["spec"].get("schedulingGates") or []] == [QUEUE_GATE]
        assert ANNOTATION_GPU_UUID not in now["metadata"]["annotations"]
        assert now["metadata"]["annotations"][PLACEMENT_WITHDRAWN] == f"task-ab12@{placed.meta.generation}"
    finally:
        await gone(kube, reservations_path(namespace, "task-ab12"))


async def test_a_release_that_got_there_first_stands_and_is_not_taken_back(
    cluster: LocalCluster, kube: KubeClient, namespace: str
) -> None:
    placed, pod = await _placed_entry_with_gated_pod(kube, namespace)
    try:
        async with two_leaders(cluster) as (l1, l2):
            as_l2_read_it = copy.deepcopy(pod)
            await l1._release(placed, pod)
            assert not await l2._fence(placed, as_l2_read_it)  # the pod no longer waits: L2 leaves it
        now = await kube.get(f"/api/v1/namespaces/{namespace}/pods/task")
        assert not now["spec"].get("schedulingGates")
        assert now["metadata"]["annotations"][ANNOTATION_GPU_UUID] == UUID
        assert PLACEMENT_WITHDRAWN not in now["metadata"]["annotations"]
    finally:
        await gone(kube, reservations_path(namespace, "task-ab12"))
