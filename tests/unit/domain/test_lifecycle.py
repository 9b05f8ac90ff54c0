"""The reservation lifecycle transition function, exhaustively."""

from __future__ import annotations

import pytest

from vramshare.domain import PodState, ReservationPhase, due_for_cleanup, next_phase

R, B = ReservationPhase.RESERVED, ReservationPhase.BOUND
TTL = 300.0


@pytest.mark.parametrize(
    ("phase", "pod", "gpu_missing", "age_s", "expected", "reason"),
    [
        (R, PodState.ACTIVE, False, 1, ReservationPhase.BOUND, "PodBound"),
        (R, PodState.ABSENT, False, 1, None, None),
        (R, PodState.ABSENT, False, TTL, ReservationPhase.EXPIRED, "NoPod"),
        (R, PodState.FINISHED, False, 1, ReservationPhase.RELEASED, "PodFinished"),
        (R, PodState.ACTIVE, True, 1, ReservationPhase.LOST, "GpuMissing"),
        (B, PodState.ACTIVE, False, 10_000, None, None),
        (B, PodState.FINISHED, False, 1, ReservationPhase.RELEASED, "PodFinished"),
        (B, PodState.ABSENT, False, 1, ReservationPhase.RELEASED, "PodDeleted"),
        (B, PodState.ACTIVE, True, 1, ReservationPhase.LOST, "GpuMissing"),
    ],
)
def test_active_phase_transitions(
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


@pytest.mark.parametrize("phase", [p for p in ReservationPhase if not p.is_active])
@pytest.mark.parametrize("pod", list(PodState))
@pytest.mark.parametrize("gpu_missing", [False, True])
def test_terminal_phases_never_move(phase: ReservationPhase, pod: PodState, gpu_missing: bool) -> None:
    assert next_phase(phase=phase, pod=pod, gpu_missing=gpu_missing, age_s=1e9, ttl_s=TTL) is None


def test_bound_never_expires_by_ttl() -> None:
    assert next_phase(phase=B, pod=PodState.ACTIVE, gpu_missing=False, age_s=1e9, ttl_s=TTL) is None


@pytest.mark.parametrize(
    ("phase", "age", "expected"),
    [
        (ReservationPhase.RELEASED, 599, False),
        (ReservationPhase.RELEASED, 600, True),
        (ReservationPhase.EXPIRED, 601, True),
        (ReservationPhase.LOST, 700, True),
        (ReservationPhase.BOUND, 1e9, False),
        (ReservationPhase.RESERVED, 1e9, False),
    ],
)
def test_cleanup_only_after_retention_and_only_terminal(
    phase: ReservationPhase, age: float, expected: bool
) -> None:
    assert due_for_cleanup(phase=phase, finished_age_s=age, retention_s=600) is expected
