"""Tenancy: how much of the fleet one namespace, and one user, may hold.

A namespace holds GPU memory in four ways, and all four count:

- **bound**: bookings whose pod exists (Bound, or Lost while its GPU is missing);
- **pending**: bookings made at admission whose pod has not appeared yet. Mutating admission runs
  before the API server checks the name, quotas, Pod Security and validating policies, so a pod may
  never appear; its booking then counts until the reservation TTL ends it;
- **held**: memory kept for a refused task's next try (`vramshare.domain.fairness`);
- **queued**: pods waiting behind vramshare's gate, placed or not. Kubernetes' own ResourceQuota counts
  a gated pod's requests from its creation, so vramshare counts them too.

Three bounds are checked before anything is booked, in this order:

1. **Quota**: the namespace's ResourceQuotas on the memory resource (`requests.<resource>`, in MiB).
   The API server enforces it exactly for pods (the quota admission plugin, with optimistic
   concurrency on the quota's status); vramshare's check adds what the API server cannot see
   (pending bookings and holds), so a namespace cannot hold more than its quota in any form.
2. **Pending per namespace** and 3. **pending per user**, in MiB: what pods that never appear can
   cost the fleet. One pod is always let through when nothing of its namespace (or user) is pending,
   so a request larger than the bound is not refused for good.

Holds are a tenant's too: at most `max_holds_per_namespace` per namespace, each counted against its
quota.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from vramshare.domain.models import Gpu, Reservation, ReservationPhase


class Holding(StrEnum):
    """The way a namespace holds a reservation's memory."""

    BOUND = "bound"
    PENDING = "pending"
    HELD = "held"
    QUEUED = "queued"


def awaits_its_pod(reservation: Reservation) -> bool:
    """Counted against a namespace's pending bound (`max_pending_per_namespace`): a booking made at
    admission whose pod has not appeared yet, and a queue entry made at admission whose pod has not been
    seen either (it books nothing, but a loop of creates refused after admission would otherwise leave
    any number of them, issue #42, 7)."""
    if reservation.phase is ReservationPhase.RESERVED:
        return True
    return reservation.phase is ReservationPhase.QUEUED and not reservation.pod_seen


def holding_of(reservation: Reservation) -> Holding | None:
    """How `reservation` counts for its namespace; None once it ended."""
    phase = reservation.phase
    if phase is ReservationPhase.HELD:
        # A queue head's hold: the entry it holds for is counted already (queued).
        return None if reservation.queue_entry else Holding.HELD
    if phase is ReservationPhase.QUEUED:
        return Holding.QUEUED
    if phase is ReservationPhase.RESERVED:
        return Holding.QUEUED if reservation.queue_entry else Holding.PENDING
    if phase in (ReservationPhase.BOUND, ReservationPhase.LOST):
        return Holding.BOUND
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Holdings:
    """What one namespace holds, in MiB, by way (see `Holding`)."""

    bound_mib: int = 0
    pending_mib: int = 0
    held_mib: int = 0
    queued_mib: int = 0
    holds: int = 0
    """How many holds (each kept for one task)."""

    @property
    def total_mib(self) -> int:
        return self.bound_mib + self.pending_mib + self.held_mib + self.queued_mib

    def with_(self, reservation: Reservation, *, sign: int = 1) -> Holdings:
        """These holdings with `reservation` added (sign 1) or taken out (sign -1)."""
        way = holding_of(reservation)
        if way is None:
            return self
        field = f"{way.value}_mib"
        changed = replace(self, **{field: getattr(self, field) + sign * reservation.mib})
        return replace(changed, holds=changed.holds + sign) if way is Holding.HELD else changed

    def describe(self) -> str:
        return (
            f"{self.total_mib} MiB (bound {self.bound_mib}, pending {self.pending_mib}, "
            f"held {self.held_mib}, queued {self.queued_mib})"
        )


def holdings_of(reservations: Iterable[Reservation], namespace: str) -> Holdings:
    """What `namespace` holds among `reservations` (the reference `LedgerIndex` keeps up to date)."""
    out = Holdings()
    for r in reservations:
        if r.namespace == namespace:
            out = out.with_(r)
    return out


SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


def creator_of(user: str, namespace: str) -> str:
    """Whose pending bound a booking counts against (3. above): its creating user; for a
    ServiceAccount, that account in the pod's namespace. A ServiceAccount creates pods for the
    namespace they land in (Kubernetes' own controllers for every team's Deployments and Jobs:
    system:serviceaccount:kube-system:replicaset-controller; an Airflow executor), and keyed on the
    account alone one team's workloads would fill the bound for every other team's (issue #42, 6). A
    person's bound stays one across every namespace they reach."""
    if user.startswith(SERVICE_ACCOUNT_PREFIX):
        return f"{user} in namespace {namespace}"
    return user


def pending_of_user(reservations: Iterable[Reservation], creator: str) -> int:
    """MiB of `creator`'s bookings (see `creator_of`) whose pod has not appeared yet."""
    return sum(
        r.mib
        for r in reservations
        if creator_of(r.user, r.namespace) == creator and holding_of(r) is Holding.PENDING
    )


def with_pods_seen(
    holdings: Holdings,
    pending: Iterable[Reservation],
    *,
    namespace: str,
    user: str,
    appeared: Callable[[Reservation], bool],
) -> tuple[Holdings, int]:
    """`holdings` of `namespace` with the pending bookings whose pod has `appeared` (a pod carrying it
    exists, though the controller has not bound it yet) counted as bound, and the pending MiB of `user`
    (as `creator_of` names it) whose pod has not. The controller binds within a second or so; a webhook
    that sees pods appear need not wait for it, so a burst of real pods is not taken for pods that never
    appear."""
    seen_mib = user_unseen = 0
    for r in pending:
        if holding_of(r) is not Holding.PENDING:
            continue
        if appeared(r):
            seen_mib += r.mib if r.namespace == namespace else 0
        elif creator_of(r.user, r.namespace) == user:
            user_unseen += r.mib
    moved = min(seen_mib, holdings.pending_mib)
    adjusted = replace(
        holdings, pending_mib=holdings.pending_mib - moved, bound_mib=holdings.bound_mib + moved
    )
    return adjusted, user_unseen


@dataclass(frozen=True, slots=True, kw_only=True)
class Quota:
    """A namespace's limit on GPU memory: one ResourceQuota's hard `requests.<resource>`."""

    name: str
    hard_mib: int
    used_mib: int | None = None
    """Its pods' use as the API server's quota controller last counted it (for messages)."""


DEFAULT_PENDING_MIB_PER_NAMESPACE = 131_072
DEFAULT_PENDING_MIB_PER_USER = 131_072


@dataclass(frozen=True, slots=True, kw_only=True)
class TenancySettings:
    max_pending_mib_per_namespace: int = DEFAULT_PENDING_MIB_PER_NAMESPACE
    """MiB of bookings whose pod has not appeared, per namespace (0: no bound). A real pod appears
    milliseconds after its admission and is bound within a second or so, so only a burst of
    creations comes near this; pods that never appear can withhold at most this, each for the
    reservation TTL."""
    max_pending_mib_per_user: int = DEFAULT_PENDING_MIB_PER_USER
    """The same per user (the admission request's user), within any namespace (0: no bound)."""
    max_holds_per_namespace: int = 1
    """Holds (refuse mode's memory kept for a refused large task's next try) per namespace; 0: none."""


class Limit(StrEnum):
    QUOTA = "quota"
    PENDING_NAMESPACE = "pending-namespace"
    PENDING_USER = "pending-user"


@dataclass(frozen=True, slots=True, kw_only=True)
class OverLimit:
    limit: Limit
    message: str


def over_limit(
    *,
    namespace: str,
    user: str,
    mib: int,
    holdings: Holdings,
    user_pending_mib: int,
    quotas: Sequence[Quota],
    settings: TenancySettings,
    resource: str,
    credit_mib: int = 0,
) -> OverLimit | None:
    """Why a pod of `namespace` created by `user`, asking `mib` in all (every GPU of it), may not be
    booked now; None when it may. `credit_mib` is memory already held for this very task (a hold),
    which its admission replaces."""
    held = holdings.total_mib - credit_mib
    for q in sorted(quotas, key=lambda q: (q.hard_mib, q.name)):
        if held + mib > q.hard_mib:
            seen = (
                f"; its pods use {q.used_mib} MiB as the quota counts them" if q.used_mib is not None else ""
            )
            return OverLimit(
                limit=Limit.QUOTA,
                message=(
                    f'GPU memory exceeded quota: ResourceQuota "{q.name}" of namespace {namespace} allows '
                    f"requests.{resource}={q.hard_mib} (MiB); the namespace holds {holdings.describe()}"
                    f"{seen}, and this pod asks {mib} MiB. Memory comes back as its pods finish and its "
                    "pending bookings are bound or expire"
                ),
            )
    bound = settings.max_pending_mib_per_namespace
    if bound and holdings.pending_mib > 0 and holdings.pending_mib + mib > bound:
        return OverLimit(
            limit=Limit.PENDING_NAMESPACE,
            message=(
                f"namespace {namespace} already has {holdings.pending_mib} MiB of GPU bookings whose pods "
                f"have not appeared yet; with this pod's {mib} MiB that is over the bound of {bound} MiB "
                "(webhook.settings.max_pending_mib_per_namespace). Each ends within a second or so when "
                "its pod appears, or with the reservation TTL when it never does"
            ),
        )
    bound = settings.max_pending_mib_per_user
    if bound and user_pending_mib > 0 and user_pending_mib + mib > bound:
        return OverLimit(
            limit=Limit.PENDING_USER,
            message=(
                f"user {user or '(unknown)'} already has {user_pending_mib} MiB of GPU bookings whose pods "
                f"have not appeared yet; with this pod's {mib} MiB that is over the bound of {bound} MiB "
                "(webhook.settings.max_pending_mib_per_user). Each ends within a second or so when its pod "
                "appears, or with the reservation TTL when it never does"
            ),
        )
    return None


def why_no_hold(
    *, mib: int, holdings: Holdings, quotas: Sequence[Quota], settings: TenancySettings
) -> str | None:
    """Why a namespace may not have one more hold of `mib`; None when it may."""
    limit = settings.max_holds_per_namespace
    if holdings.holds >= limit:
        return f"the namespace has {holdings.holds} hold(s), its most (max_holds_per_namespace {limit})"
    for q in quotas:
        if holdings.total_mib + mib > q.hard_mib:
            return f'a hold of {mib} MiB would take the namespace over its ResourceQuota "{q.name}"'
    return None


class RefusalMemory:
    """Tasks refused lately, by task key: a hold goes only to a task seen retrying (refused a second
    time within `window_s`), not to a pod that asks once and never comes back. Times are handed in;
    at most `capacity` tasks are remembered (the oldest forgotten first)."""

    def __init__(self, *, window_s: float, capacity: int = 10_000) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()

    def refused(self, task_key: str, *, now: float) -> bool:
        """Record a refusal of `task_key`; whether it had been refused before, within the window."""
        while self._seen and next(iter(self._seen.values())) < now - self.window_s:
            self._seen.popitem(last=False)
        before = self._seen.pop(task_key, None)
        self._seen[task_key] = now
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return before is not None and before >= now - self.window_s

    def forget(self, task_key: str) -> None:
        """The task was admitted: its next refusal is a first one again."""
        self._seen.pop(task_key, None)


def advertised_mib(gpus: Iterable[Gpu]) -> dict[str, int]:
    """Each GPU node's capacity of the memory resource: the sum of its GPUs' totals (those not
    missing). The scheduler checks a pod's request against it, a weaker test than vramshare's own per
    GPU, so it never turns away a pod vramshare placed; GPUs unhealthy for a moment still count, so
    the capacity does not flap under pods on their way to the node."""
    out: dict[str, int] = {}
    for g in gpus:
        out[g.node] = out.get(g.node, 0) + (0 if g.missing else g.total_mib)
    return out
