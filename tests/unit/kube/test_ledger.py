"""KubeLedger against a fake client: the view a decision reads (the watch, a consistent read, the
tokens it waits for), a commit's writes, and what it withdraws on a conflict, an error or a
cancellation. Groups, races and placements: `test_ledger_commits.py`."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.domain.builders import NOW, gpu
from tests.unit.fake_kube import FakeKube, add_idle_gpu
from tests.unit.kube.ledger_harness import (
    DEVICE,
    GPU,
    booking,
    cluster,
    fed,
    hold,
    lists,
    names,
    reservations,
    settle,
)
from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.domain.snapshot import CommitConflictError
from vramshare.kube.client import ApiError
from vramshare.kube.lease_watch import HeartbeatSource
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.resources import ANNOTATION_LEDGER, LABEL_COMMITTED, devices_path, reservations_path


async def test_commit_books_and_moves_the_gpus_token_in_two_writes(
    running: tuple[FakeKube, KubeLedger],
) -> None:
    """A pod's booking: created, then the token bumped naming it; nothing more (issue #31: its pod is
    its record of the commit, so the committed label, a third write per admission, is gone)."""
    kube, ledger = running
    snap = await ledger.snapshot()
    token = snap.tokens[GPU.uuid]
    before = len(kube.calls)
    created = await ledger.commit(reservation=booking(), token=token)
    await settle()
    await ledger.drain(timeout_s=1)
    (path,) = reservations(kube)
    assert LABEL_COMMITTED not in kube.objects[path]["metadata"]["labels"]
    assert kube.objects[DEVICE]["metadata"]["annotations"][ANNOTATION_LEDGER] == (
        f"jobs/task-1@{created.meta.resource_version}"
    )
    assert kube.objects[DEVICE]["metadata"]["resourceVersion"] != token
    writes = [(op, p) for op, p in kube.calls[before:] if op not in ("get", "list", "watch")]
    assert writes == [("create", reservations_path("jobs")), ("merge_patch", DEVICE)]


async def test_a_hold_is_labelled_committed_once_its_commit_held(
    running: tuple[FakeKube, KubeLedger],
) -> None:
    """A hold has no pod to vouch for it: the label tells observers it is no mere candidate."""
    kube, ledger = running
    snap = await ledger.snapshot()
    await ledger.commit(reservation=hold(), token=snap.tokens[GPU.uuid])
    assert await ledger.drain(timeout_s=5) == 0
    (path,) = reservations(kube)
    assert kube.objects[path]["metadata"]["labels"][LABEL_COMMITTED] == "true"


async def test_decisions_read_the_watch_not_the_api(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    before = lists(kube)
    for _ in range(5):
        await ledger.snapshot()
    assert lists(kube) == before
    # Another replica's commit reaches the view through the watch.
    other = booking("other-1")
    created = await kube.create(reservations_path("jobs"), other.to_wire())
    await kube.merge_patch(
        DEVICE,
        {
            "metadata": {
                "annotations": {ANNOTATION_LEDGER: f"jobs/other-1@{created['metadata']['resourceVersion']}"}
            }
        },
    )
    await settle()
    assert names(await ledger.snapshot()) == {"other-1"}
    assert lists(kube) == before


async def test_a_view_behind_a_gpus_token_is_not_handed_out(
    running: tuple[FakeKube, KubeLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token that names a reservation the stream has not delivered yet: wait, then read consistently."""
    kube, ledger = running
    monkeypatch.setattr("vramshare.kube.ledger.view.CATCH_UP_TIMEOUT_S", 0.05)
    await kube.merge_patch(DEVICE, {"metadata": {"annotations": {ANNOTATION_LEDGER: "jobs/ahead@999999"}}})
    await settle()
    before = lists(kube)
    await ledger.snapshot()
    assert lists(kube) == before + 2  # the consistent read: devices, then reservations
    assert ledger.catch_up_waits == 1


async def test_own_decisions_join_the_view_before_their_commit_completes(
    running: tuple[FakeKube, KubeLedger],
) -> None:
    kube, ledger = running
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    first = asyncio.create_task(ledger.commit(reservation=booking("a"), token=token, live=True))
    second = asyncio.create_task(ledger.commit(reservation=booking("b"), token=token, live=True))
    await asyncio.sleep(0)
    assert names(await ledger.snapshot()) == {"a", "b"}
    # Both decided on the same token: the second is chained after the first, no conflict.
    await asyncio.gather(first, second)
    assert len(reservations(kube)) == 2


async def test_a_moved_token_withdraws_the_booking(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    snap = await ledger.snapshot()
    # Another replica's commit: the device names another last reservation.
    await kube.merge_patch(DEVICE, {"metadata": {"annotations": {ANNOTATION_LEDGER: "jobs/theirs@1"}}})
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    await settle()
    assert reservations(kube) == []
    assert names(await ledger.snapshot()) == set()


async def test_a_vanished_gpu_is_a_conflict_and_withdraws(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    snap = await ledger.snapshot()
    await kube.delete(DEVICE)
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    assert reservations(kube) == []


async def test_an_api_error_on_the_token_withdraws_and_propagates(
    running: tuple[FakeKube, KubeLedger],
) -> None:
    kube, ledger = running
    snap = await ledger.snapshot()
    kube.fail = lambda op, path: (
        ApiError(status=500, reason="InternalError", message="etcd timeout") if path == DEVICE else None
    )
    with pytest.raises(ApiError, match="etcd timeout"):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    assert reservations(kube) == []


async def test_cancellation_mid_commit_withdraws_the_booking(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    snap = await ledger.snapshot()
    kube.fail = lambda op, path: asyncio.CancelledError() if path == DEVICE and op == "merge_patch" else None
    with pytest.raises(asyncio.CancelledError):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    assert reservations(kube) == []
    assert names(await ledger.snapshot()) == set()


async def test_concurrent_refusals_share_one_consistent_read(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    before = lists(kube)
    # The first read starts before the others arrive; they share the next one (two reads of two LISTs).
    await asyncio.gather(*(ledger.snapshot(fresh=True) for _ in range(8)))
    assert lists(kube) == before + 4
    await ledger.snapshot(fresh=True)  # a later refusal gets a read of its own
    assert lists(kube) == before + 6


async def test_reservations_labelled_inactive_leave_the_view(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    snap = await ledger.snapshot()
    await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid])
    await settle()
    (path,) = reservations(kube)
    await kube.merge_patch(path, {"metadata": {"labels": {"vramshare.io/active": "false"}}})
    await settle()
    assert names(await ledger.snapshot()) == set()
    assert names(await ledger.snapshot(fresh=True)) == set()


async def test_a_booking_is_taken_up_by_one_reinvocation_only() -> None:
    kube = await cluster()
    ledger = KubeLedger(kube)  # type: ignore[arg-type]
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


async def test_a_claim_survives_an_unrelated_change_landing_first() -> None:
    """The committed label lands after the pass read the booking: the claim is retried, not lost."""
    kube = await cluster()
    ledger = KubeLedger(kube)  # type: ignore[arg-type]
    await kube.create(reservations_path("jobs"), booking().to_wire())
    read = await ledger.get_reservation("jobs", "task-1")
    assert read is not None
    await kube.merge_patch(
        reservations_path("jobs", "task-1"), {"metadata": {"labels": {LABEL_COMMITTED: "true"}}}
    )
    assert await ledger.claim_reinvocation(read, claimant="uid-2")
    assert kube.objects[reservations_path("jobs", "task-1")]["metadata"]["annotations"] == {
        "vramshare.io/reinvoked-by": "uid-2"
    }


async def test_a_decision_on_a_consistent_read_does_not_ride_on_our_own_later_commits(
    running: tuple[FakeKube, KubeLedger],
) -> None:
    """A shared consistent read may predate this process's other decisions: committing on it after
    one of them moved the token must conflict (and decide again), not follow the chain."""
    kube, ledger = running
    fresh = await ledger.snapshot(fresh=True)
    assert not fresh.live
    live = await ledger.snapshot()
    assert live.live
    await ledger.commit(reservation=booking("a"), token=live.tokens[GPU.uuid], live=True)
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking("b"), token=fresh.tokens[GPU.uuid], live=False)
    await settle()
    assert [p.rsplit("/", 1)[1] for p in reservations(kube)] == ["a"]


async def test_a_token_nobody_can_vouch_for_sends_the_view_to_a_consistent_read() -> None:
    """A GPU whose ledger annotation carries no version (written before vramshare recorded it) can be
    vouched for only by a consistent read, even beside a GPU whose token names a version: the view's
    check once took the largest version over all GPUs, and that hid the unknown one."""
    kube = await cluster()
    other = gpu("GPU-b", total=16_384)
    await add_idle_gpu(kube, other)
    await kube.merge_patch(DEVICE, {"metadata": {"annotations": {ANNOTATION_LEDGER: "jobs/old"}}})
    await kube.merge_patch(
        devices_path("gpu-b"), {"metadata": {"annotations": {ANNOTATION_LEDGER: "jobs/x@1"}}}
    )
    async with fed(KubeLedger(kube)) as ledger:  # type: ignore[arg-type]
        await settle()
        before = lists(kube)
        snapshot = await ledger.snapshot()
        assert not snapshot.live
        assert lists(kube) > before


async def test_the_view_dates_unchanged_gpus_by_the_heartbeat_once_its_devices_hold_it() -> None:
    """Issue #31: the controller no longer rewrites an unchanged GPU's sample time; the heartbeat on
    its Lease says the stored figures were read again. The view applies it only once its device
    stream has passed the heartbeat's devices_version."""
    kube = await cluster()
    latest: list[InventoryHeartbeat | None] = [None]
    ledger = KubeLedger(kube, heartbeat=HeartbeatSource(lambda: latest[0]))  # type: ignore[arg-type]
    async with fed(ledger):
        seen = ledger.devices.resource_version
        assert (await ledger.snapshot()).gpus[0].sampled_at == NOW
        # Something written after what the device stream holds (as a poll's status write would be).
        await kube.create("/api/v1/namespaces/default/configmaps", {"metadata": {"name": "elsewhere"}})
        latest[0] = InventoryHeartbeat(sampled_at=NOW + 60, devices_version=seen + 1)
        assert (await ledger.snapshot()).gpus[0].sampled_at == NOW  # its write not seen yet
        fresh = await ledger.snapshot(fresh=True)  # a consistent read lists at a later version
        assert fresh.gpus[0].sampled_at == NOW + 60
        await kube.merge_patch(DEVICE, {"metadata": {"annotations": {"example.com/touched": "1"}}})
        await settle()
        assert ledger.devices.resource_version >= seen + 1
        dated = (await ledger.snapshot()).gpus
        assert dated[0].sampled_at == NOW + 60
        assert (await ledger.snapshot()).gpus[0] is dated[0]  # the same object while nothing changes
        latest[0] = InventoryHeartbeat(
            sampled_at=NOW + 90, devices_version=seen + 1, unconfirmed=frozenset({GPU.uuid})
        )
        assert (await ledger.snapshot()).gpus[0].sampled_at == NOW  # unconfirmed: its stored time
