"""The admission decision: read the pod once -> choose (pure) -> commit -> a decision value.

`Admitter.decide()` returns a `Decision`; `Admitter.review()` turns it into the answer, metrics and
the log line, and never raises: whatever happens, the API server gets a well-formed answer carrying
the request UID.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog

from vramshare.domain import (
    AllocationRequest,
    Choice,
    Gpu,
    InvalidCountError,
    InvalidRequestError,
    Refusal,
    Reservation,
    ReservationPhase,
    choose,
    could_ever_fit,
    gpu_to_hold,
    missing_mib,
    model_matches,
    parse_gpu_count,
    parse_memory_request,
    refusal_message,
    retry_after_s,
)
from vramshare.domain.guardrails import BUDGET_MIB, TF_GROWTH, guardrail_env
from vramshare.domain.scheduling import NodeView, schedulable_nodes
from vramshare.domain.tenancy import (
    Holding,
    Holdings,
    Limit,
    OverLimit,
    Quota,
    RefusalMemory,
    holding_of,
    holdings_of,
    over_limit,
    pending_of_user,
    why_no_hold,
    with_pods_seen,
)
from vramshare.kube.ledger import CommitConflictError, Snapshot
from vramshare.kube.objects import GpuReservation
from vramshare.kube.pods import (
    GUARDRAILS_ANNOTATION,
    GUARDRAILS_NAMESPACE_LABEL,
    MODEL_ANNOTATION,
    MPS_LABEL,
    QUEUE_GATE,
)
from vramshare.kube.resources import ANNOTATION_REINVOKED, MEMORY_RESOURCE
from vramshare_webhook import review as rv
from vramshare_webhook.decision import (
    Admit,
    Contention,
    Decision,
    Errored,
    Hide,
    Invalid,
    Late,
    NameTaken,
    Outcome,
    Queue,
    Reason,
    Refuse,
    Skip,
    answer,
)
from vramshare_webhook.delivery import (
    Delivery,
    delivery_for,
    foreign_gpu_requests,
)
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.pod import (
    Placement,
    PodFacts,
    claimed_marks,
    display_name,
    ephemeral_patch,
    hide_gpus_patch,
    literal_env,
    placement_patch,
    pod_annotations,
    queue_patch,
    read_pod,
    shape_problem,
    strip_patch,
)
from vramshare_webhook.settings import EXECUTOR_LABEL, RefusalStyle, WebhookSettings
from vramshare_webhook.tenancy import containers_requesting, memory_resource_patch, quotas_in

log = structlog.get_logger("vramshare.webhook")


class Ledger(Protocol):
    async def snapshot(self, *, fresh: bool = False) -> Snapshot: ...
    async def get_reservation(self, namespace: str, name: str) -> GpuReservation | None: ...
    async def claim_reinvocation(self, reservation: GpuReservation, *, claimant: str) -> bool: ...
    async def pod_carries(self, namespace: str, reservation: str) -> bool: ...
    async def commit(
        self, *, reservation: GpuReservation, token: str, live: bool = False
    ) -> GpuReservation: ...
    async def enqueue(self, reservation: GpuReservation) -> GpuReservation: ...
    async def withdraw(self, created: GpuReservation) -> None: ...
    def decided(self, reservation: GpuReservation) -> None: ...
    def undecided(self, reservation: GpuReservation) -> None: ...
    async def withdraw_hold(self, namespace: str, name: str) -> None: ...
    async def pod_exists(self, namespace: str, name: str) -> bool: ...
    async def active_holds(self) -> list[GpuReservation]: ...
    async def pod_labels(self, namespace: str) -> set[str]: ...
    def release_rate(self, gpu_uuid: str | None = None) -> float: ...


def not_an_earlier_pass(
    existing: GpuReservation,
    *,
    placement: Placement | None,
    facts: PodFacts,
    mib: int,
    user: str,
    now: float,
    window_s: float,
) -> str | None:
    """Why the booking a pod's annotations point to is not this pod's own earlier pass (None if it is).

    `placement` is what the annotations claim; None when they name a queue entry instead. Everything
    compared is the reservation's own record, which only vramshare writes: a user who copies another
    pod's vramshare.io/* annotations can match the placement, but not a booking that is still unbound
    and untaken, younger than the window, made for the same pod name and size, by the same user.
    `claim_reinvocation` then lets at most one pass take it up.
    """
    spec = existing.spec
    if placement is None:
        if spec.placed:
            return "the reservation is placed; the annotations name no GPU"
    elif (spec.gpu_uuid, spec.gpu_index, spec.node_name) != (
        placement.gpu_uuid,
        placement.gpu_index,
        placement.node,
    ):
        return "the annotations name another GPU than the reservation"
    if spec.pod_name != facts.display_name or spec.memory_mib != mib:
        return "the reservation was made for another pod or size"
    if spec.admitted_user != user:
        return "the reservation was made for another user"
    waiting = ReservationPhase.RESERVED if placement is not None else ReservationPhase.QUEUED
    if existing.phase is not waiting or existing.status.pod_uid:
        return "the reservation already belongs to a pod"
    if now - (existing.meta.created_at or 0.0) > window_s:
        return f"the reservation is older than {window_s:g} s"
    if ANNOTATION_REINVOKED in existing.meta.annotations:
        return "the reservation was already taken up by a reinvocation"
    return None


@dataclass(frozen=True, kw_only=True)
class _Conflicted:
    """The commit on this GPU lost a race: decide again."""

    gpu_uuid: str


def _pending_in(snapshot: Snapshot, namespace: str) -> int:
    """Bookings in `namespace` whose pod has not appeared yet."""
    if snapshot.index is not None:
        return snapshot.index.pending_in(namespace)
    return sum(
        1 for r in snapshot.reservations if r.namespace == namespace and r.phase is ReservationPhase.RESERVED
    )


def _holds_of(snapshot: Snapshot, task_key: str) -> list[Reservation]:
    """The memory held for that task (by an earlier refusal of it)."""
    if snapshot.index is not None:
        return snapshot.index.holds_for(task_key)
    return [r for r in snapshot.reservations if r.is_active and r.held_for == task_key]


def _holdings(snapshot: Snapshot, namespace: str) -> Holdings:
    """What `namespace` holds (see `vramshare.domain.tenancy`)."""
    if snapshot.index is not None:
        return snapshot.index.holdings(namespace)
    return holdings_of(snapshot.reservations, namespace)


def _pending_bookings(snapshot: Snapshot) -> list[Reservation]:
    if snapshot.index is not None:
        return snapshot.index.pending_bookings()
    return [r for r in snapshot.reservations if holding_of(r) is Holding.PENDING]


def _pending_of_user(snapshot: Snapshot, user: str) -> int:
    if snapshot.index is not None:
        return snapshot.index.pending_of_user(user)
    return pending_of_user(snapshot.reservations, user)


_LIMIT_REASONS = {
    Limit.QUOTA: Reason.QUOTA,
    Limit.PENDING_NAMESPACE: Reason.PENDING_MIB_LIMIT,
    Limit.PENDING_USER: Reason.PENDING_MIB_LIMIT,
}


def _held_gpus(snapshot: Snapshot) -> set[str]:
    if snapshot.index is not None:
        return snapshot.index.held_gpus()
    return {r.gpu_uuid for r in snapshot.reservations if r.is_active and r.held_for}


def _logged_name(pod: dict[str, Any]) -> str:
    """The pod's name for a log line, even from a malformed pod."""
    meta = pod.get("metadata")
    return display_name(pod) if isinstance(meta, dict) else "?"


def reservation_name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata", {})
    base = str(meta.get("name") or meta.get("generateName") or "pod").rstrip("-")[:52].rstrip("-.")
    return f"{base}-{secrets.token_hex(4)}"


class Admitter:
    def __init__(
        self,
        *,
        settings: WebhookSettings,
        ledger: Ledger,
        metrics: WebhookMetrics,
        clock: Callable[[], float] = time.time,
        server_clock: Callable[[], float] | None = None,
        namespace_labels: Callable[[str], Mapping[str, str]] = lambda namespace: {},
        nodes: Callable[[], Iterable[NodeView]] = tuple,
        resource_quotas: Callable[[str], Iterable[dict[str, Any]]] = lambda namespace: (),
        gpu_pods: Callable[[], Iterable[tuple[str, str]]] = tuple,
        replicas: Callable[[], Sequence[str]] = tuple,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.metrics = metrics
        self.clock = clock
        self.server_clock = server_clock or clock
        """The API server's clock (KubeClient.server_clock): the reinvocation window is measured
        from a booking's creationTimestamp, which the API server stamped."""
        self.namespace_labels = namespace_labels
        """The labels of a namespace (from a watch cache): its queue mode."""
        self.nodes = nodes
        """The Node objects (from a watch cache); none known: only hostname pinning is honoured."""
        self.resource_quotas = resource_quotas
        self.replicas = replicas
        """The webhook replicas up (`vramshare.kube.replicas`), among which GPUs that tie are dealt out."""
        self.gpu_pods = gpu_pods
        """(namespace, reservation label) of every pod carrying vramshare's label (from a watch cache):
        a booking whose pod appeared is not pending, though the controller may not have bound it."""
        """A namespace's ResourceQuota objects (from a watch cache): its GPU-memory quota."""
        self.refused_tasks = RefusalMemory(window_s=settings.hold_limit_s)
        """Tasks refused lately: a hold goes only to one refused again, i.e. seen retrying."""

    async def review(self, request: rv.Request) -> rv.Review:
        started = time.perf_counter()
        deadline = self.settings.decision_deadline_s
        try:
            # The whole answer is bounded: an admission the API server has given up on must not go
            # on to book memory. A cancelled commit withdraws its booking (see KubeLedger.commit).
            async with asyncio.timeout(deadline):
                decision = await self.decide(request)
        except TimeoutError:
            log.warning("admission missed its deadline", uid=request.uid, deadline_s=deadline)
            decision = Late(
                message=(
                    f"vramshare could not decide within {deadline:g} s (the API server is slow or the GPUs "
                    f"are contended); nothing was reserved. {self._hint(request)}"
                )
            )
        except Exception as exc:  # an answer, never a crash: the failurePolicy decides what follows
            log.exception("admission failed", uid=request.uid, namespace=request.namespace)
            decision = Errored(message=f"vramshare could not decide: {exc}", error_type=type(exc).__name__)
        # Only a refusal needs its style (most answers are for pods that ask for no GPU).
        style = self._refusal(request) if isinstance(decision, Refuse | Contention | Late) else None
        result = answer(
            decision,
            uid=request.uid,
            settings=self.settings,
            style=style if isinstance(style, RefusalStyle) else None,
        )
        elapsed = time.perf_counter() - started
        self.metrics.decisions.labels(result.outcome.value, result.reason).inc()
        self.metrics.decision_seconds.observe(elapsed)
        if result.outcome is not Outcome.SKIPPED:
            log.info(
                "decision",
                uid=request.uid,
                pod=f"{request.namespace}/{_logged_name(request.object)}",
                outcome=result.outcome.value,
                reason=result.reason,
                duration_ms=round(elapsed * 1000, 2),
                dry_run=request.dry_run,
                **result.log_fields,
            )
        return result.review

    async def decide(self, request: rv.Request) -> Decision:
        pod = request.object
        debug = request.operation == "UPDATE" and request.sub_resource == "ephemeralcontainers"
        if request.kind != "Pod" or (request.operation != "CREATE" and not debug):
            return Skip(reason=Reason.NOT_A_POD_CREATE)
        problem = shape_problem(pod)
        if problem is not None:
            return Invalid(reason=Reason.MALFORMED_POD, message=f"not a valid pod: {problem}")
        if debug:  # kubectl debug: the new containers see the pod's GPUs, or none
            ops = ephemeral_patch(pod)
            return (
                Hide(patch=ops, reason=Reason.EPHEMERAL_CONTAINERS)
                if ops
                else Skip(reason=Reason.NO_GPU_REQUEST)
            )
        facts = read_pod(
            pod,
            annotation=self.settings.annotation,
            queue_annotation=self.settings.queue_annotation,
            namespace=request.namespace,
        )
        if facts.memory_request is None:
            resource = self.settings.memory_resource
            requesting = containers_requesting(pod, resource) if resource else []
            if requesting:
                return Invalid(
                    reason=Reason.MEMORY_RESOURCE_WITHOUT_REQUEST,
                    message=f"{', '.join(requesting)} request resource {resource}: only vramshare sets it, "
                    f'on pods it admits (those with annotation "{self.settings.annotation}"); remove it and '
                    f'ask for GPU memory with the annotation "{self.settings.annotation}"',
                )
            # Only pods vramshare admits carry vramshare.io/* keys: others lose them, with a warning.
            marks = claimed_marks(pod)
            warnings: tuple[str, ...] = (
                (
                    f"vramshare removed {', '.join(marks)}: only vramshare sets vramshare.io/* labels and "
                    f'annotations, on pods it admits (those with annotation "{self.settings.annotation}")',
                )
                if marks
                else ()
            )
            if self.settings.hide_gpus and not facts.device_resources:
                requests = foreign_gpu_requests(pod_annotations(pod))
                if requests:
                    warnings += (
                        f"vramshare removed {', '.join(f'annotation {r}' for r in requests)}: GPUs in this "
                        f'namespace are booked with the annotation "{self.settings.annotation}"',
                    )
                return Hide(patch=hide_gpus_patch(pod), warnings=warnings)
            if marks:
                return Hide(patch=strip_patch(pod), warnings=warnings)
            return Skip(reason=Reason.NO_GPU_REQUEST)
        delivery = self._delivery(request.namespace, pod)
        if isinstance(delivery, Invalid):
            return delivery
        decision = await self._gpu_decision(request, facts, can_queue=delivery.can_queue)
        if isinstance(decision, Admit):
            return replace(
                decision,
                patch=[
                    *decision.patch,
                    *delivery.patch(pod, decision.placement.gpu_uuids),
                    *self._memory_resource(pod, decision.details),
                ],
            )
        if isinstance(decision, Queue):  # only modes that can deliver when the gate lifts queue
            return replace(
                decision,
                patch=[
                    *decision.patch,
                    *delivery.patch(pod, ()),
                    *self._memory_resource(pod, decision.details),
                ],
            )
        return decision

    def _memory_resource(self, pod: dict[str, Any], details: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The pod's request of the memory resource (see `vramshare_webhook.tenancy`): its MiB, all GPUs
        together, which ResourceQuota, the scheduler and Kueue count."""
        resource = self.settings.memory_resource
        if not resource:
            return []
        return memory_resource_patch(
            pod, resource=resource, mib=int(details["mib"]) * int(details.get("gpus", 1))
        )

    def _delivery(self, namespace: str, pod: dict[str, Any]) -> Delivery | Invalid:
        """How this namespace's GPU pods get their GPU (see vramshare_webhook.delivery), or why this
        pod cannot get it so."""
        delivery = delivery_for(
            default=self.settings.delivery_mode,
            runtime_class=self.settings.runtime_class_name,
            namespace_labels=self.namespace_labels(namespace),
            device_list_claim=self.settings.device_list_claim,
        )
        if isinstance(delivery, str):
            return Invalid(reason=Reason.INVALID_DELIVERY, message=delivery)
        conflict = delivery.conflict(pod)
        if conflict is not None:
            return Invalid(reason=Reason.RUNTIME_CLASS_CONFLICT, message=conflict)
        return delivery

    async def _gpu_decision(self, request: rv.Request, facts: PodFacts, *, can_queue: bool) -> Decision:
        """A GPU pod's decision: its request read, then admitted on a GPU, queued (where its delivery
        mode `can_queue`) or refused."""
        pod = request.object
        if facts.memory_request is None:  # decide() sends only pods with a request
            return Skip(reason=Reason.NO_GPU_REQUEST)
        if facts.device_resources:
            return Invalid(
                reason=Reason.DEVICE_PLUGIN_RESOURCE,
                message=(
                    f"pod requests {', '.join(facts.device_resources)} and also carries annotation "
                    f'"{self.settings.annotation}": '
                    "use one or the other (vramshare shares GPUs by memory without the device plugin)"
                ),
            )
        try:
            mib = parse_memory_request(
                facts.memory_request,
                annotation=self.settings.annotation,
                max_mib=self.settings.max_request_mib,
            )
        except InvalidRequestError as exc:
            return Invalid(reason=Reason.INVALID_ANNOTATION, message=str(exc))
        count = 1
        if facts.count_request is not None:
            try:
                count = parse_gpu_count(facts.count_request, max_count=self.settings.max_gpus_per_pod)
            except InvalidCountError as exc:
                return Invalid(reason=Reason.INVALID_GPU_COUNT, message=str(exc))
        queue = self._queue_mode(request.namespace, facts)
        if isinstance(queue, Invalid):
            return queue
        # A pod with several GPUs does not wait in the queue (the planner places one GPU at a time):
        # it is refused while no node has room for the whole set, and its task retries.
        # Nor does one whose delivery mode fixes its devices at creation (cdi, volume-mounts): it is
        # refused while nothing fits, and retried.
        queue = queue and count == 1 and can_queue
        # A pod another admission system holds (Kueue, until it admits the pod) waits behind vramshare's
        # gate too, booking nothing: the controller places it once vramshare's gate is its last.
        defer = bool(facts.held_elsewhere) and self.settings.wait_for_other_gates and count == 1 and can_queue
        queue = queue or defer
        guard = self._guardrails(request.namespace, facts)
        if isinstance(guard, Invalid):
            return guard
        refusal = self._refusal(request)
        if isinstance(refusal, Invalid):
            return refusal
        details: dict[str, Any] = {"mib": mib}
        if count > 1:
            details["gpus"] = count
        if facts.overwritten:
            details["overwritten"] = list(facts.overwritten)
            # Security-relevant: said at warning level, whatever the decision.
            log.warning(
                "pod set what only vramshare sets; overwritten",
                pod=f"{request.namespace}/{facts.display_name}",
                user=request.username,
                overwritten=list(facts.overwritten),
            )
        earlier = await self._earlier_pass(request, facts, mib=mib, details=details, queue=queue)
        if isinstance(earlier, Placement):
            known = {g.uuid: g for g in (await self.ledger.snapshot()).gpus}
            gpus = [known[u] for u in earlier.gpu_uuids if u in known]
            budget = self._budget(mib, gpus) if guard and len(gpus) == len(earlier.gpu_uuids) else None
            return Admit(
                placement=earlier,
                patch=placement_patch(pod, earlier, guardrails=budget),
                reason=Reason.REINVOCATION,
                details=details,
            )
        if earlier is not None:  # its queue entry
            return self._queued(request, facts, entry=earlier, mib=mib, details=details, guard=guard)
        return await self._allocate(
            request, facts, mib=mib, count=count, details=details, queue=queue, guard=guard, defer=defer
        )

    def _budget(self, mib: int, gpus: list[Gpu]) -> Callable[[dict[str, Any]], dict[str, str]]:
        """Each container's budget variables on `gpus` (see `vramshare.domain.guardrails`): per GPU,
        as a fraction of the smallest."""
        node = gpus[0].node
        mps = any(n.name == node and n.labels.get(MPS_LABEL) == "true" for n in self.nodes())
        total = min(g.total_mib for g in gpus)
        return lambda container: guardrail_env(
            mib=mib, total_mib=total, mps=mps, user=literal_env(container), devices=len(gpus)
        )

    def _queue_mode(self, namespace: str, facts: PodFacts) -> bool | Invalid:
        """Whether a pod that does not fit now waits: its annotation, else its namespace's label, else
        the default."""
        return self._opted(
            namespace,
            facts.queue_request,
            annotation=self.settings.queue_annotation,
            label=self.settings.queue_namespace_label,
            default=self.settings.queue_by_default,
            reason=Reason.INVALID_QUEUE_ANNOTATION,
            meaning=('"true" (wait for a GPU)', '"false" (refuse when none fits now)'),
        )

    def _guardrails(self, namespace: str, facts: PodFacts) -> bool | Invalid:
        """Whether the pod is told its memory budget (see `vramshare.domain.guardrails`)."""
        return self._opted(
            namespace,
            facts.guardrails_request,
            annotation=GUARDRAILS_ANNOTATION,
            label=GUARDRAILS_NAMESPACE_LABEL,
            default=self.settings.guardrails_by_default,
            reason=Reason.INVALID_GUARDRAILS_ANNOTATION,
            meaning=('"true" (set the budget variables)', '"false" (leave them to the pod)'),
        )

    def _refusal(self, request: rv.Request) -> RefusalStyle | Invalid:
        """How the pod is refused if it does not fit: its annotation, else its namespace's label, else
        the default for the Airflow component that made it (the KubernetesExecutor's pods: requeue)."""
        # Read defensively: review() asks before the pod's shape is checked (any body gets an answer).
        meta = request.object.get("metadata") if isinstance(request.object, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        annotations, labels = meta.get("annotations"), meta.get("labels")
        accepted = ", ".join(s.value for s in RefusalStyle)
        value = annotations.get(self.settings.refusal_annotation) if isinstance(annotations, dict) else None
        if value is not None:
            try:
                return RefusalStyle(str(value).strip().lower())
            except ValueError:
                return Invalid(
                    reason=Reason.INVALID_REFUSAL_ANNOTATION,
                    message=f'annotation "{self.settings.refusal_annotation}" is "{value}": accepted '
                    f"values are {accepted}",
                )
        labelled = self.namespace_labels(request.namespace).get(self.settings.refusal_namespace_label)
        if labelled is not None and labelled.strip().lower() in {s.value for s in RefusalStyle}:
            return RefusalStyle(labelled.strip().lower())
        if isinstance(labels, dict) and str(labels.get(EXECUTOR_LABEL, "")).lower() == "true":
            return self.settings.executor_refusal
        return self.settings.default_refusal

    def _hint(self, request: rv.Request, retry_after_s: int | None = None) -> str:
        """The refusal's last sentence for this pod: how its task will be retried."""
        style = self._refusal(request)
        return self.settings.retry_hint_after(
            self.settings.retry_after_s if retry_after_s is None else retry_after_s,
            style if isinstance(style, RefusalStyle) else None,
        )

    def _opted(
        self,
        namespace: str,
        value: str | None,
        *,
        annotation: str,
        label: str,
        default: bool,
        reason: Reason,
        meaning: tuple[str, str],
    ) -> bool | Invalid:
        """A per-pod choice: the pod's annotation, else its namespace's label, else the default."""
        choices = {"true": True, "false": False}
        if value is not None:
            chosen = choices.get(value.strip().lower())
            if chosen is None:
                return Invalid(
                    reason=reason,
                    message=f'annotation "{annotation}" is "{value}": accepted values are {meaning[0]} and '
                    f"{meaning[1]}",
                )
            return chosen
        labelled = self.namespace_labels(namespace).get(label)
        if labelled is not None and labelled.strip().lower() in choices:
            return choices[labelled.strip().lower()]
        return default

    def _queued(
        self,
        request: rv.Request,
        facts: PodFacts,
        *,
        entry: str,
        mib: int,
        details: dict[str, Any],
        guard: bool,
    ) -> Queue:
        def known_now(container: dict[str, Any]) -> dict[str, str]:
            """Before the GPU is chosen only the booked MiB is known; the rest comes with the placement."""
            env = guardrail_env(mib=mib, total_mib=0, mps=False, user=literal_env(container))
            return {k: env[k] for k in (TF_GROWTH, BUDGET_MIB)}

        patch = queue_patch(request.object, reservation=entry, guardrails=known_now if guard else None)
        if facts.held_elsewhere:
            return Queue(
                entry=entry,
                patch=patch,
                message=(
                    f"vramshare: pod {request.namespace}/{facts.display_name} is held by "
                    f"{', '.join(facts.held_elsewhere)}: it waits as GpuReservation {entry} behind "
                    f"scheduling gate {QUEUE_GATE} too, and its {mib} MiB are booked only once its other "
                    "gates are lifted (Kueue admitted it), on a GPU with room then"
                ),
                reason=Reason.HELD_ELSEWHERE,
                details=details,
            )
        return Queue(
            entry=entry,
            patch=patch,
            message=(
                f"vramshare: no GPU has {mib} MiB free now; pod {request.namespace}/{facts.display_name} "
                f"waits in the queue as GpuReservation {entry} behind scheduling gate {QUEUE_GATE} until "
                "one has room (kubectl get gpureservations shows its position)"
            ),
            details=details,
        )

    async def _earlier_pass(
        self, request: rv.Request, facts: PodFacts, *, mib: int, details: dict[str, Any], queue: bool
    ) -> Placement | str | None:
        """The placement (or, in queue mode, the queue entry) of an earlier pass of this same pod
        creation, if the pod carries a genuine one.

        The API server gives every call a new request UID, reinvocations included, so the earlier pass
        is recognised by its booking (see `not_an_earlier_pass`). Anything else is not honoured: the
        pod is decided afresh and its copied annotations are overwritten."""
        placement = facts.claimed_placement
        name = placement.reservation if placement is not None else facts.claimed_queue_entry
        if name is None or (placement is None and not queue):
            return None
        existing = await self.ledger.get_reservation(request.namespace, name)
        why = (
            "the reservation does not exist"
            if existing is None
            else not_an_earlier_pass(
                existing,
                placement=placement,
                facts=facts,
                mib=mib,
                user=request.username,
                now=self.server_clock(),
                window_s=self.settings.reinvocation_window_s,
            )
        )
        if why is None and existing is not None:
            if await self.ledger.pod_carries(request.namespace, existing.name):
                why = "a pod already carries the reservation"
            elif not await self.ledger.claim_reinvocation(existing, claimant=request.uid):
                why = "the reservation was already taken up by a reinvocation"
        if why is not None:
            details["placement_not_honoured"] = why
            return None
        return placement if placement is not None else name

    async def _allocate(
        self,
        request: rv.Request,
        facts: PodFacts,
        *,
        mib: int,
        count: int = 1,
        details: dict[str, Any],
        queue: bool = False,
        guard: bool = False,
        defer: bool = False,
    ) -> Decision:
        model = facts.model_request.strip() if facts.model_request is not None else None
        alloc = AllocationRequest(
            mib=mib,
            namespace=request.namespace,
            pod=facts.display_name,
            nodes=facts.pinned_nodes,
            model=model or None,
            count=count,
        )
        if request.name and await self.ledger.pod_exists(request.namespace, request.name):
            # The create will fail with AlreadyExists: a booking for it would only hold memory until
            # the TTL ends it, and a loop of such creates could keep every large GPU booked.
            return NameTaken(
                message=f'pods "{request.name}" already exists in namespace {request.namespace}; vramshare '
                "books nothing for a pod that cannot be created"
            )
        # Stop retrying conflicts a little before the answer's own deadline, to say why.
        budget = self.settings.decision_deadline_s
        deadline = time.monotonic() + max(budget / 2, budget - 1.0)
        attempt = 0
        avoid: frozenset[str] = frozenset()
        while True:
            attempt += 1
            tried = {**details, "attempts": attempt}
            # No lock: a decision joins this process's view before its commit's first await, so the
            # next one counts it; replicas race, and the commit's precondition settles that.
            decision = await self._attempt(
                request, facts, alloc=alloc, details=tried, avoid=avoid, queue=queue, guard=guard, defer=defer
            )
            if not isinstance(decision, _Conflicted):
                return decision
            # Another replica is committing on that GPU: among near ties, try another one next.
            avoid = avoid | {decision.gpu_uuid}
            self.metrics.conflicts.inc()
            if time.monotonic() >= deadline:
                return self._contention(request, facts, mib=mib, details=tried)
            backoff = min(0.2, 0.005 * 2**attempt) * (0.5 + secrets.randbelow(100) / 100)
            await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))

    async def _attempt(
        self,
        request: rv.Request,
        facts: PodFacts,
        *,
        alloc: AllocationRequest,
        details: dict[str, Any],
        avoid: frozenset[str],
        queue: bool = False,
        guard: bool = False,
        defer: bool = False,
    ) -> Decision | _Conflicted:
        """Decide on a snapshot and commit; `_Conflicted` when the chosen GPU's ledger moved meanwhile."""
        choosing = time.perf_counter()
        snapshot = await self.ledger.snapshot()
        if (
            alloc.model is not None
            and snapshot.gpus
            and not any(model_matches(alloc.model, g.model) for g in snapshot.gpus)
        ):
            models = ", ".join(sorted({g.model for g in snapshot.gpus}))
            return Invalid(
                reason=Reason.INVALID_MODEL,
                message=f'annotation "{MODEL_ANNOTATION}" is "{alloc.model}": no GPU in the fleet has that '
                f"model; the models are: {models} (exact, or a pattern with * and ?)",
            )
        alloc = self._onto_schedulable_nodes(alloc, facts, snapshot)
        limit = self.settings.max_pending_per_namespace
        if limit and not request.dry_run and _pending_in(snapshot, request.namespace) >= limit:
            return Refuse(
                reason=Reason.PENDING_LIMIT,
                message=f"namespace {request.namespace} already has {limit} GPU bookings whose pods have not "
                "appeared yet (webhook.settings.max_pending_per_namespace); each ends when its pod "
                f"appears or expires. {self._hint(request)}",
                details=details,
            )
        over = self._over_limit(request, facts, alloc=alloc, snapshot=snapshot)
        if over is not None:
            # Confirmed on a consistent view: bookings may have been bound meanwhile, and pods created
            # a moment ago may not have reached this replica's watch yet.
            snapshot = await self.ledger.snapshot(fresh=True)
            pods: set[tuple[str, str]] | None = None
            if over.reason is not Reason.QUOTA:
                concerned = {request.namespace} | {
                    r.namespace for r in _pending_bookings(snapshot) if r.user == request.username
                }
                pods = {
                    (ns, label) for ns in sorted(concerned)[:8] for label in await self.ledger.pod_labels(ns)
                }
            over = self._over_limit(request, facts, alloc=alloc, snapshot=snapshot, pods=pods)
            if over is not None:
                return replace(over, details={**details, **over.details})
        if defer and self._could_ever_take(alloc, snapshot):
            return await self._enqueue(request, facts, mib=alloc.mib, details=details, guard=guard)

        def decide(view: Snapshot) -> Choice | Refusal:
            # Memory held for this task's next try (an earlier refusal of it) counts as its own.
            holds = _holds_of(view, facts.task_key)
            return choose(
                alloc,
                view.gpus,
                view.reservations,
                settings=self.settings.allocation,
                now=self.clock(),
                index=view.index,
                prefer=self.settings.identity,
                replicas=self.replicas(),
                avoid=avoid,
                credit={h.gpu_uuid: h.mib for h in holds},
            )

        decision = decide(snapshot)
        if not isinstance(decision, Choice):  # refuse only on a consistent view
            snapshot = await self.ledger.snapshot(fresh=True)
            decision = decide(snapshot)
        if not isinstance(decision, Choice) and queue and self._could_ever_take(alloc, snapshot):
            # It can wait for one of these; a request none could ever take is refused.
            return await self._enqueue(request, facts, mib=alloc.mib, details=details, guard=guard)
        if not isinstance(decision, Choice):
            return await self._refuse(request, facts, decision, snapshot=snapshot, details=details)
        gpu, gpus = decision.gpu, decision.gpus
        name = reservation_name(request.object)
        placement = Placement(
            reservation=name,
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            node=gpu.node,
            more=tuple((g.uuid, g.index) for g in gpus[1:]),
        )
        admitted = {**details, "headroom_mib": decision.headroom.headroom_mib}
        patch = placement_patch(
            request.object, placement, guardrails=self._budget(alloc.mib, list(gpus)) if guard else None
        )
        if request.dry_run:
            return Admit(placement=placement, patch=patch, reason=Reason.DRY_RUN, details=admitted)
        bookings = [
            GpuReservation.new(
                # The first booking is named as the pod's label says; the others after it.
                name=name if i == 0 else f"{name}-gpu{i}",
                namespace=request.namespace,
                pod=facts.display_name,
                mib=alloc.mib,
                gpu=g,
                admission_uid=request.uid,
                user=request.username,
                set_name=name if len(gpus) > 1 else "",
                gpu_count=len(gpus),
            )
            for i, g in enumerate(gpus)
        ]
        committing = time.perf_counter()
        self.metrics.choose_seconds.observe(committing - choosing)
        try:
            conflicted = await self._commit_all(bookings, snapshot)
        finally:
            self.metrics.commit_seconds.observe(time.perf_counter() - committing)
        if conflicted is not None:
            return _Conflicted(gpu_uuid=conflicted)
        self.refused_tasks.forget(facts.task_key)
        for hold in _holds_of(snapshot, facts.task_key):  # its task is in: the held memory is its own now
            await self.ledger.withdraw_hold(hold.namespace, hold.name)
            admitted["hold_used"] = hold.gpu_uuid
        return Admit(placement=placement, patch=patch, reason=Reason.FITS, details=admitted)

    def _over_limit(
        self,
        request: rv.Request,
        facts: PodFacts,
        *,
        alloc: AllocationRequest,
        snapshot: Snapshot,
        pods: set[tuple[str, str]] | None = None,
    ) -> Refuse | None:
        """The namespace's quota and the bounds on pending memory (see `vramshare.domain.tenancy`), as
        they stand on `snapshot`: a refusal naming the limit, or None. A booking whose pod has
        appeared (in `pods`, (namespace, reservation label) of the GPU pods; else this replica's pod
        watch) is not pending, though the controller may not have bound it yet."""
        namespace = request.namespace
        holdings = _holdings(snapshot, namespace)
        user_pending = _pending_of_user(snapshot, request.username)

        def verdict() -> OverLimit | None:
            return over_limit(
                namespace=namespace,
                user=request.username,
                mib=alloc.mib * alloc.count,
                holdings=holdings,
                user_pending_mib=user_pending,
                quotas=self._quotas(namespace),
                settings=self.settings.tenancy,
                resource=self.settings.memory_resource or MEMORY_RESOURCE,
                # Memory held for this task's next try is its own: its admission takes the hold's place.
                credit_mib=sum(h.mib for h in _holds_of(snapshot, facts.task_key)),
            )

        over = verdict()
        if over is not None and over.limit is not Limit.QUOTA:
            # Only when a pending bound is hit: which of those bookings' pods exist already.
            seen = pods if pods is not None else set(self.gpu_pods())
            holdings, user_pending = with_pods_seen(
                holdings,
                _pending_bookings(snapshot),
                namespace=namespace,
                user=request.username,
                appeared=lambda r: (r.namespace, r.pod_label or r.name) in seen,
            )
            over = verdict()
        if over is None:
            return None
        return Refuse(
            reason=_LIMIT_REASONS[over.limit],
            message=f"{over.message}. {self._hint(request)}",
            details={"limit": over.limit.value, "namespace_holds_mib": holdings.total_mib},
        )

    def _quotas(self, namespace: str) -> list[Quota]:
        resource = self.settings.memory_resource
        return quotas_in(self.resource_quotas(namespace), resource=resource) if resource else []

    async def _commit_all(self, bookings: list[GpuReservation], snapshot: Snapshot) -> str | None:
        """Commit every booking of one pod, each on its own GPU's token, all or nothing: when one loses
        its race the others are withdrawn and the UUID of the GPU that conflicted is returned. Until
        they are withdrawn they only make other decisions more careful, never less."""
        if len(bookings) == 1:
            booking = bookings[0]
            try:
                await self.ledger.commit(
                    reservation=booking, token=snapshot.tokens[booking.spec.gpu_uuid], live=snapshot.live
                )
            except CommitConflictError:
                return booking.spec.gpu_uuid
            return None
        # Every booking joins this process's view before the first await, as a single commit's does:
        # the commits below start only at the next turn of the loop, and a decision made meanwhile must
        # count them, or it could take the same GPUs on the strength of a chain it never saw.
        for b in bookings:
            self.ledger.decided(b)
        try:
            results = await asyncio.gather(
                *(
                    self.ledger.commit(
                        reservation=b, token=snapshot.tokens[b.spec.gpu_uuid], live=snapshot.live
                    )
                    for b in bookings
                ),
                return_exceptions=True,
            )
        except BaseException:  # cancelled (the deadline): commits that never started leave the view
            for b in bookings:
                self.ledger.undecided(b)
            raise
        made = [r for r in results if isinstance(r, GpuReservation)]
        if len(made) == len(bookings):
            return None
        await asyncio.gather(*(self.ledger.withdraw(r) for r in made))
        for booking, result in zip(bookings, results, strict=True):
            if isinstance(result, CommitConflictError):
                return booking.spec.gpu_uuid
        raise next(r for r in results if isinstance(r, BaseException))

    async def _refuse(
        self,
        request: rv.Request,
        facts: PodFacts,
        refusal: Refusal,
        *,
        snapshot: Snapshot,
        details: dict[str, Any],
    ) -> Refuse:
        """Refuse, keep memory for the task's next try where fairness asks for it (see
        `vramshare.domain.fairness`), and say when to retry from how fast memory frees lately."""
        holds = _holds_of(snapshot, facts.task_key)
        note = ""
        if holds:
            held = holds[0]
            note = f" GPU {held.gpu_uuid} keeps the memory that frees on it for this task's next try."
        elif not request.dry_run and refusal.request.count == 1:  # one GPU cannot be held for a set
            held_gpus = _held_gpus(snapshot)
            # Only a task seen retrying gets a hold, within its namespace's share of them and its quota.
            retrying = self.refused_tasks.refused(facts.task_key, now=self.clock())
            no_hold = why_no_hold(
                mib=refusal.request.mib,
                holdings=_holdings(snapshot, request.namespace),
                quotas=self._quotas(request.namespace),
                settings=self.settings.tenancy,
            )
            gpu = (
                gpu_to_hold(
                    refusal,
                    held=held_gpus,
                    settings=self.settings.allocation,
                    fairness=self.settings.fairness,
                )
                if retrying and no_hold is None and len(held_gpus) < self.settings.max_holds
                else None
            )
            if gpu is not None and await self._hold(
                request, facts, gpu=gpu, mib=refusal.request.mib, snapshot=snapshot
            ):
                note = (
                    f" GPU {gpu.label} now keeps the memory that frees on it for this task, for up to "
                    f"{self.settings.hold_limit_s:g} s: its next try is admitted there as soon as it "
                    "has room."
                )
                details = {**details, "hold": gpu.uuid}
        best = refusal.best_headroom_mib
        retry_after = retry_after_s(
            deficit_mib=missing_mib(refusal),
            rate_mib_per_s=self.ledger.release_rate(holds[0].gpu_uuid if holds else None),
            floor_s=self.settings.retry_after_min_s,
            ceiling_s=self.settings.retry_after_s,
        )
        message = refusal_message(
            refusal,
            max_sample_age_s=self.settings.accounting.max_sample_age_s,
            retry_hint=self._hint(request, retry_after),
        )
        return Refuse(
            message=message + note,
            details={**details, "best_headroom_mib": best},
            retry_after_s=retry_after,
        )

    async def _hold(
        self, request: rv.Request, facts: PodFacts, *, gpu: Gpu, mib: int, snapshot: Snapshot
    ) -> bool:
        """Book `gpu` for the refused task's next try; False when another commit got there first, or
        other holds made meanwhile took the namespace's or the fleet's last one.

        Holds on different GPUs commit on different tokens, so two refusals at once could both pass the
        count on their views. Each therefore counts again on a consistent read after its commit and
        withdraws its own when there are more than allowed: both may withdraw (no hold, until a later
        refusal), never both stay."""
        hold = GpuReservation.new(
            name=f"hold-{reservation_name(request.object)}",
            namespace=request.namespace,
            pod=facts.task,
            mib=mib,
            gpu=gpu,
            admission_uid=request.uid,
            user=request.username,
            held_for=facts.task_key,
        )
        try:
            created = await self.ledger.commit(
                reservation=hold, token=snapshot.tokens[gpu.uuid], live=snapshot.live
            )
        except CommitConflictError:
            return False
        # A queue head's hold is the queue's, not a refused task's: it does not count here.
        holds = [h for h in await self.ledger.active_holds() if not h.queue_entry]
        in_namespace = [h for h in holds if h.namespace == request.namespace]
        if len(in_namespace) > self.settings.max_holds_per_namespace or len(holds) > self.settings.max_holds:
            await self.ledger.withdraw(created)
            return False
        return True

    def _onto_schedulable_nodes(
        self, alloc: AllocationRequest, facts: PodFacts, snapshot: Snapshot
    ) -> AllocationRequest:
        """Only GPUs on nodes the scheduler could bind the pod to, each other one with why not."""
        nodes = list(self.nodes())
        if not nodes:
            return alloc
        allowed, reasons = schedulable_nodes(
            nodes, facts.node_rules, gpu_nodes=(g.node for g in snapshot.gpus)
        )
        if not reasons:
            return alloc  # every GPU node will do
        return replace(alloc, nodes=allowed, node_reasons=reasons)

    def _could_ever_take(self, alloc: AllocationRequest, snapshot: Snapshot) -> bool:
        """Whether some GPU the pod could be placed on would have room for it, empty."""
        return any(
            (alloc.nodes is None or g.node in alloc.nodes)
            and model_matches(alloc.model, g.model)
            and could_ever_fit(alloc.mib, g, settings=self.settings.allocation)
            for g in snapshot.gpus
        )

    async def _enqueue(
        self, request: rv.Request, facts: PodFacts, *, mib: int, details: dict[str, Any], guard: bool
    ) -> Queue:
        name = reservation_name(request.object)
        if facts.held_elsewhere:
            details = {**details, "held_elsewhere": list(facts.held_elsewhere)}
        if not request.dry_run:
            await self.ledger.enqueue(
                GpuReservation.queued(
                    name=name,
                    namespace=request.namespace,
                    pod=facts.display_name,
                    mib=mib,
                    admission_uid=request.uid,
                    user=request.username,
                )
            )
        return self._queued(request, facts, entry=name, mib=mib, details=details, guard=guard)

    def _contention(
        self, request: rv.Request, facts: PodFacts, *, mib: int, details: dict[str, Any]
    ) -> Decision:
        return Contention(
            message=(
                f"could not reserve {mib} MiB for pod {request.namespace}/{facts.display_name} "
                f"within {self.settings.decision_deadline_s:g} s: too many concurrent admissions "
                f"on the same GPUs. {self._hint(request)}"
            ),
            details=details,
        )
