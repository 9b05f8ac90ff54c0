"""The reservation lifecycle transition function, exhaustively."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import reservation
from vramshare.domain import (
    PodSighting,
    PodState,
    ReservationPhase,
    due_for_cleanup,
    genuine_pod,
    next_phase,
    with_its_pod,
)
from vramshare.domain.lifecycle import EndedRecord, records_past_bound

R, B, L, E = (
    ReservationPhase.RESERVED,
    ReservationPhase.BOUND,
    ReservationPhase.LOST,
    ReservationPhase.EXPIRED,
)
TTL = 20.0


@pytest.mark.parametrize(
    ("phase", "pod", "gpu_missing", "age_s", "expected", "reason"),
    [
        (R, PodState.ACTIVE, False, 1, ReservationPhase.BOUND, "PodBound"),
        (R, PodState.ABSENT, False, 1, None, None),
        (R, PodState.ABSENT, False, TTL, ReservationPhase.EXPIRED, "PodNeverCreated"),
        (R, PodState.ABSENT, True, TTL, ReservationPhase.EXPIRED, "PodNeverCreated"),
        (R, PodState.FINISHED, False, 1, ReservationPhase.RELEASED, "PodFinished"),
        # A pod appearing on a GPU that blinked out is bound first; the next look marks it Lost.
        (R, PodState.ACTIVE, True, 1, ReservationPhase.BOUND, "PodBound"),
        (B, PodState.ACTIVE, False, 10_000, None, None),
        (B, PodState.FINISHED, False, 1, ReservationPhase.RELEASED, "PodFinished"),
        (B, PodState.ABSENT, False, 1, ReservationPhase.RELEASED, "PodDeleted"),
        (B, PodState.ACTIVE, True, 1, ReservationPhase.LOST, "GpuMissing"),
        (L, PodState.ACTIVE, True, 10_000, None, None),
        (L, PodState.ACTIVE, False, 10_000, ReservationPhase.BOUND, "GpuReturned"),
        (L, PodState.FINISHED, True, 1, ReservationPhase.RELEASED, "PodFinished"),
        (L, PodState.ABSENT, True, 1, ReservationPhase.RELEASED, "PodDeleted"),
        (E, PodState.ACTIVE, False, 10_000, ReservationPhase.BOUND, "PodAppearedLate"),
        (E, PodState.ABSENT, False, 10_000, None, None),
        (E, PodState.FINISHED, False, 10_000, None, None),
    ],
)
def test_phase_transitions(
    phase: ReservationPhase,
    pod: PodState,
    gpu_missing: bool,
    age_s: float,
    expected: ReservationPhase | None,
    reason: str | None,
) -> None:
    t = next_phase(phase=phase, pod=pod, gpu_missing=gpu_missing, age_s=age_s, ttl_s=TTL)
    if expected is None:
        assert t is None
    else:
        assert t is not None
        assert (t.phase, t.reason) == (expected, reason)
        assert t.message


@pytest.mark.parametrize("pod", list(PodState))
@pytest.mark.parametrize("gpu_missing", [False, True])
def test_released_never_moves(pod: PodState, gpu_missing: bool) -> None:
    assert (
        next_phase(phase=ReservationPhase.RELEASED, pod=pod, gpu_missing=gpu_missing, age_s=1e9, ttl_s=TTL)
        is None
    )


@pytest.mark.parametrize("pod", [PodState.ACTIVE, PodState.ABSENT])
def test_a_missing_gpu_never_ends_a_booking_whose_pod_still_runs(pod: PodState) -> None:
    """Whatever the GPU does, a booking with a live pod stays active (Bound or Lost)."""
    phase = B
    for missing in (True, True, False, True, False):
        t = next_phase(phase=phase, pod=PodState.ACTIVE, gpu_missing=missing, age_s=1e9, ttl_s=TTL)
        phase = t.phase if t else phase
        assert phase.is_active
    assert phase is B


def test_bound_never_expires_by_ttl() -> None:
    assert next_phase(phase=B, pod=PodState.ACTIVE, gpu_missing=False, age_s=1e9, ttl_s=TTL) is None


@pytest.mark.parametrize(
    ("phase", "age", "expected"),
    [
        (ReservationPhase.RELEASED, 599, False),
        (ReservationPhase.RELEASED, 600, True),
        (ReservationPhase.EXPIRED, 601, True),
        (ReservationPhase.LOST, 1e9, False),
        (ReservationPhase.BOUND, 1e9, False),
        (ReservationPhase.RESERVED, 1e9, False),
    ],
)
def test_cleanup_only_after_retention_and_only_terminal(
    phase: ReservationPhase, age: float, expected: bool
) -> None:
    assert due_for_cleanup(phase=phase, finished_age_s=age, retention_s=600, pod_gone=False) is expected
    # Its pod gone: an ended booking goes at once (as through an ownerReference); an open one never.
    assert due_for_cleanup(phase=phase, finished_age_s=age, retention_s=600, pod_gone=True) is (
        not phase.is_open
    )


def sighting(
    name: str, *, created: float, uid: str | None = None, gpu_uuid: str | None = "GPU-a"
) -> PodSighting:
    return PodSighting(
        name=name,
        uid=uid or f"uid-{name}",
        created_at=created,
        state=PodState.ACTIVE,
        running_since=None,
        gpu_uuid=gpu_uuid,
    )


def test_the_admitted_pod_is_genuine_and_a_hand_made_copy_is_an_impostor() -> None:
    res = reservation(4_096, name="task-ab12", pod="task")
    real = sighting("task", created=res.reserved_at + 1)
    copy = sighting("task-copy", created=res.reserved_at + 5)
    genuine, impostors = genuine_pod(res, [copy, real], bound_uid=None)
    assert genuine == real
    assert impostors == [copy]


def test_generate_name_pods_match_by_prefix_and_only_after_the_booking() -> None:
    res = reservation(4_096, name="task-ab12", pod="task-*")
    earlier = sighting("task-zzzzz", created=res.reserved_at - 60)  # existed before: cannot be it
    other_gpu = sighting("task-yyyyy", created=res.reserved_at, gpu_uuid="GPU-b")
    real = sighting("task-xxxxx", created=res.reserved_at + 1)
    genuine, impostors = genuine_pod(res, [earlier, other_gpu, real], bound_uid=None)
    assert genuine == real
    assert {p.name for p in impostors} == {"task-zzzzz", "task-yyyyy"}


def test_once_bound_only_the_recorded_uid_belongs() -> None:
    res = reservation(4_096, name="task-ab12", pod="task")
    real = sighting("task", created=res.reserved_at + 1, uid="u-real")
    assert genuine_pod(res, [real], bound_uid="u-real") == (real, [])
    replaced = sighting("task", created=res.reserved_at + 90, uid="u-new")  # deleted and recreated by hand
    assert genuine_pod(res, [replaced], bound_uid="u-real") == (None, [replaced])


def test_a_queued_entry_waits_while_its_pod_exists_and_leaves_when_it_is_deleted() -> None:
    from vramshare.domain import PodState, ReservationPhase, next_phase

    queued = ReservationPhase.QUEUED
    assert next_phase(phase=queued, pod=PodState.ACTIVE, gpu_missing=False, age_s=9999, ttl_s=20) is None
    gone = next_phase(phase=queued, pod=PodState.ABSENT, gpu_missing=False, age_s=5, ttl_s=20, seen=True)
    assert gone is not None
    assert (gone.phase, gone.reason) == (ReservationPhase.RELEASED, "PodDeleted")
    assert next_phase(phase=queued, pod=PodState.ABSENT, gpu_missing=False, age_s=5, ttl_s=20) is None
    never = next_phase(phase=queued, pod=PodState.ABSENT, gpu_missing=False, age_s=21, ttl_s=20)
    assert never is not None
    assert (never.phase, never.reason) == (ReservationPhase.EXPIRED, "PodNeverCreated")
    done = next_phase(phase=queued, pod=PodState.FINISHED, gpu_missing=False, age_s=5, ttl_s=20)
    assert done is not None
    assert done.phase is ReservationPhase.RELEASED
    assert queued.is_open
    assert not queued.is_active


def test_a_hold_lapses_after_its_limit_whatever_its_pod() -> None:
    from vramshare.domain import PodState, ReservationPhase, next_phase

    held = ReservationPhase.HELD
    assert held.is_active
    for pod in PodState:
        assert (
            next_phase(phase=held, pod=pod, gpu_missing=False, age_s=899, ttl_s=20, hold_limit_s=900) is None
        )
    lapsed = next_phase(
        phase=held, pod=PodState.ABSENT, gpu_missing=False, age_s=900, ttl_s=20, hold_limit_s=900
    )
    assert lapsed is not None
    assert (lapsed.phase, lapsed.reason) == (ReservationPhase.EXPIRED, "HoldLapsed")


def test_a_bound_pod_is_stuck_once_unschedulable_for_long_enough() -> None:
    from vramshare.domain import PodSighting, PodState, ReservationPhase
    from vramshare.domain.lifecycle import stuck_unschedulable

    pending = PodSighting(
        name="p",
        uid="u",
        created_at=0,
        state=PodState.ACTIVE,
        running_since=None,
        gpu_uuid="GPU-a",
        unschedulable_since=100.0,
        unschedulable_message="0/2 nodes are available",
    )
    bound = ReservationPhase.BOUND
    assert not stuck_unschedulable(bound, pending, now=159, after_s=60)
    assert stuck_unschedulable(bound, pending, now=160, after_s=60)
    assert not stuck_unschedulable(ReservationPhase.QUEUED, pending, now=1000, after_s=60)
    scheduled = PodSighting(
        name="p", uid="u", created_at=0, state=PodState.ACTIVE, running_since=None, gpu_uuid="GPU-a"
    )
    assert not stuck_unschedulable(bound, scheduled, now=1000, after_s=60)


def test_each_booking_of_a_pod_with_several_gpus_belongs_to_it() -> None:
    first = reservation(4_096, name="task-ab12", pod="task", gpu_uuid="GPU-a")
    second = reservation(4_096, name="task-ab12-gpu1", pod="task", gpu_uuid="GPU-b")
    pod = sighting("task", created=first.reserved_at + 1, gpu_uuid="GPU-a,GPU-b")
    assert genuine_pod(first, [pod], bound_uid=None) == (pod, [])
    assert genuine_pod(second, [pod], bound_uid=None) == (pod, [])
    elsewhere = reservation(4_096, name="x", pod="task", gpu_uuid="GPU-c")
    assert genuine_pod(elsewhere, [pod], bound_uid=None) == (None, [pod])


def test_a_reserved_booking_whose_pod_was_seen_and_is_gone_is_released_not_expired() -> None:
    """Binding waits for the pod to run (bind_wait_s): a pod deleted meanwhile did exist, so its
    booking is released (PodDeleted), at once and not at the TTL as one whose pod never came."""
    gone = next_phase(
        phase=ReservationPhase.RESERVED, pod=PodState.ABSENT, gpu_missing=False, age_s=1, ttl_s=20, seen=True
    )
    assert gone is not None
    assert (gone.phase, gone.reason) == (ReservationPhase.RELEASED, "PodDeleted")
    never = next_phase(
        phase=ReservationPhase.RESERVED, pod=PodState.ABSENT, gpu_missing=False, age_s=1, ttl_s=20
    )
    assert never is None


@given(
    records=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(min_value=0, max_value=1000)),
        max_size=40,
    ),
    keep=st.integers(min_value=0, max_value=10),
)
def test_ended_records_past_the_bound_are_the_oldest_of_each_namespace(
    records: list[tuple[str, float]], keep: int
) -> None:
    """Issue #42, 7: after the excess goes, each namespace keeps min(its records, keep), its newest."""
    made = [EndedRecord(namespace=ns, name=f"r{i}", finished_at=at) for i, (ns, at) in enumerate(records)]
    excess = records_past_bound(made, keep_per_namespace=keep)
    left = [r for r in made if r not in excess]
    for ns in {r.namespace for r in made}:
        mine = [r for r in made if r.namespace == ns]
        kept = [r for r in left if r.namespace == ns]
        assert len(kept) == min(len(mine), keep)
        gone = [r for r in excess if r.namespace == ns]
        if kept and gone:
            assert min(r.finished_at for r in kept) >= max(r.finished_at for r in gone)
    assert excess == sorted(excess, key=lambda r: (r.finished_at, r.namespace, r.name))


def _sighting(*, name: str = "task-1", created_at: float, running_since: float | None = None) -> PodSighting:
    return PodSighting(
        name=name,
        uid=f"uid-{name}",
        created_at=created_at,
        state=PodState.ACTIVE,
        running_since=running_since,
        gpu_uuid="GPU-a",
    )


def test_a_reserved_booking_whose_pod_exists_counts_as_bound_from_its_start() -> None:
    booked = reservation(4096, phase=R)
    pod = _sighting(created_at=booked.reserved_at + 1, running_since=booked.reserved_at + 3)
    seen = with_its_pod(booked, [pod])
    assert (seen.phase, seen.pod_seen, seen.pod_running_since) == (B, True, booked.reserved_at + 3)
    assert (seen.mib, seen.gpu_uuid, seen.name) == (booked.mib, booked.gpu_uuid, booked.name)


def test_what_the_controller_wrote_wins() -> None:
    bound = reservation(4096, phase=B, running_since=100.0)
    assert with_its_pod(bound, [_sighting(created_at=0.0, running_since=200.0)]) is bound
    # Bound before its pod ran (the bind waited its time): the start comes from the pod.
    early = reservation(4096, phase=B)
    assert (
        with_its_pod(early, [_sighting(created_at=early.reserved_at, running_since=300.0)]).pod_running_since
        == 300.0
    )


@pytest.mark.parametrize(
    "phase", [ReservationPhase.QUEUED, ReservationPhase.HELD, L, E, ReservationPhase.RELEASED]
)
def test_other_phases_are_left_to_the_controller(phase: ReservationPhase) -> None:
    booked = reservation(4096, phase=phase)
    assert with_its_pod(booked, [_sighting(created_at=booked.reserved_at + 1, running_since=1.0)]) is booked


def test_a_pod_not_its_own_or_finished_changes_nothing() -> None:
    booked = reservation(4096, phase=R)
    older = _sighting(created_at=booked.reserved_at - 1)  # made before the booking: a copied label
    other = _sighting(name="task-2", created_at=booked.reserved_at + 1)
    finished = replace(_sighting(created_at=booked.reserved_at + 1), state=PodState.FINISHED)
    for pods in ([older], [other], [finished], []):
        assert with_its_pod(booked, pods) is booked


@given(
    phase=st.sampled_from(list(ReservationPhase)),
    offsets=st.lists(st.tuples(st.floats(-5, 5), st.one_of(st.none(), st.floats(0, 50))), max_size=4),
    names=st.lists(st.sampled_from(["task-1", "task-2"]), min_size=4, max_size=4),
)
def test_its_pod_never_makes_a_booking_count_less(
    phase: ReservationPhase, offsets: list[tuple[float, float | None]], names: list[str]
) -> None:
    """Whatever pods carry its label, a booking keeps its memory, its GPU and whether it holds memory."""
    booked = reservation(4096, phase=phase)
    pods = [
        _sighting(name=n, created_at=booked.reserved_at + at, running_since=start)
        for n, (at, start) in zip(names, offsets, strict=False)
    ]
    seen = with_its_pod(booked, pods)
    assert (seen.mib, seen.gpu_uuid, seen.is_active, seen.phase.is_open) == (
        booked.mib,
        booked.gpu_uuid,
        booked.is_active,
        booked.phase.is_open,
    )
