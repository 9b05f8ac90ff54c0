"""The aiohttp applications: /mutate, /healthz, /readyz and /metrics; /metrics alone on a port of its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vramshare_webhook import review as rv
from vramshare_webhook.admission import Admitter
from vramshare_webhook.callers import caller_problem

log = structlog.get_logger("vramshare.webhook")


def create_app(
    *,
    admitter: Admitter,
    ready: Callable[[], bool],
    draining: Callable[[], bool] = lambda: False,
    callers: Iterable[str] | None = None,
) -> web.Application:
    """The webhook's HTTP surface. While `draining` (after SIGTERM) it is not ready and closes each
    connection after its answer, so clients open new ones to the replicas that stay. With `callers`
    (client authentication on: the names accepted, empty for any the CA signed), /mutate answers only a
    caller with a verified client certificate (see vramshare_webhook.callers)."""
    app = web.Application(client_max_size=rv.MAX_BODY_BYTES + 1024)
    accepted = frozenset(callers) if callers is not None else None

    async def mutate(request: web.Request) -> web.Response:
        if accepted is not None:
            peer = request.transport.get_extra_info("peercert") if request.transport is not None else None
            problem = caller_problem(peer, accepted=accepted)
            if problem is not None:
                admitter.metrics.decisions.labels("forbidden", "unauthenticated-caller").inc()
                log.warning("admission review from an unauthenticated caller refused", remote=request.remote)
                return web.json_response({"error": problem}, status=403)
        body = b""
        try:
            if request.content_length is not None and request.content_length > rv.MAX_BODY_BYTES:
                raise rv.BadRequestError(f"body of {request.content_length} bytes exceeds the limit")
            body = await request.read()
            decoded = rv.decode(body, content_type=request.headers.get("Content-Type", ""))
        except rv.BadRequestError as exc:
            admitter.metrics.decisions.labels("bad-request", "undecodable").inc()
            return web.json_response({"error": str(exc)}, status=400)
        except web.HTTPRequestEntityTooLarge:
            admitter.metrics.decisions.labels("bad-request", "too-large").inc()
            return web.json_response({"error": "body exceeds the 7 MiB limit"}, status=400)
        response = web.json_response(await admitter.review(decoded))
        if draining():
            response.force_close()
        return response

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        if draining():
            return web.Response(text="shutting down", status=503)
        return web.Response(text="ok") if ready() else web.Response(text="not ready", status=503)

    app.router.add_post("/mutate", mutate)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_of(admitter))
    return app


def create_metrics_app(*, admitter: Admitter) -> web.Application:
    """/metrics alone, for a port of its own (settings.metrics_port): what Prometheus may reach."""
    app = web.Application()
    app.router.add_get("/metrics", metrics_of(admitter))
    return app


def metrics_of(admitter: Admitter) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(admitter.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    return metrics
