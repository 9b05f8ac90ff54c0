"""KubeLedger's commit protocol against a fake client: withdrawal on conflict, error and cancellation,
and the snapshot cache."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.domain.builders import NOW, gpu
from tests.unit.fake_kube import FakeKube
from vramshare.kube.client import ApiError
from vramshare.kube.ledger import CommitConflictError, KubeLedger
from vramshare.kube.objects import DeviceSpec, DeviceStatus, GpuDevice, GpuReservation
from vramshare.kube.resources import ANNOTATION_LEDGER, LABEL_COMMITTED, devices_path, reservations_path

GPU = gpu("GPU-a", total=16_384)
DEVICE = devices_path("gpu-a")


async def cluster() -> FakeKube:
    kube = FakeKube()
    device = GpuDevice.new(DeviceSpec(uuid=GPU.uuid, node_name=GPU.node, index=0, model=GPU.model))
    status = DeviceStatus(
        total_mib=GPU.total_mib,
        used_mib=0,
        free_mib=GPU.total_mib,
        driver_reserved_mib=0,
        reserved_mib=0,
        headroom_mib=GPU.total_mib,
        sampled_at=NOW,
        last_seen_at=NOW,
        state="Ready",
    )
    await kube.create(devices_path(), {**device.to_wire(), "status": status.to_wire()})
    return kube


def booking(name: str = "task-1") -> GpuReservation:
    return GpuReservation.new(name=name, namespace="jobs", pod="task", mib=4096, gpu=GPU, admission_uid="u1")


def reservations(kube: FakeKube) -> list[str]:
    return [p for p in kube.objects if p.startswith(reservations_path("jobs") + "/")]


async def test_commit_books_labels_and_moves_the_gpus_token() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)
    snap = await ledger.snapshot()
    token = snap.tokens[GPU.uuid]
    await ledger.commit(reservation=booking(), token=token)
    (path,) = reservations(kube)
    assert kube.objects[path]["metadata"]["labels"][LABEL_COMMITTED] == "true"
    assert kube.objects[DEVICE]["metadata"]["annotations"][ANNOTATION_LEDGER] == "jobs/task-1"
    assert kube.objects[DEVICE]["metadata"]["resourceVersion"] != token


async def test_a_moved_token_withdraws_the_booking_and_drops_the_cache() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube, max_age_s=60)
    snap = await ledger.snapshot()
    await kube.merge_patch(DEVICE, {"metadata": {"annotations": {"other": "commit"}}})  # another replica
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    assert reservations(kube) == []
    lists = sum(op == "list" for op, _ in kube.calls)
    await ledger.snapshot()
    assert sum(op == "list" for op, _ in kube.calls) == lists + 2  # read again, not the cache


async def test_a_vanished_gpu_is_a_conflict_and_withdraws() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)
    snap = await ledger.snapshot()
    await kube.delete(DEVICE)
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    assert reservations(kube) == []


async def test_an_api_error_on_the_token_withdraws_and_propagates() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)
    snap = await ledger.snapshot()
    kube.fail = lambda op, path: (
        ApiError(status=500, reason="InternalError", message="etcd timeout") if path == DEVICE else None
    )
    with pytest.raises(ApiError, match="etcd timeout"):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    assert reservations(kube) == []


async def test_cancellation_mid_commit_withdraws_the_booking() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)
    snap = await ledger.snapshot()
    kube.fail = lambda op, path: asyncio.CancelledError() if path == DEVICE else None
    with pytest.raises(asyncio.CancelledError):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    assert reservations(kube) == []


async def test_the_cached_snapshot_carries_own_commits_until_it_ages() -> None:
    kube = await cluster()
    now = [0.0]
    ledger = KubeLedger(kube, max_age_s=1.0, clock=lambda: now[0])
    snap = await ledger.snapshot()
    await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    lists = sum(op == "list" for op, _ in kube.calls)
    cached = await ledger.snapshot()
    assert sum(op == "list" for op, _ in kube.calls) == lists  # served from the cache
    assert [r.name for r in cached.reservations] == ["task-1"]
    assert cached.tokens[GPU.uuid] == kube.objects[DEVICE]["metadata"]["resourceVersion"]
    # The cached token is the real one: a second commit on it succeeds.
    await ledger.commit(reservation=booking("task-2"), token=cached.tokens[GPU.uuid])
    assert len(reservations(kube)) == 2
    await ledger.snapshot(fresh=True)
    assert sum(op == "list" for op, _ in kube.calls) == lists + 2  # a refusal's read is never cached
    now[0] = 5.0
    await ledger.snapshot()
    assert sum(op == "list" for op, _ in kube.calls) == lists + 4


async def test_reservations_labelled_inactive_are_not_counted() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)
    snap = await ledger.snapshot()
    await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    (path,) = reservations(kube)
    await kube.merge_patch(path, {"metadata": {"labels": {"vramshare.io/active": "false"}}})
    assert (await ledger.snapshot(fresh=True)).reservations == ()


async def test_a_booking_is_taken_up_by_one_reinvocation_only() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)
    snap = await ledger.snapshot()
    created = await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    current = await ledger.get_reservation("jobs", "task-1")
    assert current is not None
    assert await ledger.claim_reinvocation(current, claimant="uid-2")
    assert kube.objects[reservations_path("jobs", "task-1")]["metadata"]["annotations"] == {
        "vramshare.io/reinvoked-by": "uid-2"
    }
    # A second pass, whether it read the booking before or after the first took it up, gets nothing.
    assert not await ledger.claim_reinvocation(current, claimant="uid-3")
    again = await ledger.get_reservation("jobs", "task-1")
    assert again is not None
    assert not await ledger.claim_reinvocation(again, claimant="uid-3")
    assert created.spec.admitted_user == ""


async def test_pod_carries_reads_pods_by_the_reservation_label() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)
    assert not await ledger.pod_carries("jobs", "task-1")
    await kube.create(
        "/api/v1/namespaces/jobs/pods",
        {"metadata": {"name": "p", "labels": {"vramshare.io/reservation": "task-1"}}},
    )
    assert await ledger.pod_carries("jobs", "task-1")
    assert not await ledger.pod_carries("jobs", "task-2")
