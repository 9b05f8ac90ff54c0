"""The admission handler: one AdmissionReview in, one answer out, never a crash.

`Admitter.decide()` is the admission path, step by step, each step a module of this package and each
result a value:

    request -> triage -> intent -> earlier pass? -> name taken? -> place -> outcome (one patch)

and, for debug containers (`pods/ephemeralcontainers`), request -> triage -> debug.

`Admitter.review()` bounds it by the decision deadline, turns any failure into an answer, and records
the metrics and the log line: whatever happens, the API server gets a well-formed answer carrying the
request UID.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from vramshare.domain.tenancy import RefusalMemory
from vramshare_webhook import review as rv
from vramshare_webhook.admission.context import ClusterView, Context, Ledger
from vramshare_webhook.admission.debug import debug_containers
from vramshare_webhook.admission.earlier import earlier_pass
from vramshare_webhook.admission.intent import Intent, refusal_style, resolve_intent
from vramshare_webhook.admission.naming import name_taken
from vramshare_webhook.admission.outcome import readmitted, with_delivery
from vramshare_webhook.admission.place import place
from vramshare_webhook.admission.queueing import queued
from vramshare_webhook.admission.triage import DebugAsk, GpuAsk, triage
from vramshare_webhook.decision import Decision, Errored, Late, Outcome, answer
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.pod import display_name
from vramshare_webhook.settings import RefusalStyle, WebhookSettings

log = structlog.get_logger("vramshare.webhook")


class Admitter:
    def __init__(
        self,
        *,
        settings: WebhookSettings,
        ledger: Ledger,
        metrics: WebhookMetrics,
        cluster: ClusterView | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ctx = Context(
            settings=settings,
            ledger=ledger,
            metrics=metrics,
            cluster=cluster or ClusterView(),
            clock=clock,
            refused_tasks=RefusalMemory(window_s=settings.hold_limit_s),
        )

    @property
    def settings(self) -> WebhookSettings:
        return self.ctx.settings

    @property
    def metrics(self) -> WebhookMetrics:
        return self.ctx.metrics

    async def review(self, request: rv.Request) -> rv.Review:
        started = time.perf_counter()
        deadline = self.settings.decision_deadline_s
        try:
            # The whole answer is bounded: an admission the API server has given up on must not go on
            # to book memory. A cancelled commit withdraws its booking (see KubeLedger.commit).
            async with asyncio.timeout(deadline):
                decision = await self.decide(request)
        except TimeoutError:
            log.warning("admission missed its deadline", uid=request.uid, deadline_s=deadline)
            decision = self._late(request)
        except Exception as exc:  # an answer, never a crash: the failurePolicy decides what follows
            log.exception("admission failed", uid=request.uid, namespace=request.namespace)
            decision = Errored(message=f"vramshare could not decide: {exc}", error_type=type(exc).__name__)
        result = answer(decision, uid=request.uid, settings=self.settings)
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
        """The admission path (see the module docstring)."""
        ctx = self.ctx
        ask = triage(request, settings=ctx.settings)
        if isinstance(ask, DebugAsk):
            return await debug_containers(ask.request, ctx=ctx)
        if not isinstance(ask, GpuAsk):
            return ask
        intent = resolve_intent(
            ask, settings=ctx.settings, namespace_labels=ctx.cluster.namespace_labels(request.namespace)
        )
        if not isinstance(intent, Intent):
            return intent
        return with_delivery(await self._placed(intent), intent, settings=ctx.settings)

    async def _placed(self, intent: Intent) -> Decision:
        """Where the pod goes: where an earlier pass put it, or a GPU chosen now (or a wait, or none)."""
        ctx = self.ctx
        earlier = await earlier_pass(intent, ctx=ctx)
        if earlier.not_honoured is not None:
            intent = intent.noting(placement_not_honoured=earlier.not_honoured)
        if earlier.placement is not None:
            return await readmitted(intent, earlier.placement, ctx=ctx)
        if earlier.entry is not None:
            return queued(intent, entry=earlier.entry)
        taken = await name_taken(intent, ctx=ctx)
        if taken is not None:
            return taken
        return await place(intent, ctx=ctx)

    def _late(self, request: rv.Request) -> Late:
        """The answer for a decision that missed its deadline (nothing it booked stays booked)."""
        ctx = self.ctx
        style = refusal_style(
            request, settings=ctx.settings, namespace_labels=ctx.cluster.namespace_labels(request.namespace)
        )
        known = style if isinstance(style, RefusalStyle) else None
        return Late(
            message=(
                f"vramshare could not decide within {ctx.settings.decision_deadline_s:g} s (the API server "
                f"is slow or the GPUs are contended); nothing was reserved. {ctx.hint(known)}"
            ),
            style=known,
        )


def _logged_name(pod: dict[str, object]) -> str:
    """The pod's name for a log line, even from a malformed pod."""
    meta = pod.get("metadata")
    return display_name(pod) if isinstance(meta, dict) else "?"
