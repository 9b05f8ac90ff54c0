"""KubeLedger's commits together: one bump per group, creates that do not wait for the bump ahead,
commits that lost their race (standing on the newer token or deciding again), queue placements and
holds, the committed label, and drain on shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.fake_kube import FakeKube
from tests.unit.kube.ledger_harness import (
    DEVICE,
    GPU,
    booking,
    cluster,
    commit_elsewhere,
    deletes,
    fed,
    hold,
    names,
    queue_entry,
    reservations,
    settle,
)
from vramshare.domain.snapshot import CommitConflictError
from vramshare.kube.client import ApiError
from vramshare.kube.ledger import KubeLedger, last_commit_version
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.resources import ANNOTATION_LEDGER, LABEL_COMMITTED, reservations_path


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


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@settings(max_examples=60, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 8), st.integers(0, 8)),  # arrival, create, bump
        min_size=2,
        max_size=8,
    )
)
def test_a_committed_booking_is_always_covered_by_its_gpus_mark(
    plan: list[tuple[int, int, int]],
) -> None:
    """Whatever order creates and bumps finish in: once a commit is answered, the GPU's mark names a
    version at least its booking's, so a view that waits for the mark holds it; every booking stands
    and the token moved at most once per booking."""

    async def scenario() -> None:
        kube = await cluster()
        create, patch = kube.create, kube.merge_patch
        delays = {f"b{i}": c for i, (_, c, _) in enumerate(plan)}
        bump_delays = iter([b for _, _, b in plan] * 2)

        async def slow_create(path: str, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
            await _turns(delays.get(obj["metadata"]["name"], 0))
            return await create(path, obj, **kw)

        async def slow_bump(path: str, body: dict[str, Any]) -> dict[str, Any]:
            if path == DEVICE:
                await _turns(next(bump_delays, 0))
            return await patch(path, body)

        kube.create, kube.merge_patch = slow_create, slow_bump  # type: ignore[method-assign]
        async with fed(KubeLedger(kube)) as ledger:  # type: ignore[arg-type]
            token = (await ledger.snapshot()).tokens[GPU.uuid]
            answered: list[int] = []

            async def one(i: int, arrival: int) -> None:
                await _turns(arrival)
                made = await ledger.commit(reservation=booking(f"b{i}", 512), token=token, live=True)
                answered.append(int(made.meta.resource_version))
                device = GpuDevice.from_wire(kube.objects[DEVICE])
                assert last_commit_version(device) >= max(answered), (i, plan)

            await asyncio.wait_for(asyncio.gather(*(one(i, a) for i, (a, _, _) in enumerate(plan))), 5)
        final = GpuDevice.from_wire(kube.objects[DEVICE])
        assert last_commit_version(final) >= max(answered), plan
        assert len(reservations(kube)) == len(plan)
        assert sum(op == "merge_patch" and path == DEVICE for op, path in kube.calls) <= len(plan)

    asyncio.run(scenario())


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
    monkeypatch.setattr("vramshare.kube.ledger.writes.LABEL_BACKOFF_S", 0.05)
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
    monkeypatch.setattr("vramshare.kube.ledger.writes.LABEL_BACKOFF_S", 10.0)
    kube.fail = lambda op, path: (
        ApiError(status=503, reason="ServiceUnavailable", message="down")
        if op == "merge_patch" and "/gpureservations/" in path
        else None
    )
    snap = await ledger.snapshot()
    await ledger.commit(reservation=hold(), token=snap.tokens[GPU.uuid])
    assert await ledger.drain(timeout_s=0.2) == 1  # still backing off: left behind, not waited for
