"""The pure domain of vramshare: models, headroom arithmetic, allocation policy, reservation lifecycle.

Nothing in this package performs I/O, reads a clock or imports kopf, aiohttp, kubernetes or structlog;
an import-linter contract in pyproject.toml keeps it that way.
"""

from vramshare.domain.accounting import Accounting, StaleGpuMode
from vramshare.domain.allocation import (
    AllocationSettings,
    Choice,
    Exclusion,
    GpuVerdict,
    Policy,
    Refusal,
    choose,
    has_room_for_its_bookings,
)
from vramshare.domain.bookings import LedgerIndex
from vramshare.domain.fairness import (
    FairnessSettings,
    ReleaseLog,
    closest_to_fitting,
    could_ever_fit,
    gpu_to_hold,
    missing_mib,
    retry_after_s,
)
from vramshare.domain.headroom import Headroom, headroom, is_unseen
from vramshare.domain.lifecycle import (
    PodSighting,
    PodState,
    Transition,
    due_for_cleanup,
    genuine_pod,
    next_phase,
    with_its_pod,
)
from vramshare.domain.messages import describe_verdict, refusal_message
from vramshare.domain.models import AllocationRequest, Gpu, Reservation, ReservationPhase, model_matches
from vramshare.domain.queue import Hold, QueuePlan, QueueSettings, Waiting, plan_queue
from vramshare.domain.request import (
    COUNT_ANNOTATION,
    DEFAULT_ANNOTATION,
    DEFAULT_MAX_GPUS,
    DEFAULT_MAX_MIB,
    InvalidCountError,
    InvalidRequestError,
    parse_gpu_count,
    parse_memory_request,
)

__all__ = [
    "COUNT_ANNOTATION",
    "DEFAULT_ANNOTATION",
    "DEFAULT_MAX_GPUS",
    "DEFAULT_MAX_MIB",
    "Accounting",
    "AllocationRequest",
    "AllocationSettings",
    "Choice",
    "Exclusion",
    "FairnessSettings",
    "Gpu",
    "GpuVerdict",
    "Headroom",
    "Hold",
    "InvalidCountError",
    "InvalidRequestError",
    "LedgerIndex",
    "PodSighting",
    "PodState",
    "Policy",
    "QueuePlan",
    "QueueSettings",
    "Refusal",
    "ReleaseLog",
    "Reservation",
    "ReservationPhase",
    "StaleGpuMode",
    "Transition",
    "Waiting",
    "choose",
    "closest_to_fitting",
    "could_ever_fit",
    "describe_verdict",
    "due_for_cleanup",
    "genuine_pod",
    "gpu_to_hold",
    "has_room_for_its_bookings",
    "headroom",
    "is_unseen",
    "missing_mib",
    "model_matches",
    "next_phase",
    "parse_gpu_count",
    "parse_memory_request",
    "plan_queue",
    "refusal_message",
    "retry_after_s",
    "with_its_pod",
]
