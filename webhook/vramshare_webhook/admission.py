"""The admission decision: request -> decode -> snapshot -> choose (pure) -> commit -> patch or refuse.

`Admitter.review()` never raises: whatever happens, the API server gets a well-formed answer carrying
the request UID.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from vramshare.domain import (
    AllocationRequest,
    Choice,
    InvalidRequestError,
    choose,
    parse_memory_request,
    refusal_message,
)
from vramshare.kube.ledger import CommitConflictError, Snapshot
from vramshare.kube.resources import reservation_object
from vramshare_webhook import review as rv
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.pod import (
    Placement,
    display_name,
    hide_gpus_patch,
    pinned_nodes,
    placement_of,
    placement_patch,
    pod_annotations,
    requested_device_resources,
    shape_problem,
    spoofed,
)
from vramshare_webhook.settings import WebhookSettings

log = structlog.get_logger("vramshare.webhook")


class Ledger(Protocol):
    async def snapshot(self, *, fresh: bool = False) -> Snapshot: ...
    async def get_reservation(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def commit(self, *, reservation: dict[str, Any], gpu_uuid: str, token: str) -> dict[str, Any]: ...


@dataclass(frozen=True, kw_only=True)
class Outcome:
    review: rv.Review
    outcome: str
    reason: str
    fields: dict[str, Any]


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
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.metrics = metrics
        self.clock = clock
        self._commit_lock = asyncio.Lock()

    async def review(self, request: rv.Request) -> rv.Review:
        started = time.perf_counter()
        try:
            result = await self._decide(request)
        except Exception as exc:  # an answer, never a crash: the failurePolicy decides what follows
            log.exception("admission failed", uid=request.uid, namespace=request.namespace)
            result = Outcome(
                review=rv.errored(request.uid, f"vramshare could not decide: {exc}"),
                outcome="error",
                reason=type(exc).__name__,
                fields={},
            )
        elapsed = time.perf_counter() - started
        self.metrics.decisions.labels(result.outcome, result.reason).inc()
        self.metrics.decision_seconds.observe(elapsed)
        if result.outcome != "skipped":
            log.info(
                "decision",
                uid=request.uid,
                pod=f"{request.namespace}/{display_name(request.object)}",
                outcome=result.outcome,
                reason=result.reason,
                duration_ms=round(elapsed * 1000, 2),
                dry_run=request.dry_run,
                **result.fields,
            )
        return result.review

    async def _decide(self, request: rv.Request) -> Outcome:
        pod = request.object
        if request.kind != "Pod" or request.operation != "CREATE":
            return Outcome(
                review=rv.allowed(request.uid), outcome="skipped", reason="not-a-pod-create", fields={}
            )
        problem = shape_problem(pod)
        if problem is not None:
            return self._invalid(request, f"not a valid pod: {problem}", reason="malformed-pod")
        value = pod_annotations(pod).get(self.settings.annotation)
        if value is None:
            if self.settings.hide_gpus and not requested_device_resources(pod):
                return Outcome(
                    review=rv.patched(request.uid, hide_gpus_patch(pod)),
                    outcome="hidden",
                    reason="no-gpu-request",
                    fields={},
                )
            return Outcome(
                review=rv.allowed(request.uid), outcome="skipped", reason="no-gpu-request", fields={}
            )
        devices = requested_device_resources(pod)
        if devices:
            message = (
                f"pod requests {', '.join(devices)} and also carries annotation "
                f'"{self.settings.annotation}": '
                "use one or the other (vramshare shares GPUs by memory without the device plugin)"
            )
            return self._invalid(request, message, reason="device-plugin-resource")
        try:
            mib = parse_memory_request(
                value, annotation=self.settings.annotation, max_mib=self.settings.max_request_mib
            )
        except InvalidRequestError as exc:
            return self._invalid(request, str(exc), reason="invalid-annotation")
        fields: dict[str, Any] = {"mib": mib}
        tampered = spoofed(pod)
        if tampered:
            fields["overwritten"] = tampered
            reused = await self._reinvocation(request)
            if reused is not None:
                return Outcome(
                    review=rv.patched(request.uid, placement_patch(pod, reused)),
                    outcome="admitted",
                    reason="reinvocation",
                    fields={**fields, "gpu": reused.gpu_uuid, "reservation": reused.reservation},
                )
        return await self._allocate(request, mib=mib, fields=fields)

    def _invalid(self, request: rv.Request, message: str, *, reason: str) -> Outcome:
        return Outcome(
            review=rv.denied(request.uid, message, code=400, reason="BadRequest"),
            outcome="invalid",
            reason=reason,
            fields={"message": message},
        )

    async def _reinvocation(self, request: rv.Request) -> Placement | None:
        """The placement of an earlier pass of this same request, if the pod carries a genuine one."""
        placement = placement_of(request.object)
        if placement is None:
            return None
        existing = await self.ledger.get_reservation(request.namespace, placement.reservation)
        if existing is None or existing.get("spec", {}).get("admissionUID") != request.uid:
            return None  # set by the user, or another request's: not honoured
        return placement

    async def _allocate(self, request: rv.Request, *, mib: int, fields: dict[str, Any]) -> Outcome:
        pod = request.object
        alloc = AllocationRequest(
            mib=mib, namespace=request.namespace, pod=display_name(pod), nodes=pinned_nodes(pod)
        )
        deadline = time.monotonic() + self.settings.decision_deadline_s
        attempt = 0
        while True:
            attempt += 1
            # One decision at a time per process: replicas still race (the commit's precondition settles
            # that), but requests of one process no longer conflict with each other.
            try:
                await asyncio.wait_for(self._commit_lock.acquire(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return self._contention(request, mib=mib, fields={**fields, "attempts": attempt})
            try:
                outcome = await self._attempt(
                    request, alloc=alloc, mib=mib, fields={**fields, "attempts": attempt}
                )
            finally:
                self._commit_lock.release()
            if outcome is not None:
                return outcome
            self.metrics.conflicts.inc()
            if time.monotonic() >= deadline:
                return self._contention(request, mib=mib, fields={**fields, "attempts": attempt})
            await asyncio.sleep(min(0.2, 0.005 * 2**attempt) * (0.5 + secrets.randbelow(100) / 100))

    async def _attempt(
        self, request: rv.Request, *, alloc: AllocationRequest, mib: int, fields: dict[str, Any]
    ) -> Outcome | None:
        """Decide on a fresh snapshot and commit; None when the chosen GPU's ledger moved meanwhile."""
        pod = request.object
        snapshot = await self.ledger.snapshot()
        decision = choose(
            alloc, snapshot.gpus, snapshot.reservations, settings=self.settings.allocation, now=self.clock()
        )
        if not isinstance(decision, Choice):  # refuse only on a consistent view
            snapshot = await self.ledger.snapshot(fresh=True)
            decision = choose(
                alloc,
                snapshot.gpus,
                snapshot.reservations,
                settings=self.settings.allocation,
                now=self.clock(),
            )
        if not isinstance(decision, Choice):
            message = refusal_message(
                decision, max_sample_age_s=self.settings.max_sample_age_s, retry_hint=self.settings.retry_hint
            )
            return Outcome(
                review=self._deny(request, message),
                outcome="refused",
                reason="no-gpu-fits",
                fields={**fields, "best_headroom_mib": decision.best_headroom_mib},
            )
        gpu = decision.gpu
        name = reservation_name(pod)
        placement = Placement(reservation=name, gpu_uuid=gpu.uuid, gpu_index=gpu.index, node=gpu.node)
        result = {
            **fields,
            "gpu": gpu.uuid,
            "node": gpu.node,
            "reservation": name,
            "headroom_mib": decision.headroom.headroom_mib,
        }
        patch = rv.patched(request.uid, placement_patch(pod, placement))
        if request.dry_run:
            return Outcome(review=patch, outcome="admitted", reason="dry-run", fields=result)
        obj = reservation_object(
            name=name,
            namespace=request.namespace,
            pod=display_name(pod),
            mib=mib,
            gpu=gpu,
            admission_uid=request.uid,
        )
        try:
            await self.ledger.commit(reservation=obj, gpu_uuid=gpu.uuid, token=snapshot.tokens[gpu.uuid])
        except CommitConflictError:
            return None
        return Outcome(review=patch, outcome="admitted", reason="fits", fields=result)

    def _contention(self, request: rv.Request, *, mib: int, fields: dict[str, Any]) -> Outcome:
        message = (
            f"could not reserve {mib} MiB for pod {request.namespace}/{display_name(request.object)} "
            f"within {self.settings.decision_deadline_s:g} s: too many concurrent admissions "
            f"on the same GPUs. {self.settings.retry_hint}"
        )
        return Outcome(
            review=self._deny(request, message), outcome="refused", reason="contention", fields=fields
        )

    def _deny(self, request: rv.Request, message: str) -> rv.Review:
        code = self.settings.denial_code
        return rv.denied(
            request.uid,
            message,
            code=code,
            reason="TooManyRequests" if code == 429 else "Forbidden",
            retry_after_s=self.settings.retry_after_s if code == 429 else None,
        )
