"""What the webhook decided about one pod, as a value, and the one place it becomes an answer.

`Admitter.decide()` returns one of the decisions below; `answer()` maps it to the AdmissionReview
response and to the metric labels, so an outcome's wording, HTTP code and metric labels cannot drift
apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from vramshare_webhook import review as rv
from vramshare_webhook.patching import Operation
from vramshare_webhook.pod import Placement
from vramshare_webhook.settings import RefusalStyle, WebhookSettings


class Outcome(StrEnum):
    """The `outcome` label of vramshare_webhook_decisions_total."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    REFUSED = "refused"
    INVALID = "invalid"
    HIDDEN = "hidden"
    SKIPPED = "skipped"
    ERROR = "error"


class Reason(StrEnum):
    """The `reason` label of vramshare_webhook_decisions_total (errors use the exception's type)."""

    NOT_A_POD_CREATE = "not-a-pod-create"
    NO_GPU_REQUEST = "no-gpu-request"
    MALFORMED_POD = "malformed-pod"
    DEVICE_PLUGIN_RESOURCE = "device-plugin-resource"
    INVALID_ANNOTATION = "invalid-annotation"
    FITS = "fits"
    DRY_RUN = "dry-run"
    REINVOCATION = "reinvocation"
    NO_GPU_FITS = "no-gpu-fits"
    NO_GPU_FITS_NOW = "no-gpu-fits-now"
    INVALID_QUEUE_ANNOTATION = "invalid-queue-annotation"
    INVALID_REFUSAL_ANNOTATION = "invalid-refusal-annotation"
    INVALID_MODEL = "invalid-model"
    INVALID_GPU_COUNT = "invalid-gpu-count"
    INVALID_GUARDRAILS_ANNOTATION = "invalid-guardrails-annotation"
    CONTENTION = "contention"
    DEADLINE = "deadline"
    NAME_TAKEN = "name-taken"
    EPHEMERAL_CONTAINERS = "ephemeral-containers"
    PENDING_LIMIT = "pending-limit"
    INVALID_DELIVERY = "invalid-delivery"
    RUNTIME_CLASS_CONFLICT = "runtime-class-conflict"
    QUOTA = "quota"
    PENDING_MIB_LIMIT = "pending-mib-limit"
    MEMORY_RESOURCE_WITHOUT_REQUEST = "memory-resource-without-request"
    HELD_ELSEWHERE = "held-elsewhere"
    DEVICE_LIST_PATH = "device-list-path"
    SEES_EVERY_GPU = "sees-every-gpu"


@dataclass(frozen=True, kw_only=True)
class Skip:
    """Not vramshare's business: allowed unchanged."""

    reason: Reason


@dataclass(frozen=True, kw_only=True)
class Hide:
    """A pod without a GPU request, given NVIDIA_VISIBLE_DEVICES=void (and stripped of vramshare.io/*
    labels and annotations it set itself); or, for `Reason.EPHEMERAL_CONTAINERS`, the debug containers
    added to a running pod, pinned to its GPUs or hidden like the pod."""

    patch: list[Operation]
    reason: Reason = Reason.NO_GPU_REQUEST
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Invalid:
    """The pod's own input is wrong: a 400 naming the field, the value and what is accepted."""

    reason: Reason
    message: str


@dataclass(frozen=True, kw_only=True)
class Admit:
    placement: Placement
    patch: list[Operation]
    reason: Reason
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Queue:
    """No GPU has room now, but one could: the pod is admitted behind a scheduling gate and waits."""

    entry: str
    """The queue entry (GpuReservation) it waits as."""
    patch: list[Operation]
    message: str
    """Shown to the client as a warning (kubectl prints it)."""
    reason: Reason = Reason.NO_GPU_FITS_NOW
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Refuse:
    """No GPU has room now (decided on a consistent view)."""

    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    retry_after_s: int | None = None
    """With 429: when memory is expected to free (None: the configured Retry-After)."""
    reason: Reason = Reason.NO_GPU_FITS
    style: RefusalStyle | None = None
    """How the pod is refused (None: the settings' default)."""


@dataclass(frozen=True, kw_only=True)
class Contention:
    """Room may exist, but commits kept conflicting until the decision deadline."""

    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    style: RefusalStyle | None = None


@dataclass(frozen=True, kw_only=True)
class Late:
    """The answer's deadline passed; whatever was booked has been withdrawn."""

    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    style: RefusalStyle | None = None


@dataclass(frozen=True, kw_only=True)
class NameTaken:
    """A pod of that name exists: the create would fail with AlreadyExists, and booking for it would
    only hold memory until the booking expires."""

    message: str


@dataclass(frozen=True, kw_only=True)
class Errored:
    """vramshare could not decide (API server away, a bug); the failurePolicy decides what follows."""

    message: str
    error_type: str


Decision = Skip | Hide | Invalid | Admit | Queue | Refuse | Contention | Late | NameTaken | Errored


@dataclass(frozen=True, kw_only=True)
class Answer:
    review: rv.Review
    outcome: Outcome
    reason: str
    log_fields: Mapping[str, Any]


def answer(decision: Decision, *, uid: str, settings: WebhookSettings) -> Answer:
    """The AdmissionReview response and the metric labels for `decision`; a refusal is answered in
    its style (default: the settings' denial code)."""
    match decision:
        case Skip(reason=reason):
            return Answer(review=rv.allowed(uid), outcome=Outcome.SKIPPED, reason=reason, log_fields={})
        case Hide(patch=patch, reason=reason, warnings=warnings):
            return Answer(
                review=rv.patched(uid, patch, warnings=list(warnings) or None),
                outcome=Outcome.HIDDEN,
                reason=reason,
                log_fields={"warnings": list(warnings)} if warnings else {},
            )
        case Invalid(reason=reason, message=message):
            return Answer(
                review=rv.denied(uid, message, code=400, reason="BadRequest"),
                outcome=Outcome.INVALID,
                reason=reason,
                log_fields={"message": message},
            )
        case Admit(placement=p, patch=patch, reason=reason, details=details):
            fields = {**details, "gpu": p.gpu_uuid, "node": p.node, "reservation": p.reservation}
            return Answer(
                review=rv.patched(uid, patch), outcome=Outcome.ADMITTED, reason=reason, log_fields=fields
            )
        case Queue(entry=entry, patch=patch, message=message, reason=reason, details=details):
            return Answer(
                review=rv.patched(uid, patch, warnings=[message]),
                outcome=Outcome.QUEUED,
                reason=reason,
                log_fields={**details, "reservation": entry},
            )
        case (
            Refuse(message=message, details=details)
            | Contention(message=message, details=details)
            | Late(message=message, details=details)
        ):
            why = {Contention: Reason.CONTENTION, Late: Reason.DEADLINE}
            after = decision.retry_after_s if isinstance(decision, Refuse) else None
            return Answer(
                review=_deny(uid, message, settings, style=decision.style, retry_after_s=after),
                outcome=Outcome.REFUSED,
                reason=decision.reason if isinstance(decision, Refuse) else why[type(decision)],
                log_fields=details,
            )
        case NameTaken(message=message):
            return Answer(
                review=rv.denied(uid, message, code=409, reason="AlreadyExists"),
                outcome=Outcome.INVALID,
                reason=Reason.NAME_TAKEN,
                log_fields={"message": message},
            )
        case Errored(message=message, error_type=error_type):
            return Answer(
                review=rv.errored(uid, message), outcome=Outcome.ERROR, reason=error_type, log_fields={}
            )


def _deny(
    uid: str,
    message: str,
    settings: WebhookSettings,
    *,
    style: RefusalStyle | None,
    retry_after_s: int | None = None,
) -> rv.Review:
    if (style or settings.default_refusal) is RefusalStyle.RETRY_AFTER:
        return rv.denied(
            uid,
            message,
            code=429,
            reason="TooManyRequests",
            retry_after_s=retry_after_s or settings.retry_after_s,
        )
    # forbidden and requeue: a plain 403 with no Retry-After (the executor pauses all creation on one).
    return rv.denied(uid, message, code=403, reason="Forbidden")
