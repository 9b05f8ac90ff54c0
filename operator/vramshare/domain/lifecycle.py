"""The reservation lifecycle as one pure transition function.

    Reserved --pod exists--> Bound --pod finished or deleted--> Released
    Reserved --no pod within the TTL--> Expired
    Reserved/Bound --GPU missing--> Lost

Released, Expired and Lost are terminal; the controller deletes them after a retention period.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vramshare.domain.models import ReservationPhase


class PodState(StrEnum):
    """What the controller sees of a reservation's pod."""

    ABSENT = "absent"  # not found (never created, or deleted)
    ACTIVE = "active"  # exists: Pending or Running
    FINISHED = "finished"  # Succeeded or Failed


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition:
    phase: ReservationPhase
    reason: str
    """A short CamelCase reason, as Kubernetes events and conditions use."""
    message: str


def next_phase(
    *,
    phase: ReservationPhase,
    pod: PodState,
    gpu_missing: bool,
    age_s: float,
    ttl_s: float,
) -> Transition | None:
    """The transition a reservation takes now, or None when it stays where it is.

    `age_s` is the time since the reservation was committed; `ttl_s` how long a Reserved reservation
    may wait for its pod.
    """
    if not phase.is_active:
        return None
    if gpu_missing:
        return Transition(
            phase=ReservationPhase.LOST,
            reason="GpuMissing",
            message="its GPU is no longer reported by DCGM (removed, replaced or its node is gone)",
        )
    if pod is PodState.FINISHED:
        return Transition(phase=ReservationPhase.RELEASED, reason="PodFinished", message="its pod finished")
    if phase is ReservationPhase.RESERVED:
        if pod is PodState.ACTIVE:
            return Transition(phase=ReservationPhase.BOUND, reason="PodBound", message="its pod exists")
        if age_s >= ttl_s:
            return Transition(
                phase=ReservationPhase.EXPIRED,
                reason="NoPod",
                message=f"no pod appeared within {ttl_s:g} s of admission",
            )
        return None
    if pod is PodState.ABSENT:
        return Transition(phase=ReservationPhase.RELEASED, reason="PodDeleted", message="its pod was deleted")
    return None


def due_for_cleanup(*, phase: ReservationPhase, finished_age_s: float, retention_s: float) -> bool:
    """True when a terminal reservation has been kept long enough for people to inspect it."""
    return not phase.is_active and finished_age_s >= retention_s
