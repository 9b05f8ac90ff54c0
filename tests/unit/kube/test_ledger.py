"""KubeLedger's commit protocol against a fake client: withdrawal on conflict, error and cancellation,
and the snapshot cache."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.unit.domain.builders import NOW, gpu
from tests.unit.fake_kube import FakeKube, add_idle_gpu
from vramshare.domain import Accounting, has_room_for_its_bookings
from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.domain.snapshot import CommitConflictError, Snapshot
from vramshare.kube.client import ApiError
from vramshare.kube.lease_watch import HeartbeatSource
from vramshare.kube.ledger import KubeLedger, last_commit_version
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.resources import ANNOTATION_LEDGER, LABEL_COMMITTED, devices_path, reservations_path

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


@pytest_asyncio.fixture(loop_scope="function")  # the test's own loop, so the watch runs during it
async def running() -> AsyncIterator[tuple[FakeKube, KubeLedger]]:
    """A ledger whose watch caches are fed from the fake API server."""
    kube = await cluster()
    async with fed(KubeLedger(kube)) as ledger:  # type: ignore[arg-type]
        yield kube, ledger


@pytest_asyncio.fixture(loop_scope="function")
async def rebasing() -> AsyncIterator[tuple[FakeKube, KubeLedger, list[str]]]:
    """As `running`, with the webhook's room check (no safety margin: the GPU holds 16384 MiB of
    bookings); the list records each commit that stood on a newer token."""
    kube = await cluster()
    rebases: list[str] = []
    ledger = KubeLedger(
        kube,  # type: ignore[arg-type]
        has_room=lambda g, index: has_room_for_its_bookings(
            g, index, accounting=Accounting(safety_margin_mib=0), now=NOW
        ),
        on_rebase=lambda: rebases.append("rebased"),
    )
    async with fed(ledger):
        yield kube, ledger, rebases


@contextlib.asynccontextmanager
async def fed(ledger: KubeLedger) -> AsyncIterator[KubeLedger]:
    task = asyncio.create_task(ledger.run())
    await asyncio.wait_for(ledger.devices.synced.wait(), 2)
    await asyncio.wait_for(ledger.reservations.synced.wait(), 2)
    yield ledger
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def settle() -> None:
    """Let the watch streams deliver what was just written."""
    await asyncio.sleep(0.05)


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


async def test_commits_decided_together_share_one_bump(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    commits = [
        asyncio.create_task(ledger.commit(reservation=booking(f"t{i}"), token=token, live=True))
        for i in range(6)
    ]
    made = await asyncio.gather(*commits)
    bumps = sum(op == "merge_patch" and path == DEVICE for op, path in kube.calls)
    assert len(reservations(kube)) == 6
    assert bumps == 1  # all six were decided before the GPU's committer first ran: one group
    newest = max(made, key=lambda c: int(c.meta.resource_version))
    assert kube.objects[DEVICE]["metadata"]["annotations"][ANNOTATION_LEDGER] == (
        f"jobs/{newest.name}@{newest.meta.resource_version}"
    )


async def test_a_booking_is_created_while_the_bump_ahead_of_it_is_on_its_way(
    running: tuple[FakeKube, KubeLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU's bumps go one at a time, but a booking decided meanwhile is created at once: its create
    does not wait for the bump ahead of it (issue #45), and the next bump names it."""
    kube, ledger = running
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    patch = kube.merge_patch
    bump_started, release = asyncio.Event(), asyncio.Event()

    async def slow_first_bump(path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path == DEVICE and not bump_started.is_set():
            bump_started.set()
            await release.wait()
        return await patch(path, body)

    monkeypatch.setattr(kube, "merge_patch", slow_first_bump)
    first = asyncio.create_task(ledger.commit(reservation=booking("first"), token=token, live=True))
    await asyncio.wait_for(bump_started.wait(), 2)
    second = asyncio.create_task(ledger.commit(reservation=booking("second"), token=token, live=True))
    for _ in range(20):
        await asyncio.sleep(0)
    assert f"{reservations_path('jobs')}/second" in kube.objects  # created while the bump waits
    assert not second.done()  # but not answered before a bump names it
    release.set()
    await first
    made = await second
    bumps = sum(op == "merge_patch" and path == DEVICE for op, path in kube.calls)
    assert bumps == 2
    assert kube.objects[DEVICE]["metadata"]["annotations"][ANNOTATION_LEDGER] == (
        f"jobs/second@{made.meta.resource_version}"
    )


async def test_a_bump_never_names_an_older_booking_than_the_bump_before_it(
    running: tuple[FakeKube, KubeLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first group's create finishes after the second group's: the second bump still names a
    version covering the first's booking, or a view waiting for its mark could miss that booking."""
    kube, ledger = running
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    create = kube.create
    second_made = asyncio.Event()

    async def first_create_finishes_last(path: str, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if obj["metadata"]["name"] == "first":
            await second_made.wait()
            return await create(path, obj, **kw)
        made = await create(path, obj, **kw)
        second_made.set()
        return made

    monkeypatch.setattr(kube, "create", first_create_finishes_last)
    first = asyncio.create_task(ledger.commit(reservation=booking("first"), token=token, live=True))
    for _ in range(5):
        await asyncio.sleep(0)  # the first group forms with the first booking alone
    second = asyncio.create_task(ledger.commit(reservation=booking("second"), token=token, live=True))
    one, two = await asyncio.wait_for(asyncio.gather(first, second), 5)  # a chained create never comes
    assert int(one.meta.resource_version) > int(two.meta.resource_version)
    device = GpuDevice.from_wire(kube.objects[DEVICE])
    assert device.meta.annotations[ANNOTATION_LEDGER].startswith("jobs/second@")
    assert last_commit_version(device) >= int(one.meta.resource_version)


async def test_a_caller_that_gives_up_leaves_no_booking(running: tuple[FakeKube, KubeLedger]) -> None:
    kube, ledger = running
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    first = asyncio.create_task(ledger.commit(reservation=booking("kept"), token=token, live=True))
    queued = asyncio.create_task(ledger.commit(reservation=booking("given-up"), token=token, live=True))
    await asyncio.sleep(0)
    queued.cancel()
    await first
    with pytest.raises(asyncio.CancelledError):
        await queued
    await settle()
    assert [p.rsplit("/", 1)[1] for p in reservations(kube)] == ["kept"]
    assert names(await ledger.snapshot()) == {"kept"}


async def test_a_new_sample_does_not_fail_a_commit(running: tuple[FakeKube, KubeLedger]) -> None:
    """The controller's status write moves the resourceVersion but commits nothing: the bump is retried."""
    kube, ledger = running
    snap = await ledger.snapshot()
    await kube.merge_patch(f"{DEVICE}/status", {"status": {"usedMiB": 100, "freeMiB": 16_284}})
    created = await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid], live=True)
    assert kube.objects[DEVICE]["metadata"]["annotations"][ANNOTATION_LEDGER] == (
        f"jobs/task-1@{created.meta.resource_version}"
    )
    assert len(reservations(kube)) == 1


async def test_a_gpu_taken_out_of_sharing_meanwhile_fails_the_commit(
    running: tuple[FakeKube, KubeLedger],
) -> None:
    """A status write that takes the GPU out of sharing (a hold being given back to NVIDIA's device
    plugin) between the decision and the bump ends the commit: it decides again and books nothing there."""
    kube, ledger = running
    snap = await ledger.snapshot()
    await kube.merge_patch(f"{DEVICE}/status", {"status": {"state": "NotShared"}})
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking(), token=snap.tokens[GPU.uuid], live=True)
    await settle()
    assert reservations(kube) == []


async def commit_elsewhere(kube: FakeKube, name: str, mib: int) -> None:
    """Another replica's commit on the GPU: its reservation, then the token naming it."""
    created = await kube.create(reservations_path("jobs"), booking(name, mib).to_wire())
    mark = f"jobs/{name}@{created['metadata']['resourceVersion']}"
    await kube.merge_patch(DEVICE, {"metadata": {"annotations": {ANNOTATION_LEDGER: mark}}})


def deletes(kube: FakeKube) -> int:
    return sum(op == "delete" for op, _ in kube.calls)


async def test_a_commit_that_lost_its_race_stands_where_the_gpu_still_has_room(
    rebasing: tuple[FakeKube, KubeLedger, list[str]],
) -> None:
    kube, ledger, rebases = rebasing
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    await commit_elsewhere(kube, "theirs", 8192)  # the winner: 8192 + our 4096 still fit in 16384
    mine = await ledger.commit(reservation=booking("mine"), token=token, live=True)
    await settle()
    assert sorted(p.rsplit("/", 1)[1] for p in reservations(kube)) == ["mine", "theirs"]
    assert deletes(kube) == 0  # not withdrawn and made again
    assert rebases == ["rebased"]
    assert kube.objects[DEVICE]["metadata"]["annotations"][ANNOTATION_LEDGER] == (
        f"jobs/mine@{mine.meta.resource_version}"
    )


async def test_a_commit_that_lost_its_race_to_a_fuller_gpu_decides_again(
    rebasing: tuple[FakeKube, KubeLedger, list[str]],
) -> None:
    kube, ledger, rebases = rebasing
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    await commit_elsewhere(kube, "theirs", 12_800)  # 12800 + 4096 > 16384
    with pytest.raises(CommitConflictError):
        await ledger.commit(reservation=booking("mine"), token=token, live=True)
    await settle()
    assert [p.rsplit("/", 1)[1] for p in reservations(kube)] == ["theirs"]
    assert rebases == []
    assert names(await ledger.snapshot()) == {"theirs"}


async def test_a_decision_made_before_a_rebase_does_not_ride_on_it(
    rebasing: tuple[FakeKube, KubeLedger, list[str]],
) -> None:
    """Our later commits follow our own earlier ones on a GPU (their views held them). A commit that
    stood on another replica's token is followed only by decisions that saw that token: one made on
    the older token never counted the other replica's booking, so it is checked again, and here the
    GPU has no room left for it."""
    kube, ledger, rebases = rebasing
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    await commit_elsewhere(kube, "theirs", 8192)
    await ledger.commit(reservation=booking("first"), token=token, live=True)  # stands: 12288
    with pytest.raises(CommitConflictError):  # 8192 + 4096 + 5000 > 16384
        await ledger.commit(reservation=booking("second", 5000), token=token, live=True)
    await settle()
    assert sorted(p.rsplit("/", 1)[1] for p in reservations(kube)) == ["first", "theirs"]
    assert rebases == ["rebased"]


async def test_a_commit_that_stood_over_a_newer_booking_names_a_version_covering_it(
    rebasing: tuple[FakeKube, KubeLedger, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ours is created first, the other replica's commit lands before our bump: the token we leave
    must still make a view wait for the other's booking, which is newer than ours."""
    kube, ledger, rebases = rebasing
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    patch = kube.merge_patch

    async def other_replica_first(path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path == DEVICE and not rebases and "theirs" not in str(kube.objects):
            await commit_elsewhere(kube, "theirs", 4096)
        return await patch(path, body)

    monkeypatch.setattr(kube, "merge_patch", other_replica_first)
    mine = await ledger.commit(reservation=booking("mine"), token=token, live=True)
    theirs = kube.objects[f"{reservations_path('jobs')}/theirs"]
    assert int(theirs["metadata"]["resourceVersion"]) > int(mine.meta.resource_version)
    device = GpuDevice.from_wire(kube.objects[DEVICE])
    assert device.meta.annotations[ANNOTATION_LEDGER].startswith("jobs/mine@")
    assert last_commit_version(device) >= int(theirs["metadata"]["resourceVersion"])
    assert rebases == ["rebased"]


async def queue_entry(kube: FakeKube, name: str = "waiting") -> GpuReservation:
    entry = GpuReservation.queued(name=name, namespace="jobs", pod=name, mib=4096, admission_uid="u1")
    return GpuReservation.from_wire(await kube.create(reservations_path("jobs"), entry.to_wire()))


async def test_a_placement_whose_caller_gives_up_after_its_commit_stands_and_is_labelled(
    running: tuple[FakeKube, KubeLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader whose term ends (its loops cancelled) just after the GPU's token moved: the placement
    is committed and its pod waits gated, so it stands for the next leader to release."""
    kube, ledger = running
    entry = await queue_entry(kube)
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    patch = kube.merge_patch
    caller: list[asyncio.Task[GpuReservation]] = []

    async def term_ends_after_the_bump(path: str, body: dict[str, Any]) -> dict[str, Any]:
        result = await patch(path, body)
        if path == DEVICE:
            caller[0].cancel()
        return result

    monkeypatch.setattr(kube, "merge_patch", term_ends_after_the_bump)
    caller.append(asyncio.create_task(ledger.place(entry=entry, gpu=GPU, token=token, live=True)))
    with pytest.raises(asyncio.CancelledError):
        await caller[0]
    await settle()
    stored = kube.objects[f"{reservations_path('jobs')}/waiting"]
    assert stored["spec"]["gpuUUID"] == GPU.uuid
    assert stored["metadata"]["labels"][LABEL_COMMITTED] == "true"


async def test_a_lost_placement_is_not_withdrawn_over_a_change_made_since(
    running: tuple[FakeKube, KubeLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placement's commit loses its race, but another leader took the entry over meanwhile: the
    withdrawal carries the placement's own resourceVersion, so it cannot undo that leader's work."""
    kube, ledger = running
    entry = await queue_entry(kube)
    token = (await ledger.snapshot()).tokens[GPU.uuid]
    patch = kube.merge_patch
    path = f"{reservations_path('jobs')}/waiting"

    async def another_leader_first(target: str, body: dict[str, Any]) -> dict[str, Any]:
        if target == DEVICE and "theirs" not in str(kube.objects):
            await patch(path, {"metadata": {"labels": {LABEL_COMMITTED: "true"}}})
            await commit_elsewhere(kube, "theirs", 4096)
        return await patch(target, body)

    monkeypatch.setattr(kube, "merge_patch", another_leader_first)
    with pytest.raises(CommitConflictError):
        await ledger.place(entry=entry, gpu=GPU, token=token, live=True)
    assert kube.objects[path]["spec"]["gpuUUID"] == GPU.uuid
    assert kube.objects[path]["metadata"]["labels"][LABEL_COMMITTED] == "true"


async def test_withdrawing_a_hold_never_holds_up_the_answer() -> None:
    """It runs after the task's commit succeeded: a slow delete used to take the admission past its
    deadline, which then answered Late while the booking stood (issue #30, 6)."""
    kube = await cluster()
    ledger = KubeLedger(kube)  # type: ignore[arg-type]
    hold = GpuReservation.new(
        name="task-1", namespace="jobs", pod="task", mib=4096, gpu=GPU, admission_uid="u1", held_for="k"
    )
    await kube.create(reservations_path("jobs"), hold.to_wire())
    released = asyncio.Event()
    slow_delete = kube.delete

    async def delete(path: str, **kw: Any) -> Any:
        await released.wait()
        return await slow_delete(path, **kw)

    kube.delete = delete  # type: ignore[method-assign]
    await asyncio.wait_for(ledger.withdraw_hold("jobs", "task-1"), timeout=0.5)
    assert reservations_path("jobs", "task-1") in kube.objects  # not yet: in the background
    released.set()
    for _ in range(50):
        if reservations_path("jobs", "task-1") not in kube.objects:
            break
        await asyncio.sleep(0.01)
    assert reservations_path("jobs", "task-1") not in kube.objects


async def test_the_committed_label_is_retried_and_a_shutdown_waits_for_it(
    running: tuple[FakeKube, KubeLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    kube, ledger = running
    monkeypatch.setattr("vramshare.kube.ledger.commit.LABEL_BACKOFF_S", 0.05)
    failures = [2]

    def flaky(op: str, path: str) -> Exception | None:
        if op == "merge_patch" and "/gpureservations/" in path and failures[0] > 0:
            failures[0] -= 1
            return ApiError(status=503, reason="ServiceUnavailable", message="etcd leader changed")
        return None

    kube.fail = flaky
    snap = await ledger.snapshot()
    await ledger.commit(reservation=hold(), token=snap.tokens[GPU.uuid])
    (path,) = reservations(kube)
    assert kube.objects[path]["metadata"]["labels"][LABEL_COMMITTED] == "false"  # the first tries failed
    assert await ledger.drain(timeout_s=5) == 0  # shutting down: the label still lands
    assert kube.objects[path]["metadata"]["labels"][LABEL_COMMITTED] == "true"
    assert failures == [0]


async def test_a_label_that_keeps_failing_is_given_up_and_drain_is_bounded(
    running: tuple[FakeKube, KubeLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    kube, ledger = running
    monkeypatch.setattr("vramshare.kube.ledger.commit.LABEL_BACKOFF_S", 10.0)
    kube.fail = lambda op, path: (
        ApiError(status=503, reason="ServiceUnavailable", message="down")
        if op == "merge_patch" and "/gpureservations/" in path
        else None
    )
    snap = await ledger.snapshot()
    await ledger.commit(reservation=hold(), token=snap.tokens[GPU.uuid])
    assert await ledger.drain(timeout_s=0.2) == 1  # still backing off: left behind, not waited for


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
