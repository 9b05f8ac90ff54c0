"""Step 2, intent: what a GPU pod asks for and how it is to be treated, resolved once.

Its size and GPU count, its delivery mode, whether it waits in the queue, whether it is told its
memory budget, and how it is refused if it does not fit. Each is the pod's annotation, else its
namespace's label, else the default; a value that is not accepted refuses the pod (400) naming the
annotation, the value and what is accepted. Every later step reads these from the `Intent`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from vramshare.domain import (
    AllocationRequest,
    InvalidCountError,
    InvalidRequestError,
    parse_gpu_count,
    parse_memory_request,
)
from vramshare.kube.pods import GUARDRAILS_ANNOTATION, GUARDRAILS_NAMESPACE_LABEL
from vramshare_webhook import review as rv
from vramshare_webhook.admission.triage import GpuAsk
from vramshare_webhook.decision import Invalid, Reason
from vramshare_webhook.delivery_modes import (
    DEVICE_LIST_ROOT,
    Delivery,
    delivery_for,
    sees_every_gpu,
    unlisted_device_paths,
)
from vramshare_webhook.pod import PodFacts
from vramshare_webhook.settings import EXECUTOR_LABEL, RefusalStyle, WebhookSettings

log = structlog.get_logger("vramshare.webhook")


@dataclass(frozen=True, kw_only=True)
class Intent:
    """A GPU pod's ask and how it is treated (see the module docstring)."""

    request: rv.Request
    facts: PodFacts
    mib: int
    count: int
    delivery: Delivery
    queue: bool
    """It waits behind vramshare's gate when nothing fits now (instead of being refused)."""
    defer: bool
    """Another admission system holds it (Kueue): it waits behind vramshare's gate too, booking
    nothing until its other gates are lifted."""
    guard: bool
    """It is told its memory budget (see `vramshare.domain.guardrails`)."""
    style: RefusalStyle
    """How it is refused if it does not fit."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """What the decision's log line says about it."""

    @property
    def namespace(self) -> str:
        return self.request.namespace

    @property
    def pod(self) -> str:
        """namespace/name, for messages."""
        return f"{self.request.namespace}/{self.facts.display_name}"

    def noting(self, **details: Any) -> Intent:
        """The same intent, its log line saying more."""
        return replace(self, details={**self.details, **details})

    def allocation(self) -> AllocationRequest:
        model = self.facts.model_request.strip() if self.facts.model_request is not None else None
        return AllocationRequest(
            mib=self.mib,
            namespace=self.namespace,
            pod=self.facts.display_name,
            nodes=self.facts.pinned_nodes,
            model=model or None,
            count=self.count,
        )


def resolve_intent(
    ask: GpuAsk, *, settings: WebhookSettings, namespace_labels: Mapping[str, str]
) -> Intent | Invalid:
    """The pod's `Intent`, or why its own input is wrong (in the order a user fixes them)."""
    request, facts = ask.request, ask.facts
    delivery = _delivery(request.object, settings=settings, namespace_labels=namespace_labels)
    if isinstance(delivery, Invalid):
        return delivery
    unlisted = unlisted_device_paths(request.object)
    if unlisted:
        return Invalid(
            reason=Reason.DEVICE_LIST_PATH,
            message=f"{'; '.join(unlisted)}: a path naming nvidia-container-devices is a device-list request "
            f"to NVIDIA's runtime, and only vramshare makes those (under {DEVICE_LIST_ROOT}, for the GPUs it "
            "booked); mount the volume elsewhere",
        )
    every_gpu = sees_every_gpu(request.object)
    if every_gpu:
        return Invalid(
            reason=Reason.SEES_EVERY_GPU,
            message=f"{'; '.join(every_gpu)}: this shows the container every GPU of the node, not the one "
            "vramshare books for it; a GPU pod runs unprivileged and without host paths to the node's "
            "devices",
        )
    if facts.device_resources:
        return Invalid(
            reason=Reason.DEVICE_PLUGIN_RESOURCE,
            message=(
                f"pod requests {', '.join(facts.device_resources)} and also carries annotation "
                f'"{settings.annotation}": '
                "use one or the other (vramshare shares GPUs by memory without the device plugin)"
            ),
        )
    try:
        mib = parse_memory_request(
            ask.memory_request, annotation=settings.annotation, max_mib=settings.max_request_mib
        )
    except InvalidRequestError as exc:
        return Invalid(reason=Reason.INVALID_ANNOTATION, message=str(exc))
    count = 1
    if facts.count_request is not None:
        try:
            count = parse_gpu_count(facts.count_request, max_count=settings.max_gpus_per_pod)
        except InvalidCountError as exc:
            return Invalid(reason=Reason.INVALID_GPU_COUNT, message=str(exc))
    queue = opted(
        facts.queue_request,
        annotation=settings.queue_annotation,
        labelled=namespace_labels.get(settings.queue_namespace_label),
        default=settings.queue_by_default,
        reason=Reason.INVALID_QUEUE_ANNOTATION,
        meaning=('"true" (wait for a GPU)', '"false" (refuse when none fits now)'),
    )
    if isinstance(queue, Invalid):
        return queue
    # A pod with several GPUs does not wait in the queue (the planner places one GPU at a time):
    # it is refused while no node has room for the whole set, and its task retries.
    # Nor does one whose delivery mode fixes its devices at creation (cdi, volume-mounts): it is
    # refused while nothing fits, and retried.
    queue = queue and count == 1 and delivery.can_queue
    # A pod another admission system holds (Kueue, until it admits the pod) waits behind vramshare's
    # gate too, booking nothing: the controller places it once vramshare's gate is its last.
    defer = bool(facts.held_elsewhere) and settings.wait_for_other_gates and count == 1 and delivery.can_queue
    guard = opted(
        facts.guardrails_request,
        annotation=GUARDRAILS_ANNOTATION,
        labelled=namespace_labels.get(GUARDRAILS_NAMESPACE_LABEL),
        default=settings.guardrails_by_default,
        reason=Reason.INVALID_GUARDRAILS_ANNOTATION,
        meaning=('"true" (set the budget variables)', '"false" (leave them to the pod)'),
    )
    if isinstance(guard, Invalid):
        return guard
    style = refusal_style(request, settings=settings, namespace_labels=namespace_labels)
    if isinstance(style, Invalid):
        return style
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
    return Intent(
        request=request,
        facts=facts,
        mib=mib,
        count=count,
        delivery=delivery,
        queue=queue or defer,
        defer=defer,
        guard=guard,
        style=style,
        details=details,
    )


def _delivery(
    pod: dict[str, Any], *, settings: WebhookSettings, namespace_labels: Mapping[str, str]
) -> Delivery | Invalid:
    """How this namespace's GPU pods get their GPU (see vramshare_webhook.delivery_modes), or why this pod
    cannot get it so."""
    delivery = delivery_for(
        default=settings.delivery_mode,
        runtime_class=settings.runtime_class_name,
        namespace_labels=namespace_labels,
        device_list_claim=settings.device_list_claim,
    )
    if isinstance(delivery, str):
        return Invalid(reason=Reason.INVALID_DELIVERY, message=delivery)
    conflict = delivery.conflict(pod)
    if conflict is not None:
        return Invalid(reason=Reason.RUNTIME_CLASS_CONFLICT, message=conflict)
    return delivery


def opted(
    value: str | None,
    *,
    annotation: str,
    labelled: str | None,
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
    if labelled is not None and labelled.strip().lower() in choices:
        return choices[labelled.strip().lower()]
    return default


def refusal_style(
    request: rv.Request, *, settings: WebhookSettings, namespace_labels: Mapping[str, str]
) -> RefusalStyle | Invalid:
    """How the pod is refused if it does not fit: its annotation, else its namespace's label, else
    the default for the Airflow component that made it (the KubernetesExecutor's pods: requeue)."""
    # Read defensively: the handler asks for a late answer, whatever the body's shape.
    meta = request.object.get("metadata") if isinstance(request.object, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    annotations, labels = meta.get("annotations"), meta.get("labels")
    accepted = ", ".join(s.value for s in RefusalStyle)
    value = annotations.get(settings.refusal_annotation) if isinstance(annotations, dict) else None
    if value is not None:
        try:
            return RefusalStyle(str(value).strip().lower())
        except ValueError:
            return Invalid(
                reason=Reason.INVALID_REFUSAL_ANNOTATION,
                message=f'annotation "{settings.refusal_annotation}" is "{value}": accepted '
                f"values are {accepted}",
            )
    labelled = namespace_labels.get(settings.refusal_namespace_label)
    if labelled is not None and labelled.strip().lower() in {s.value for s in RefusalStyle}:
        return RefusalStyle(labelled.strip().lower())
    if isinstance(labels, dict) and str(labels.get(EXECUTOR_LABEL, "")).lower() == "true":
        return settings.executor_refusal
    return settings.default_refusal
