"""Step 1, triage: what kind of request this is. Not a pod create (skip), a malformed pod (invalid), a
pod that asks for no GPU (hidden from the GPUs, or skipped), debug containers (`DebugAsk`, see
`admission.debug`), or a pod that asks for GPU memory, which goes on down the admission path as a
`GpuAsk`."""

from __future__ import annotations

from dataclasses import dataclass

from vramshare_webhook import review as rv
from vramshare_webhook.decision import Hide, Invalid, Reason, Skip
from vramshare_webhook.delivery_modes import foreign_gpu_requests
from vramshare_webhook.memory_resource import containers_requesting
from vramshare_webhook.pod import PodFacts, claimed_marks, pod_annotations, read_pod, shape_problem
from vramshare_webhook.pod_patch import hide_gpus_patch, strip_patch
from vramshare_webhook.settings import WebhookSettings


@dataclass(frozen=True, kw_only=True)
class DebugAsk:
    """Debug containers added to a running pod: they get its GPUs or none (`admission.debug`)."""

    request: rv.Request


@dataclass(frozen=True, kw_only=True)
class GpuAsk:
    """A pod create that carries the memory annotation, read once."""

    request: rv.Request
    facts: PodFacts
    memory_request: str
    """The annotation's raw value (parsed by the next step)."""


def triage(request: rv.Request, *, settings: WebhookSettings) -> Skip | Hide | Invalid | DebugAsk | GpuAsk:
    pod = request.object
    debug = request.operation == "UPDATE" and request.sub_resource == "ephemeralcontainers"
    if request.kind != "Pod" or (request.operation != "CREATE" and not debug):
        return Skip(reason=Reason.NOT_A_POD_CREATE)
    problem = shape_problem(pod)
    if problem is not None:
        return Invalid(reason=Reason.MALFORMED_POD, message=f"not a valid pod: {problem}")
    if debug:  # kubectl debug: the new containers see the pod's GPUs, or none
        return DebugAsk(request=request)
    facts = read_pod(
        pod,
        annotation=settings.annotation,
        queue_annotation=settings.queue_annotation,
        namespace=request.namespace,
    )
    if facts.memory_request is None:
        return _without_gpu(request, facts, settings=settings)
    return GpuAsk(request=request, facts=facts, memory_request=facts.memory_request)


def _without_gpu(request: rv.Request, facts: PodFacts, *, settings: WebhookSettings) -> Skip | Hide | Invalid:
    """A pod that asks for no GPU memory: it sees no GPU (where vramshare hides them) and carries none
    of vramshare's marks."""
    pod = request.object
    resource = settings.memory_resource
    requesting = containers_requesting(pod, resource) if resource else []
    if requesting:
        return Invalid(
            reason=Reason.MEMORY_RESOURCE_WITHOUT_REQUEST,
            message=f"{', '.join(requesting)} request resource {resource}: only vramshare sets it, "
            f'on pods it admits (those with annotation "{settings.annotation}"); remove it and '
            f'ask for GPU memory with the annotation "{settings.annotation}"',
        )
    # Only pods vramshare admits carry vramshare.io/* keys: others lose them, with a warning.
    marks = claimed_marks(pod)
    warnings: tuple[str, ...] = (
        (
            f"vramshare removed {', '.join(marks)}: only vramshare sets vramshare.io/* labels and "
            f'annotations, on pods it admits (those with annotation "{settings.annotation}")',
        )
        if marks
        else ()
    )
    if settings.hide_gpus and not facts.device_resources:
        requests = foreign_gpu_requests(pod_annotations(pod))
        if requests:
            warnings += (
                f"vramshare removed {', '.join(f'annotation {r}' for r in requests)}: GPUs in this "
                f'namespace are booked with the annotation "{settings.annotation}"',
            )
        return Hide(patch=hide_gpus_patch(pod), warnings=warnings)
    if marks:
        return Hide(patch=strip_patch(pod), warnings=warnings)
    return Skip(reason=Reason.NO_GPU_REQUEST)
