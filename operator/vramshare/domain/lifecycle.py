"""The reservation lifecycle as one pure transition function, and which pod a reservation belongs to.

    Queued --placed on a GPU by the controller--> Reserved (a spec change, not a transition here)
    Queued --its pod finished or was deleted--> Released
    Queued --no pod within the TTL--> Expired
    Held --its task was admitted (the webhook deletes it) or the hold limit passed--> Expired
    Granted --its replica gave it back (deletes it), or did not renew it in time--> Expired
    Reserved --its pod exists--> Bound --its pod finished or was deleted--> Released
    Reserved --its pod was seen, and deleted before it was bound--> Released
    Reserved --no pod within the TTL--> Expired --its pod appears after all--> Bound
    Bound --its GPU is missing--> Lost --the GPU is back--> Bound
    Lost --its pod finished or was deleted--> Released

Reserved, Bound, Lost, Held and Granted hold memory; Queued holds a place in the queue and no memory. A
GPU whose metrics blink (its DCGM series missing for a while) must not lose the bookings of pods that
still run on it: Lost keeps counting, so when the GPU returns its memory is still booked and no new pod
is admitted into it. Expired is the fate of a booking whose pod never appeared (rejected after vramshare
admitted it: a quota, a policy, a name already taken, or the API server giving up on the request); the
TTL is short, so such bookings stop counting quickly. If the pod does appear late, the booking counts
again rather than leave a running pod unbooked.

When a pod that exists is bound is the controller's choice (it waits briefly for the pod to run, so
that one write records both: `vramshare.controller.reservations`). Released and Expired are ended;
the controller deletes them after a retention period.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from vramshare.domain.models import Reservation, ReservationPhase


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
    seen: bool = False,
    hold_limit_s: float = float("inf"),
    grant_lapses_after_s: float = float("inf"),
) -> Transition | None:
    """The transition a reservation takes now, or None when it stays where it is.

    `age_s` is the time since the reservation was committed; `ttl_s` how long a Reserved reservation
    may wait for its pod. `seen`: its pod was seen once (a Queued entry whose pod is gone left the queue;
    a Reserved booking whose pod was deleted before it was bound is released, not expired).
    `hold_limit_s`: how long a hold lasts. For a grant, `age_s` is how long it has gone unrenewed, and
    `grant_lapses_after_s` how long it may (`vramshare.domain.grants`).
    """
    if phase is ReservationPhase.EXPIRED:
        if pod is PodState.ACTIVE:
            return Transition(
                phase=ReservationPhase.BOUND,
                reason="PodAppearedLate",
                message=f"its pod appeared more than {ttl_s:g} s after admission; the booking counts again",
            )
        return None
    if not phase.is_open:
        return None
    if phase is ReservationPhase.HELD:  # no pod of its own: it only lasts so long
        if age_s >= hold_limit_s:
            return Transition(
                phase=ReservationPhase.EXPIRED,
                reason="HoldLapsed",
                message=f"its task did not come back within {hold_limit_s:g} s; the memory is free again",
            )
        return None
    if phase is ReservationPhase.GRANTED:  # no pod either: it lasts while its replica renews it
        if age_s >= grant_lapses_after_s:
            return Transition(
                phase=ReservationPhase.EXPIRED,
                reason="GrantLapsed",
                message=(
                    f"its webhook replica did not renew it for {grant_lapses_after_s:g} s; the memory "
                    "it held for that replica's pods is free again"
                ),
            )
        return None
    if pod is PodState.FINISHED:
        return Transition(phase=ReservationPhase.RELEASED, reason="PodFinished", message="its pod finished")
    if phase is ReservationPhase.QUEUED:
        if pod is PodState.ACTIVE:
            return None  # it waits for the controller to place it
        if seen:
            return Transition(
                phase=ReservationPhase.RELEASED,
                reason="PodDeleted",
                message="its pod was deleted while it waited; it left the queue",
            )
        return _never_created(ttl_s, "queued") if age_s >= ttl_s else None
    if phase is ReservationPhase.RESERVED:
        if pod is PodState.ACTIVE:
            return Transition(phase=ReservationPhase.BOUND, reason="PodBound", message="its pod exists")
        if seen:  # deleted before its booking was bound (binding waits for the pod to run)
            return Transition(
                phase=ReservationPhase.RELEASED, reason="PodDeleted", message="its pod was deleted"
            )
        return _never_created(ttl_s, "admitted") if age_s >= ttl_s else None
    if pod is PodState.ABSENT:
        return Transition(phase=ReservationPhase.RELEASED, reason="PodDeleted", message="its pod was deleted")
    if phase is ReservationPhase.BOUND and gpu_missing:
        return Transition(
            phase=ReservationPhase.LOST,
            reason="GpuMissing",
            message="its GPU is no longer reported by DCGM; the booking is kept while its pod runs",
        )
    if phase is ReservationPhase.LOST and not gpu_missing:
        return Transition(
            phase=ReservationPhase.BOUND, reason="GpuReturned", message="its GPU is reported by DCGM again"
        )
    return None


def _never_created(ttl_s: float, done: str) -> Transition:
    return Transition(
        phase=ReservationPhase.EXPIRED,
        reason="PodNeverCreated",
        message=f"no pod appeared within {ttl_s:g} s of admission (rejected after vramshare {done} it: "
        "a quota, a policy, a name already taken, or the API server gave up)",
    )


def due_for_cleanup(
    *, phase: ReservationPhase, finished_age_s: float, retention_s: float, pod_gone: bool
) -> bool:
    """True when an ended reservation may go: once the pod it was bound to is gone (as an
    ownerReference would have it, without the write that records one), or once it has been kept
    `retention_s` for people to inspect it (its pod finished but still exists, or never came)."""
    return not phase.is_open and (pod_gone or finished_age_s >= retention_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class EndedRecord:
    """A reservation kept after it ended, as far as its cleanup is concerned."""

    namespace: str
    name: str
    finished_at: float


def records_past_bound(records: Iterable[EndedRecord], *, keep_per_namespace: int) -> list[EndedRecord]:
    """The records beyond the newest `keep_per_namespace` of each namespace, oldest first: what a tenant
    can leave behind is bounded by that many per namespace, however fast it makes them (issue #42, 7:
    bookings whose pod never appeared, each kept for people to read why)."""
    by_namespace: dict[str, list[EndedRecord]] = {}
    for record in records:
        by_namespace.setdefault(record.namespace, []).append(record)
    excess: list[EndedRecord] = []
    for kept in by_namespace.values():
        kept.sort(key=lambda r: (r.finished_at, r.name), reverse=True)
        excess.extend(kept[max(keep_per_namespace, 0) :])
    return sorted(excess, key=lambda r: (r.finished_at, r.namespace, r.name))


@dataclass(frozen=True, slots=True, kw_only=True)
class PodSighting:
    """A pod that carries a reservation's label, as the controller sees it."""

    name: str
    uid: str
    created_at: float
    state: PodState
    running_since: float | None
    gpu_uuid: str | None
    """The GPU the pod's vramshare.io/gpu-uuid annotation names (vramshare's patch sets it)."""
    unschedulable_since: float | None = None
    """Since when the scheduler has found no node for it (PodScheduled False, Unschedulable)."""
    unschedulable_message: str = ""
    forced_grace_s: float | None = None
    """Set while a container of the pod runs in a runtime: if the pod object goes now (a force delete,
    grace 0), the kubelet still gives its containers the pod's terminationGracePeriodSeconds (this many
    seconds) before killing them, and they hold their GPU memory until then."""


def stuck_unschedulable(
    phase: ReservationPhase, pod: PodSighting | None, *, now: float, after_s: float
) -> bool:
    """Whether a booking's pod has been unschedulable for `after_s`: its memory is held for a pod that
    does not run (the node changed after admission, or the pod asks for something else the node lacks)."""
    return (
        phase is ReservationPhase.BOUND
        and pod is not None
        and pod.unschedulable_since is not None
        and now - pod.unschedulable_since >= after_s
    )


def belongs(reservation: Reservation, pod: PodSighting, *, bound_uid: str | None) -> bool:
    """Whether `pod` is the pod `reservation` was made for.

    Once bound, only the pod with the recorded UID. Before, a pod whose name is the one admitted (or
    starts with its generateName prefix), whose placement names the reservation's GPU and which was
    created no earlier than the reservation: a pod made by hand with a copied label fails at least the
    last test for every reservation that already existed when it was made.
    """
    if bound_uid:
        return pod.uid == bound_uid
    admitted = reservation.pod
    named = pod.name.startswith(admitted[:-1]) if admitted.endswith("*") else pod.name == admitted
    # A queued pod and its entry name no GPU yet; a pod with several GPUs lists them all.
    placed = reservation.gpu_uuid in (pod.gpu_uuid or "").split(",")
    return named and placed and pod.created_at >= reservation.reserved_at


def genuine_pod(
    reservation: Reservation, pods: Iterable[PodSighting], *, bound_uid: str | None
) -> tuple[PodSighting | None, list[PodSighting]]:
    """The pod `reservation` belongs to (the earliest that qualifies), and the impostors: pods that
    carry its label but are not its pod."""
    candidates = sorted(pods, key=lambda p: (p.created_at, p.name))
    genuine = next((p for p in candidates if belongs(reservation, p, bound_uid=bound_uid)), None)
    return genuine, [p for p in candidates if p is not genuine]


def with_its_pod(reservation: Reservation, pods: Iterable[PodSighting]) -> Reservation:
    """`reservation` as its pod shows it, for a reader that watches the pods (the webhooks): a Reserved
    booking whose pod exists counts as Bound (no longer pending for its namespace and user), and a
    booking counts from its pod's start (the part of its memory a sample can show once settled), both
    whether or not the controller has written them yet. The pod is the earliest that `belongs` to it
    before a bind (its name, its GPU, created after it); a pod that finished is left to the controller.
    What the controller writes always wins: a start it recorded is kept, other phases are left as they
    are."""
    phase = reservation.phase
    if phase not in (ReservationPhase.RESERVED, ReservationPhase.BOUND):
        return reservation
    if phase is ReservationPhase.BOUND and reservation.pod_running_since is not None:
        return reservation
    pod, _ = genuine_pod(reservation, pods, bound_uid=None)
    if pod is None or pod.state is not PodState.ACTIVE:
        return reservation
    return replace(
        reservation,
        phase=ReservationPhase.BOUND,
        pod_seen=True,
        pod_running_since=reservation.pod_running_since
        if reservation.pod_running_since is not None
        else pod.running_since,
    )
