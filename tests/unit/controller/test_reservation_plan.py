"""plan(): the lifecycle as API changes, without an API server."""

from __future__ import annotations

from typing import Any

from tests.unit.controller.test_reconciler_grants import a_grant
from tests.unit.domain.builders import NOW
from vramshare.controller.devices import conditions
from vramshare.controller.reservations import plan, pod_sighting
from vramshare.domain import PodSighting, PodState, ReservationPhase
from vramshare.kube.objects import GpuReservation
from vramshare.kube.resources import FINALIZER_POD_GONE, format_time


def sighting(state: PodState = PodState.ACTIVE) -> PodSighting:
    return PodSighting(
        name="task", uid="uid-1", created_at=NOW - 60, state=state, running_since=NOW - 30, gpu_uuid="GPU-1"
    )


POD = sighting()


def obj(
    phase: str | None = None,
    *,
    age: float = 10,
    owners: list[Any] | None = None,
    finalizers: tuple[str, ...] = (FINALIZER_POD_GONE,),
    deleted: bool = False,
    **status: Any,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "task-ab12",
            "namespace": "jobs",
            "resourceVersion": "7",
            "creationTimestamp": format_time(NOW - age),
            "ownerReferences": owners or [],
            "finalizers": list(finalizers),
            **({"deletionTimestamp": format_time(NOW - 1)} if deleted else {}),
        },
        "spec": {
            "podName": "task",
            "memoryMiB": 4096,
            "nodeName": "node-a",
            "gpuUUID": "GPU-1",
            "gpuIndex": 2,
        },
        "status": {**({"phase": phase} if phase else {}), **status},
    }


def make(o: dict[str, Any], pod: PodSighting | None = POD, *, missing: bool = False):  # type: ignore[no-untyped-def]
    res = GpuReservation.from_wire(o)
    return plan(res=res, pod=pod, gpu_missing=missing, now=NOW, ttl_s=300, retention_s=600)


def test_binding_is_one_status_write_and_posts_no_event() -> None:
    """No ownerReference (a second write per pod, issue #31): the finalizer was set at creation, and
    the controller deletes the booking once its pod is gone. No event either (issue #45): the pod's own
    annotations say where it is booked."""
    p = make(obj())
    assert p.status is not None
    assert p.status.phase is ReservationPhase.BOUND
    assert p.status.pod_uid == "uid-1"
    assert p.status.to_wire()["podRunningSince"] == format_time(NOW - 30)
    assert (p.finalizer, p.active_label, p.delete) == (None, None, False)
    assert p.event is None


def test_nothing_to_do_when_bound_and_recorded() -> None:
    o = obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", podRunningSince=format_time(NOW - 30))
    assert make(o).empty


def test_finished_pod_releases() -> None:
    p = make(
        obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", podRunningSince=format_time(NOW - 30)),
        sighting(PodState.FINISHED),
    )
    assert p.status is not None
    assert (p.status.phase, p.status.reason) == (ReservationPhase.RELEASED, "PodFinished")
    assert p.event is not None
    assert p.event.reason == "GpuReleased"


def test_missing_gpu_marks_lost_with_a_warning_but_keeps_the_booking_active() -> None:
    p = make(
        obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", podRunningSince=format_time(NOW - 30)),
        missing=True,
    )
    assert p.status is not None
    assert p.status.phase is ReservationPhase.LOST
    assert p.status.finished_at is None
    assert p.active_label is None  # still counted by the webhook
    assert p.event is not None
    assert (p.event.type, p.event.reason) == ("Warning", "GpuLost")
    back = make(obj("Lost", owners=[{"uid": "uid-1"}], podUID="uid-1", podRunningSince=format_time(NOW - 30)))
    assert back.status is not None
    assert back.status.phase is ReservationPhase.BOUND
    assert back.event is not None
    assert back.event.reason == "GpuReturned"


def test_orphan_expires_after_the_ttl_with_an_event_on_the_reservation() -> None:
    assert make(obj("Reserved", age=299), None).empty
    p = make(obj("Reserved", age=300), None)
    assert p.status is not None
    assert (p.status.phase, p.status.reason) == (ReservationPhase.EXPIRED, "PodNeverCreated")
    assert p.active_label == "false"
    assert p.event is not None
    assert (p.event.type, p.event.reason) == ("Warning", "PodNeverCreated")
    assert p.event_on_reservation


def test_a_late_pod_revives_an_expired_booking() -> None:
    expired = obj("Expired", age=400, finishedAt=format_time(NOW - 100), reason="PodNeverCreated")
    expired["metadata"]["labels"] = {"vramshare.io/active": "false"}
    p = make(expired)
    assert p.status is not None
    assert (p.status.phase, p.status.reason) == (ReservationPhase.BOUND, "PodAppearedLate")
    assert p.status.finished_at is None
    assert p.status.pod_uid == "uid-1"
    assert p.active_label == "true"
    assert p.event is not None
    assert p.event.type == "Warning"


def test_terminal_reservations_are_deleted_after_retention() -> None:
    assert not make(obj("Released", finishedAt=format_time(NOW - 599)), None).delete
    assert make(obj("Released", finishedAt=format_time(NOW - 600)), None).delete
    # Its pod finished but is still there: kept for retention_s.
    finished = obj("Released", podUID="uid-1", finishedAt=format_time(NOW - 599))
    assert not make(finished, sighting(PodState.FINISHED)).delete
    # ... but once that pod is deleted, it goes at once, as through the ownerReference it once had.
    assert make(finished, None).delete


def test_a_booking_whose_pod_was_deleted_is_deleted_at_once() -> None:
    """Bound (or Lost): its pod deleted. The finalizer comes off and the booking goes, in the two
    writes garbage collection and the controller made through the ownerReference; no Released
    status or inactive label is written to an object about to go."""
    for phase in ("Bound", "Lost"):
        p = make(obj(phase, podUID="uid-1", podRunningSince=format_time(NOW - 30)), None)
        assert p.transition is not None
        assert (p.transition.phase, p.transition.reason) == (ReservationPhase.RELEASED, "PodDeleted")
        assert p.delete
        assert p.active_label is None


def test_new_reservation_without_status_shows_reserved() -> None:
    p = make(obj(age=1), None)
    assert p.status is not None
    assert p.status.to_wire() == {"phase": "Reserved"}


def test_pod_info_reads_the_earliest_container_start() -> None:
    pod = {
        "metadata": {"name": "p", "uid": "u"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"state": {"running": {"startedAt": format_time(NOW - 10)}}},
                {"state": {"terminated": {"startedAt": format_time(NOW - 20)}}},
                {"state": {"waiting": {}}},
            ],
        },
    }
    info = pod_sighting(pod)
    assert info.running_since == NOW - 20
    assert info.state is PodState.ACTIVE
    assert pod_sighting({"metadata": {"name": "p", "uid": "u"}, "status": {"phase": "Failed"}}).state is (
        PodState.FINISHED
    )


def test_conditions_keep_transition_times_while_unchanged() -> None:
    wanted = {k: (k == "Ready", "r", "m") for k in ("Ready", "Stale", "Missing", "MemoryOverused")}
    first = conditions([], wanted, NOW - 100)
    again = conditions(first, wanted, NOW)
    assert [c.to_wire()["lastTransitionTime"] for c in again] == [format_time(NOW - 100)] * 4
    flipped = conditions(again, {**wanted, "Stale": (True, "r", "m")}, NOW)
    times = {c.type: c.to_wire()["lastTransitionTime"] for c in flipped}
    assert times["Stale"] == format_time(NOW)
    assert times["Ready"] == format_time(NOW - 100)


def test_ended_reservations_are_labelled_inactive_once() -> None:
    released = make(
        obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", podRunningSince=format_time(NOW - 30)),
        sighting(PodState.FINISHED),
    )
    assert released.active_label == "false"
    already = obj("Released", finishedAt=format_time(NOW - 10))
    already["metadata"]["labels"] = {"vramshare.io/active": "false"}
    assert make(already, None).empty
    assert not make(
        obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", podRunningSince=format_time(NOW - 30))
    ).active_label


def queued_obj(*, placed: bool = False, **status: Any) -> dict[str, Any]:
    o = obj(**status)
    if not placed:
        o["spec"] = {"podName": "task", "memoryMiB": 4096}
    o["metadata"]["labels"] = {"vramshare.io/active": "true"}
    return o


QUEUED_POD = PodSighting(
    name="task", uid="uid-1", created_at=NOW - 5, state=PodState.ACTIVE, running_since=None, gpu_uuid=None
)


def test_a_queued_entry_records_its_pod_and_stays_queued_and_active() -> None:
    p = make(queued_obj(), QUEUED_POD)
    assert p.transition is None
    assert p.status is not None
    assert p.status.phase is ReservationPhase.QUEUED
    assert p.status.pod_uid == "uid-1"
    assert p.active_label is None  # still open: the webhook and the queue keep seeing it


def test_a_placed_queue_entry_binds_to_the_pod_it_recorded_and_leaves_the_queue() -> None:
    o = queued_obj(placed=True, phase="Queued", podUID="uid-1", queuePosition=1)
    placed_pod = PodSighting(
        name="task",
        uid="uid-1",
        created_at=NOW - 5,
        state=PodState.ACTIVE,
        running_since=None,
        gpu_uuid="GPU-1",
    )
    p = make(o, placed_pod)
    assert p.status is not None
    assert p.status.phase is ReservationPhase.BOUND
    assert p.status.queue_position is None
    assert "queuePosition" not in p.status.to_wire()


def test_an_entry_whose_placement_was_withdrawn_after_its_pod_bound_is_queued_again() -> None:
    """The reconciler bound the placed entry to its gated pod, then the placement was withdrawn (its
    commit lost, or nobody vouched for it): it must wait in the queue again, not stay Bound to no GPU
    with its pod gated for ever."""
    o = queued_obj(phase="Bound", podUID="uid-1")
    res = GpuReservation.from_wire(o)
    assert res.phase is ReservationPhase.QUEUED
    assert res.phase.is_open
    p = make(o, QUEUED_POD)
    assert p.transition is None
    assert p.status is not None
    assert p.status.phase is ReservationPhase.QUEUED  # kubectl shows it queued again


def test_a_queued_entry_whose_pod_was_deleted_leaves_the_queue() -> None:
    p = make(queued_obj(phase="Queued", podUID="uid-1", queuePosition=3), None)
    assert p.transition is not None
    assert (p.transition.phase, p.transition.reason) == (ReservationPhase.RELEASED, "PodDeleted")
    assert p.delete  # its pod is gone: nothing left to show it for


def test_a_queue_entry_whose_pod_never_came_expires_with_an_event_that_names_no_gpu() -> None:
    o = queued_obj(age=400)
    p = make(o, None)
    assert p.transition is not None
    assert p.transition.reason == "PodNeverCreated"
    assert p.event is not None
    assert p.event_on_reservation
    assert "of 4096 MiB on no GPU yet (queued)" in p.event.message
    assert "vramshare queued it" in p.event.message


def test_a_hold_shows_as_held_and_lapses_after_its_limit() -> None:
    o = obj(age=100)
    o["metadata"]["labels"] = {"vramshare.io/active": "true", "vramshare.io/held-for": "abc"}
    res = GpuReservation.from_wire(o)
    assert res.phase is ReservationPhase.HELD
    kept = plan(res=res, pod=None, gpu_missing=False, now=NOW, ttl_s=20, retention_s=600, hold_limit_s=900)
    assert kept.transition is None  # no pod is expected: not PodNeverCreated after the TTL
    assert kept.status is not None
    assert kept.status.phase is ReservationPhase.HELD
    lapsed = plan(res=res, pod=None, gpu_missing=False, now=NOW, ttl_s=20, retention_s=600, hold_limit_s=60)
    assert lapsed.transition is not None
    assert lapsed.transition.reason == "HoldLapsed"
    assert lapsed.active_label == "false"


# -- deletion before the pod is gone (issue #30, 5) ------------------------------------------------


def test_a_booking_without_the_finalizer_gets_it_once_it_counts() -> None:
    """Bookings made before the finalizer existed (an upgrade) or by hand get it."""
    p = make(obj(finalizers=()))
    assert p.finalizer == "add"
    bound = make(obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", finalizers=("other.io/x",)))
    assert bound.finalizer == "add"
    ended = make(obj("Released", finalizers=(), podUID="uid-1"), None)
    assert ended.finalizer is None  # nothing left to wait for


def test_a_hold_never_gets_the_finalizer() -> None:
    o = obj(finalizers=())
    o["metadata"]["labels"] = {"vramshare.io/held-for": "task-key"}
    assert make(o, None).finalizer is None


def test_a_deleted_booking_whose_pod_still_runs_stays_and_counts() -> None:
    """Its namespace was deleted, or its pod deleted in the foreground: the pod is terminating, its
    containers may still hold the memory."""
    p = make(obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", deleted=True))
    assert p.finalizer is None
    assert p.deletion_waits
    assert p.transition is None
    assert not p.delete


def test_a_deleted_booking_is_let_go_once_its_pod_is_gone_or_finished() -> None:
    gone = make(obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", deleted=True), None)
    assert gone.finalizer == "remove"
    assert gone.transition is not None
    assert gone.transition.reason == "PodDeleted"
    assert gone.status is None  # nothing written to an object about to go
    finished = make(
        obj("Bound", owners=[{"uid": "uid-1"}], podUID="uid-1", deleted=True), sighting(PodState.FINISHED)
    )
    assert finished.finalizer == "remove"
    assert finished.event is not None
    assert finished.event.reason == "GpuReleased"
    already = make(obj("Released", podUID="uid-1", deleted=True), None)
    assert already.finalizer == "remove"
    assert not already.empty


def test_a_deleted_booking_whose_pod_never_came_waits_for_the_ttl() -> None:
    """Its pod may still be on its way to being stored; ending it early could leave a pod unbooked."""
    early = make(obj(age=10, deleted=True), None)
    assert early.finalizer is None
    assert early.deletion_waits
    late = make(obj(age=400, deleted=True), None)
    assert late.finalizer == "remove"
    assert late.transition is not None
    assert late.transition.reason == "PodNeverCreated"


def test_a_deleted_reserved_booking_records_its_pod() -> None:
    p = make(obj(deleted=True))
    assert p.status is not None
    assert p.status.pod_uid == "uid-1"
    assert p.deletion_waits
    assert p.finalizer is None


def test_a_deleted_object_without_the_finalizer_is_left_to_go() -> None:
    p = make(obj("Released", podUID="uid-1", deleted=True, finalizers=()), None)
    assert p.empty


def test_a_booking_whose_pod_never_appeared_goes_after_its_own_shorter_retention() -> None:
    """Issue #42, 7: its record is kept `never_created_retention_s`, other ended ones `retention_s`."""

    def deleted(reason: str, ended_ago: float) -> bool:
        o = obj("Expired", finalizers=(), reason=reason, finishedAt=format_time(NOW - ended_ago))
        res = GpuReservation.from_wire(o)
        return plan(
            res=res,
            pod=None,
            gpu_missing=False,
            now=NOW,
            ttl_s=20,
            retention_s=600,
            never_created_retention_s=60,
        ).delete

    assert not deleted("PodNeverCreated", 59)
    assert deleted("PodNeverCreated", 61)
    assert not deleted("HoldLapsed", 61)
    assert deleted("HoldLapsed", 601)


def test_a_force_deleted_pods_booking_is_released_only_once_its_containers_are_gone() -> None:
    res = GpuReservation.from_wire(obj("Bound", podUID="uid-1"))
    held = plan(
        res=res, pod=None, gpu_missing=False, now=NOW, ttl_s=20, retention_s=600, running_until=NOW + 5
    )
    assert held.release_at == NOW + 5
    assert held.transition is None
    assert held.empty
    later = plan(
        res=res, pod=None, gpu_missing=False, now=NOW + 6, ttl_s=20, retention_s=600, running_until=NOW + 5
    )
    assert later.transition is not None
    assert later.transition.reason == "PodDeleted"


def test_a_pod_is_seen_to_hold_containers_only_where_a_runtime_runs_them() -> None:
    """Issue #42, 9: a running container with a runtime ID may outlive the pod object (a force delete);
    kwok's fake containers have no ID, a finished pod none that runs."""
    running = {"containerID": "containerd://abc", "state": {"running": {"startedAt": format_time(NOW)}}}
    pod = {
        "metadata": {"name": "t", "uid": "u"},
        "status": {"phase": "Running", "containerStatuses": [running]},
    }
    assert pod_sighting(pod).forced_grace_s == 30.0  # the API server's default grace
    assert pod_sighting({**pod, "spec": {"terminationGracePeriodSeconds": 5}}).forced_grace_s == 5.0
    fake = {**running, "containerID": None}
    assert (
        pod_sighting({**pod, "status": {"phase": "Running", "containerStatuses": [fake]}}).forced_grace_s
        is None
    )
    stopped = {"containerID": "containerd://abc", "state": {"terminated": {"exitCode": 0}}}
    assert (
        pod_sighting({**pod, "status": {"phase": "Running", "containerStatuses": [stopped]}}).forced_grace_s
        is None
    )
    assert (
        pod_sighting({**pod, "status": {"phase": "Succeeded", "containerStatuses": [running]}}).forced_grace_s
        is None
    )


def test_what_the_crds_default_shows_is_read_as_nothing_written() -> None:
    """The API server shows status.phase Reserved where nothing was written (the CRD's default, issue
    #45): a hold is still Held, a queue entry without a GPU still Queued, and a booking is not written."""
    hold = obj("Reserved", age=100)
    hold["metadata"]["labels"] = {"vramshare.io/active": "true", "vramshare.io/held-for": "abc"}
    assert GpuReservation.from_wire(hold).phase is ReservationPhase.HELD
    entry = obj("Reserved")
    entry["spec"] = {"podName": "task", "memoryMiB": 4096}
    assert GpuReservation.from_wire(entry).phase is ReservationPhase.QUEUED
    assert make(obj("Reserved", age=1), None).empty


def _grant() -> GpuReservation:
    return a_grant("vramshare-grant-1", lasts_s=15)


def test_a_grant_shows_as_granted_has_no_finalizer_and_lapses_only_unrenewed() -> None:
    res = GpuReservation.from_wire(_grant().to_wire())
    assert res.phase is ReservationPhase.GRANTED
    kept = plan(
        res=res, pod=None, gpu_missing=True, now=NOW + 10_000, ttl_s=20, retention_s=600, unrenewed_s=16.9
    )
    assert kept.transition is None  # its age and its missing pod say nothing about it
    assert kept.finalizer is None
    assert kept.status is not None
    assert kept.status.phase is ReservationPhase.GRANTED  # kubectl shows it for what it is
    lapsed = plan(res=res, pod=None, gpu_missing=False, now=NOW, ttl_s=20, retention_s=600, unrenewed_s=17)
    assert lapsed.transition is not None
    assert lapsed.transition.reason == "GrantLapsed"
    assert lapsed.transition.phase is ReservationPhase.EXPIRED
    assert lapsed.active_label == "false"


def test_a_grant_whose_duration_does_not_read_lasts_the_longest() -> None:
    """Ending a grant too late costs room for a while; too early could let two pods share memory."""
    wire = _grant().to_wire()
    for bad in ("soon", "0.5", "nan", "1e9"):
        wire["metadata"]["annotations"]["vramshare.io/grant-lasts-s"] = bad
        res = GpuReservation.from_wire(wire)
        assert res.grant_lasts_s == 3600
        kept = plan(res=res, pod=None, gpu_missing=False, now=NOW, ttl_s=20, retention_s=600, unrenewed_s=600)
        assert kept.transition is None
