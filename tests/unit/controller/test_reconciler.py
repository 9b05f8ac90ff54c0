"""ReservationReconciler against a fake client: its own pod only, impostors ignored with one event,
a booking whose pod never appears looked at again when its TTL runs out, and absence confirmed
before it is acted on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.unit.domain.builders import NOW, gpu
from tests.unit.fake_kube import FakeKube, add_idle_gpu, fed_state
from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.reservations import ReservationReconciler
from vramshare.controller.settings import ControllerSettings
from vramshare.domain.inventory import GpuPresence
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import format_time, reservations_path

GPU = gpu("GPU-a")
PRESENT = GpuPresence(known=frozenset({"GPU-a"}))
PATH = reservations_path("jobs", "task-ab12")
KEY = "jobs/task-ab12"


@contextlib.asynccontextmanager
async def setup(
    *, ttl_s: float = 20.0, now: list[float] | None = None, bind_wait_s: float = 0.0
) -> AsyncIterator[tuple[FakeKube, ReservationReconciler]]:
    """A reconciler and one booking; binding at first sight unless `bind_wait_s` says otherwise."""
    clock = now or [NOW]
    kube = FakeKube(clock=lambda: clock[0])
    booking = GpuReservation.new(
        name="task-ab12", namespace="jobs", pod="task", mib=4096, gpu=GPU, admission_uid="u1", user="airflow"
    )
    await kube.create(reservations_path("jobs"), booking.to_wire())
    async with fed_state(kube) as state:
        reconciler = ReservationReconciler(
            kube=kube,  # type: ignore[arg-type]
            settings=ControllerSettings(reservation_ttl_s=ttl_s, identity="test", bind_wait_s=bind_wait_s),
            metrics=ControllerMetrics(),
            state=state,
            clock=lambda: clock[0],
        )
        yield kube, reconciler


async def fed() -> None:
    """Let the watch caches take in what was just written."""
    await asyncio.sleep(0.05)


async def add_pod(
    kube: FakeKube, name: str, *, gpu_uuid: str | None = "GPU-a", created: float = NOW
) -> dict[str, Any]:
    annotations = {"vramshare.io/gpu-uuid": gpu_uuid} if gpu_uuid else {}
    return await kube.create(
        "/api/v1/namespaces/jobs/pods",
        {
            "metadata": {
                "name": name,
                "namespace": "jobs",
                "uid": f"uid-{name}",
                "creationTimestamp": format_time(created),
                "labels": {"vramshare.io/reservation": "task-ab12"},
                "annotations": annotations,
            },
            "status": {"phase": "Running"},
        },
    )


def status(kube: FakeKube) -> dict[str, Any]:
    return kube.objects[PATH].get("status", {})  # type: ignore[no-any-return]


def events(kube: FakeKube) -> list[dict[str, Any]]:
    return [o for p, o in kube.objects.items() if "/events/" in p]


async def test_the_sweep_binds_its_own_pod_and_flags_an_impostor_once() -> None:
    async with setup() as (kube, reconciler):
        await add_pod(kube, "task", created=NOW + 1)
        await add_pod(kube, "by-hand", gpu_uuid=None, created=NOW + 2)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        assert reconciler.bound_pod(KEY) == "uid-task"
        assert status_writes(kube) == 0  # bound in memory (issue #45)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        flagged = [e for e in events(kube) if e["reason"] == "ReservationNotYours"]
        assert [e["involvedObject"]["name"] for e in flagged] == ["by-hand"]
        assert reconciler.metrics.impostor_pods._value.get() == 1


async def test_a_sweep_reads_the_caches_not_the_api() -> None:
    async with setup() as (kube, reconciler):
        await add_pod(kube, "task", created=NOW + 1)
        await fed()
        before = sum(op == "list" for op, _ in kube.calls)
        await reconciler.sweep(presence=PRESENT)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        assert sum(op == "list" for op, _ in kube.calls) == before


async def test_a_pod_event_plans_from_the_cache_and_a_stale_copy_only_costs_a_fresh_look() -> None:
    async with setup() as (kube, reconciler):
        own = await add_pod(kube, "task", created=NOW + 1)
        await fed()
        gets = sum(op == "get" and path == PATH for op, path in kube.calls)
        await reconciler.pod_changed(own, deleted=False, presence=PRESENT)
        assert reconciler.bound_pod(KEY) == "uid-task"
        assert sum(op == "get" and path == PATH for op, path in kube.calls) == gets  # no read per pod event
        # The cache lags behind a write (someone else's): the plan's precondition fails, and the
        # reservation is looked at again on a fresh read, not left to the next sweep.
        stale = reconciler.state.reservations.items["jobs/task-ab12"]
        await kube.merge_patch(PATH, {"metadata": {"annotations": {"example.com/by-hand": "yes"}}})
        reconciler.state.reservations.items["jobs/task-ab12"] = stale
        await kube.delete("/api/v1/namespaces/jobs/pods/task")
        await reconciler.pod_changed(own, deleted=True, presence=PRESENT)
        for _ in range(50):
            if PATH not in kube.objects:
                break
            await asyncio.sleep(0.01)
        assert PATH not in kube.objects  # its pod is gone: deleted, as through an ownerReference
        assert sum(op == "get" and path == PATH for op, path in kube.calls) > gets


async def test_a_pod_the_cache_has_not_seen_yet_is_not_taken_for_gone() -> None:
    async with setup() as (kube, reconciler):
        own = await add_pod(kube, "task", created=NOW + 1)
        await reconciler.pod_changed(own, deleted=False, presence=PRESENT)  # bound through kopf's stream
        await fed()
        reconciler.state.pods.drop("jobs/task")  # the cache lags behind
        await reconciler.sweep(presence=PRESENT)
        assert PATH in kube.objects  # the direct read found the pod
        assert "phase" not in status(kube)
        assert reconciler.bound_pod(KEY) == "uid-task"


async def test_an_impostors_deletion_does_not_release_the_booking() -> None:
    async with setup() as (kube, reconciler):
        own = await add_pod(kube, "task", created=NOW + 1)
        impostor = await add_pod(kube, "by-hand", created=NOW + 2)
        await reconciler.pod_changed(own, deleted=False, presence=PRESENT)
        assert reconciler.bound_pod(KEY) == "uid-task"
        await reconciler.pod_changed(impostor, deleted=True, presence=PRESENT)
        assert PATH in kube.objects
        assert "phase" not in status(kube)
        await reconciler.pod_changed(own, deleted=True, presence=PRESENT)
        assert PATH not in kube.objects  # its own pod's deletion ends it


@pytest.mark.slow
async def test_a_booking_whose_pod_never_appears_expires_when_its_ttl_runs_out() -> None:
    now = [NOW]
    async with setup(ttl_s=0.2, now=now) as (kube, reconciler):
        now[0] = NOW + 0.3  # the TTL has run out by the time the timer fires
        reconciler.reservation_changed(GpuReservation.from_wire(kube.objects[PATH]), presence=lambda: PRESENT)
        await asyncio.sleep(0.05)
        assert "phase" not in status(kube)  # not yet: the check waits for the TTL plus a moment
        await asyncio.sleep(0.6)
        assert (status(kube)["phase"], status(kube)["reason"]) == ("Expired", "PodNeverCreated")
        assert kube.objects[PATH]["metadata"]["labels"]["vramshare.io/active"] == "false"
        (event,) = events(kube)
        assert (event["reason"], event["involvedObject"]["kind"]) == ("PodNeverCreated", "GpuReservation")


@pytest.mark.slow
async def test_a_look_that_came_early_is_taken_again_when_due_not_at_the_next_sweep() -> None:
    """The timer is set on an estimate of the API server's clock; when it fires a moment before the
    TTL has run out on that clock, the booking used to wait for the next sweep (10 s by default)."""
    now = [NOW]
    async with setup(ttl_s=0.2, now=now) as (kube, reconciler):
        now[0] = NOW + 0.1  # when the timer fires, the server's clock says 0.1 s: not due yet
        reconciler.reservation_changed(GpuReservation.from_wire(kube.objects[PATH]), presence=lambda: PRESENT)
        await asyncio.sleep(0.65)
        assert status(kube).get("phase") == "Reserved"  # looked at, not due
        now[0] = NOW + 0.3  # due now: the next look, 0.5 s after the early one, expires it
        await asyncio.sleep(0.7)
        assert (status(kube)["phase"], status(kube)["reason"]) == ("Expired", "PodNeverCreated")


async def test_a_late_pod_revives_its_expired_booking() -> None:
    now = [NOW]
    async with setup(now=now) as (kube, reconciler):
        now[0] = NOW + 25
        await reconciler.sweep(presence=PRESENT)
        assert status(kube)["phase"] == "Expired"
        late = await add_pod(kube, "task", created=NOW + 24)
        await reconciler.pod_changed(late, deleted=False, presence=PRESENT)
        assert (status(kube)["phase"], status(kube)["reason"]) == ("Bound", "PodAppearedLate")
        assert "finishedAt" not in status(kube)
        assert kube.objects[PATH]["metadata"]["labels"]["vramshare.io/active"] == "true"


async def test_a_late_pod_on_a_gpu_booked_full_since_is_said_to_overbook_it() -> None:
    now = [NOW]
    async with setup(now=now) as (kube, reconciler):
        await add_idle_gpu(kube, GPU)  # 16384 MiB
        now[0] = NOW + 25
        await reconciler.sweep(presence=PRESENT)
        assert status(kube)["phase"] == "Expired"
        # Meanwhile the memory went to another pod: 14000 MiB of the 16384 (margin 512 by default).
        other = GpuReservation.new(
            name="other-1", namespace="jobs", pod="other", mib=14_000, gpu=GPU, admission_uid="u2"
        )
        await kube.create(reservations_path("jobs"), other.to_wire())
        await kube.merge_patch(
            f"{reservations_path('jobs', 'other-1')}/status", {"status": {"phase": "Bound"}}
        )
        await fed()
        late = await add_pod(kube, "task", created=NOW + 24)
        await reconciler.pod_changed(late, deleted=False, presence=PRESENT)
        assert (status(kube)["phase"], status(kube)["reason"]) == (
            "Bound",
            "PodAppearedLate",
        )  # it runs there
        (event,) = [e for e in events(kube) if e["reason"] == "GpuReservedLate"]
        # 14000 + 4096 + margin 512 = 18608 against 16384: 2224 MiB past.
        assert "is now booked 2224 MiB past what it can hold" in event["message"]
        assert "vramshare evicts nothing" in event["message"]
        assert reconciler.metrics.overbooked_by_late_pods._value.get() == 1  # type: ignore[attr-defined]


async def test_a_deleted_booking_stays_until_its_pod_is_gone_then_goes_at_once() -> None:
    """Issue #30, 5: its namespace deleted while the pod terminates (the API server marks the booking
    deleted; vramshare's finalizer keeps it). It still counts while the pod is there, one event says
    why it is still there, and it goes the moment the pod's deletion is seen."""
    async with setup() as (kube, reconciler):
        pod = await add_pod(kube, "task", created=NOW + 1)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        assert reconciler.bound_pod(KEY) == "uid-task"
        await kube.delete(PATH)  # a namespace deletion, or the pod's foreground deletion
        assert kube.objects[PATH]["metadata"]["deletionTimestamp"]
        await fed()
        for _ in range(3):
            await reconciler.sweep(presence=PRESENT)
            await fed()
        assert PATH in kube.objects
        assert "phase" not in status(kube)
        waits = [e for e in events(kube) if e["reason"] == "ReleaseWaitsForPod"]
        assert len(waits) == 1
        assert "4096 MiB on GPU-a stay booked until pod task has terminated" in waits[0]["message"]
        await kube.delete("/api/v1/namespaces/jobs/pods/task")
        await reconciler.pod_changed(pod, deleted=True, presence=PRESENT)
        assert PATH not in kube.objects


async def test_a_reservation_event_for_a_deleted_booking_whose_pod_is_gone_lets_it_go() -> None:
    """The pod went first, then the booking was deleted (by hand, its namespace, or the garbage
    collector through an ownerReference of an older vramshare) before the pod's deletion reached the
    controller: the deletion's own event brings the look, not the next sweep."""
    async with setup() as (kube, reconciler):
        await add_pod(kube, "task", created=NOW + 1)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        assert reconciler.bound_pod(KEY) == "uid-task"
        await kube.delete("/api/v1/namespaces/jobs/pods/task")
        deleted = await kube.delete(PATH)
        assert PATH in kube.objects  # kept by its finalizer
        reconciler.reservation_changed(GpuReservation.from_wire(deleted), presence=lambda: PRESENT)
        for _ in range(20):
            if PATH not in kube.objects:
                break
            await asyncio.sleep(0.01)
        assert PATH not in kube.objects


async def test_cleanup_after_retention_removes_the_finalizer_and_deletes() -> None:
    now = [NOW]
    async with setup(now=now) as (kube, reconciler):
        pod = await add_pod(kube, "task", created=NOW + 1)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        pod["status"]["phase"] = "Succeeded"
        await reconciler.pod_changed(pod, deleted=False, presence=PRESENT)
        assert status(kube)["phase"] == "Released"
        now[0] += reconciler.settings.retention_s + 1
        await fed()
        await reconciler.sweep(presence=PRESENT)
        assert PATH not in kube.objects


async def add_pending_pod(kube: FakeKube, name: str, *, created: float) -> dict[str, Any]:
    """A pod that exists and has not run yet (no container started)."""
    await add_pod(kube, name, created=created)
    path = f"/api/v1/namespaces/jobs/pods/{name}/status"
    return await kube.merge_patch(path, {"status": {"phase": "Pending"}})


async def started(kube: FakeKube, name: str, *, at: float) -> dict[str, Any]:
    running = {"running": {"startedAt": format_time(at)}}
    return await kube.merge_patch(
        f"/api/v1/namespaces/jobs/pods/{name}/status",
        {"status": {"phase": "Running", "containerStatuses": [{"name": "c", "state": running}]}},
    )


def status_writes(kube: FakeKube) -> int:
    return sum(op == "merge_patch" and path == f"{PATH}/status" for op, path in kube.calls)


async def test_a_booking_is_bound_to_its_pod_without_a_write_until_it_ends() -> None:
    """Issue #45: binding wrote the booking's status once per admitted pod (Bound, the pod's UID and
    start), which every reader can see from the pod itself. It is bound in memory at first sight, takes
    its start from the pod, and is written once, when it ends, with both."""
    clock = [NOW]
    async with setup(now=clock) as (kube, reconciler):
        pending = await add_pending_pod(kube, "task", created=NOW)
        await fed()
        await reconciler.pod_changed(pending, deleted=False, presence=PRESENT)
        assert reconciler.bound_pod(KEY) == "uid-task"
        clock[0] = NOW + 1
        running = await started(kube, "task", at=NOW + 1)
        await fed()
        await reconciler.pod_changed(running, deleted=False, presence=PRESENT)
        clock[0] = NOW + 60  # long past the TTL: it is not taken for a pod that never came
        await fed()
        await reconciler.sweep(presence=PRESENT)
        assert status_writes(kube) == 0
        assert kube.objects[PATH]["metadata"]["labels"]["vramshare.io/active"] == "true"
        running["status"]["phase"] = "Succeeded"
        await reconciler.pod_changed(running, deleted=False, presence=PRESENT)
        assert (status(kube)["phase"], status(kube)["reason"]) == ("Released", "PodFinished")
        assert (status(kube)["podUID"], status(kube)["podRunningSince"]) == ("uid-task", format_time(NOW + 1))
        assert status_writes(kube) == 1


def successor(first: ReservationReconciler) -> ReservationReconciler:
    """A new leader over the same cluster: nothing of `first`'s memory, its pins included."""
    return ReservationReconciler(
        kube=first.kube,
        settings=first.settings,
        metrics=ControllerMetrics(),
        state=first.state,
        clock=first.clock,
    )


async def test_a_restarted_controller_binds_the_earliest_pod_again_and_flags_a_later_copy() -> None:
    """The pin lives in memory: a new leader rebuilds it from the pods, as before a bind (the earliest
    pod named as admitted, placed on its GPU, created after the booking)."""
    async with setup() as (kube, first):
        await add_pod(kube, "task", created=NOW + 1)
        await fed()
        await first.sweep(presence=PRESENT)
        await add_pod(kube, "task-copy", created=NOW + 5)
        restarted = successor(first)
        await fed()
        await restarted.sweep(presence=PRESENT)
        assert restarted.bound_pod(KEY) == "uid-task"
        flagged = [e["involvedObject"]["name"] for e in events(kube) if e["reason"] == "ReservationNotYours"]
        assert flagged == ["task-copy"]
        assert status_writes(kube) == 0


async def test_a_booking_whose_pod_went_while_no_controller_ran_ends_and_says_so() -> None:
    """Nothing records that its pod was seen: a controller that starts after the pod came and went
    cannot tell it from one that never came. It ends it all the same (Expired once past the TTL), and the
    message says both are possible."""
    clock = [NOW]
    async with setup(now=clock) as (kube, first):
        clock[0] = NOW + 30
        restarted = successor(first)
        await restarted.sweep(presence=PRESENT)
        assert (status(kube)["phase"], status(kube)["reason"]) == ("Expired", "PodNeverCreated")
        assert status(kube)["message"].endswith("or its pod came and went while no controller was watching")


async def test_a_pod_deleted_before_its_booking_was_bound_releases_it() -> None:
    """Not Expired/PodNeverCreated (its pod did exist), and it goes at once, as a bound one would."""
    clock = [NOW]
    async with setup(now=clock, bind_wait_s=5.0) as (kube, reconciler):
        pending = await add_pending_pod(kube, "task", created=NOW)
        await fed()
        await reconciler.pod_changed(pending, deleted=False, presence=PRESENT)
        await kube.delete("/api/v1/namespaces/jobs/pods/task")
        await fed()
        await reconciler.pod_changed(pending, deleted=True, presence=PRESENT)
        for _ in range(100):
            if PATH not in kube.objects:
                break
            await asyncio.sleep(0.01)
        assert PATH not in kube.objects
        assert not [e for e in events(kube) if e["reason"] == "PodNeverCreated"]


async def test_records_of_pods_that_never_appeared_are_kept_only_up_to_the_bound_per_namespace() -> None:
    """Issue #42, 7: a loop of creates refused after admission leaves one Expired record each; the sweep
    keeps the newest `never_created_kept_per_namespace` of a namespace and deletes the rest."""
    clock = [NOW]
    kube = FakeKube(clock=lambda: clock[0])
    for i in range(7):
        booking = GpuReservation.new(
            name=f"ghost-{i}", namespace="jobs", pod=f"ghost-{i}", mib=100, gpu=GPU, admission_uid=f"u{i}"
        )
        made = await kube.create(reservations_path("jobs"), booking.to_wire())
        ended = {"phase": "Expired", "reason": "PodNeverCreated", "finishedAt": format_time(NOW - 100 + i)}
        await kube.merge_patch(
            f"{reservations_path('jobs', f'ghost-{i}')}/status",
            {"metadata": {"resourceVersion": made["metadata"]["resourceVersion"]}, "status": ended},
        )
    async with fed_state(kube) as state:
        reconciler = ReservationReconciler(
            kube=kube,  # type: ignore[arg-type]
            settings=ControllerSettings(identity="test", never_created_kept_per_namespace=3),
            metrics=ControllerMetrics(),
            state=state,
            clock=lambda: clock[0],
        )
        await fed()
        await reconciler.sweep(presence=PRESENT)
        left = sorted(p.rsplit("/", 1)[1] for p in kube.objects if "/gpureservations/" in p)
        assert left == ["ghost-4", "ghost-5", "ghost-6"]  # the newest three
        assert reconciler.metrics.never_created_trimmed._value.get() == 4


async def test_a_pod_force_deleted_while_running_keeps_its_booking_until_the_kubelet_has_killed_it() -> None:
    """Issue #42, 9: a force delete (grace 0) removes the pod object at once, but the kubelet still gives
    its containers the pod's terminationGracePeriodSeconds; the booking counts until then."""
    now = [NOW]
    async with setup(now=now) as (kube, reconciler):
        pod = await add_pod(kube, "task", created=NOW + 1)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        assert reconciler.bound_pod(KEY) == "uid-task"
        pod_path = "/api/v1/namespaces/jobs/pods/task"
        await kube.delete(pod_path)
        running = {
            "containerID": "containerd://abc",
            "state": {"running": {"startedAt": format_time(NOW + 2)}},
        }
        forced = {**pod, "spec": {"terminationGracePeriodSeconds": 20}}
        forced["status"] = {"phase": "Running", "containerStatuses": [running]}
        await reconciler.pod_changed(forced, deleted=True, presence=PRESENT)
        await fed()
        for later in (1, 15, 21):  # within the grace period and the kubelet's kill
            now[0] = NOW + later
            await reconciler.sweep(presence=PRESENT)
            assert PATH in kube.objects, later
            assert "phase" not in status(kube), later
        now[0] = NOW + 23
        await reconciler.sweep(presence=PRESENT)
        assert PATH not in kube.objects  # released, and gone with its pod
        reconciler._releases.cancel_all()


async def test_a_pod_whose_containers_stopped_releases_its_booking_when_it_is_gone() -> None:
    """A graceful delete: the kubelet removed the object once the containers stopped; nothing to wait for."""
    async with setup() as (kube, reconciler):
        pod = await add_pod(kube, "task", created=NOW + 1)
        await fed()
        await reconciler.sweep(presence=PRESENT)
        await kube.delete("/api/v1/namespaces/jobs/pods/task")
        stopped = {"containerID": "containerd://abc", "state": {"terminated": {"exitCode": 143}}}
        gone = {**pod, "status": {"phase": "Running", "containerStatuses": [stopped]}}
        await reconciler.pod_changed(gone, deleted=True, presence=PRESENT)
        assert PATH not in kube.objects  # released, and gone with its pod
