"""Placing a queue entry through the ledger against the real API server: the CRD's rules for the
placement (written once, withdrawn only as a whole) and the commit's conflict path, which fakes cannot
vouch for."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.unit.domain.builders import gpu
from vramshare.kube.client import ApiError, Connection, KubeClient
from vramshare.kube.ledger import CommitConflictError, KubeLedger
from vramshare.kube.objects import DeviceSpec, GpuDevice, GpuReservation
from vramshare.kube.resources import ANNOTATION_LEDGER, device_name, devices_path, reservations_path
from vramshare_e2e.cluster import LocalCluster

pytestmark = pytest.mark.cluster

UUID = "GPU-queue-ledger-0001"


@pytest_asyncio.fixture(loop_scope="function")
async def kube(cluster: LocalCluster) -> AsyncIterator[KubeClient]:
    async with KubeClient(Connection.load(kubeconfig=str(cluster.kubeconfig))) as client:
        yield client


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
            await kube.delete(reservations_path(namespace, name))
