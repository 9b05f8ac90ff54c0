"""Other admission parts that real GPU clusters run next to vramshare, for the test cluster.

- `label` and `sidecar`: small but real mutating webhooks over TLS, as Kyverno mutations and sidecar
  injectors are. Registered after vramshare, they make the API server reinvoke vramshare.
- `null`: a TLS webhook that allows at once, the benchmark's measure of what a webhook call costs.
- The benchmark's floors (one durable write per pod, watched) are in `vramshare_e2e.floor_webhook`.
- `delay-proxy`: a TCP proxy in front of a webhook that holds its answers back, so the API server gives
  up on the call while the webhook goes on (what a slow network or an overloaded node does).
- `auth-proxy`: an HTTPS reverse proxy in front of Prometheus that wants a bearer token and a tenant
  header, as a Thanos, Mimir or managed-Prometheus gateway does.
- `endpoints`: a TCP balancer in front of webhook replicas that sends each new connection to a replica
  whose /readyz answers 200, as a Service does through its endpoints (which drop a pod that is not
  ready or is terminating): the local control plane has no kube-proxy.

Run one with `python -m vramshare_e2e.admission_parts MODE ...`; `start_*` below do it on a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import ClientSession, web

from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import POD_CREATE_RULES
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import Component, http_ok

INJECTED_LABEL = "e2e.vramshare.io/injected"
SIDECAR = "e2e-proxy"


def mutation(mode: str, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON Patch each fake webhook applies (nothing when it has already applied it)."""
    if mode == "null":  # allows at once: what a webhook call costs by itself
        return []
    if mode == "label":
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(INJECTED_LABEL) == "yes":
            return []
        return [{"op": "add", "path": "/metadata/labels", "value": {**labels, INJECTED_LABEL: "yes"}}]
    containers = (pod.get("spec") or {}).get("containers") or []
    if any(c.get("name") == SIDECAR for c in containers):
        return []
    sidecar = {"name": SIDECAR, "image": "example.invalid/proxy:1", "env": [{"name": "PROXY", "value": "on"}]}
    return [{"op": "add", "path": "/spec/containers/-", "value": sidecar}]


def webhook_app(mode: str) -> web.Application:
    async def mutate(request: web.Request) -> web.Response:
        review = await request.json()
        req = review["request"]
        response: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        patch = mutation(mode, req.get("object") or {})
        if patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
        return web.json_response(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/mutate", mutate)
    app.router.add_get("/healthz", healthz)
    return app


async def delay_proxy(*, listen: int, target: int, delay_s: float) -> None:
    """Forward TCP to 127.0.0.1:`target`, holding the answer back by `delay_s`.

    The TLS handshake passes at once (else the request would never reach the webhook); what the server
    sends after the client's second flight (its Finished and the request) is held back."""

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        flights = 0

        async def upstream() -> None:
            nonlocal flights
            try:
                while data := await client_reader.read(65536):
                    flights += 1
                    server_writer.write(data)
                    await server_writer.drain()
            except ConnectionError:
                pass
            finally:
                server_writer.close()

        async def downstream() -> None:
            held = False
            try:
                while data := await server_reader.read(65536):
                    if flights >= 2 and not held:
                        held = True
                        await asyncio.sleep(delay_s)
                    client_writer.write(data)
                    await client_writer.drain()
            except ConnectionError:
                pass
            finally:
                client_writer.close()

        await asyncio.gather(upstream(), downstream())

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


async def endpoints_balancer(*, listen: int, backends: list[int], interval_s: float = 0.2) -> None:
    """Forward each new TCP connection to the next ready backend (round robin); a backend is ready
    while its /readyz answers 200. Connections already open stay where they are, as with kube-proxy."""
    ready: list[int] = []
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    turn = 0

    async def probe() -> None:
        nonlocal ready
        while True:
            now_ready = []
            for port in backends:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", port, ssl=context), 1.0
                    )
                    writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    status = await asyncio.wait_for(reader.readline(), 1.0)
                    writer.close()
                    if b" 200 " in status:
                        now_ready.append(port)
                except (OSError, TimeoutError, ssl.SSLError):
                    pass
            if now_ready != ready:
                print(f"ready backends: {now_ready}", flush=True)
            ready = now_ready
            await asyncio.sleep(interval_s)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        nonlocal turn
        if not ready:
            client_writer.close()
            return
        turn += 1
        port = ready[turn % len(ready)]
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    prober = asyncio.create_task(probe())
    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()
    prober.cancel()


def auth_proxy_app(*, target: str, token: str, header: str) -> web.Application:
    """Forwards GETs to `target` only with `Authorization: Bearer <token>` and the `header` (name: value)
    present; 401 otherwise. Counts what it let through at /stats."""
    name, _, value = header.partition(":")
    stats = {"allowed": 0, "refused": 0}

    async def forward(request: web.Request) -> web.Response:
        if request.path == "/stats":
            return web.json_response(stats)
        ok = request.headers.get("Authorization") == f"Bearer {token}"
        ok = ok and request.headers.get(name.strip()) == value.strip()
        if not ok:
            stats["refused"] += 1
            return web.Response(status=401, text="unauthorized")
        stats["allowed"] += 1
        async with ClientSession() as session, session.get(target + request.path_qs) as upstream:
            body = await upstream.read()
            return web.Response(status=upstream.status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vramshare_e2e.admission_parts")
    parser.add_argument(
        "mode", choices=["label", "sidecar", "null", "delay-proxy", "endpoints", "auth-proxy"]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert")
    parser.add_argument("--key")
    parser.add_argument("--target", type=int, help="delay-proxy: the port to forward to")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--backends", help="endpoints: the replicas' ports, comma-separated")
    parser.add_argument("--upstream", help="auth-proxy: the Prometheus URL")
    parser.add_argument("--token", help="auth-proxy: the bearer token it wants")
    parser.add_argument("--header", help="auth-proxy: the header it wants, as 'Name: value'")
    args = parser.parse_args(argv)
    if args.mode == "auth-proxy":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.cert, args.key)
        app = auth_proxy_app(target=args.upstream, token=args.token, header=args.header)
        web.run_app(app, host="127.0.0.1", port=args.port, ssl_context=context, print=None)
        return
    if args.mode == "endpoints":
        backends = [int(p) for p in args.backends.split(",")]
        asyncio.run(endpoints_balancer(listen=args.port, backends=backends))
        return
    if args.mode == "delay-proxy":
        asyncio.run(delay_proxy(listen=args.port, target=args.target, delay_s=args.delay_s))
        return
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.cert, args.key)
    web.run_app(webhook_app(args.mode), host="127.0.0.1", port=args.port, ssl_context=context, print=None)


def start_part(
    cluster: LocalCluster,
    *,
    name: str,
    args: list[str],
    ready: Callable[[], bool],
    module: str = "vramshare_e2e.admission_parts",
) -> None:
    """Run `python -m <module> <args>` as the cluster's component `name`."""
    cluster.add_component(
        Component(
            name=name,
            argv=[sys.executable, "-m", module, *args],
            log_path=cluster.logs_dir / f"{name}.log",
            ready=ready,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    )


def start_mutating_webhook(cluster: LocalCluster, *, mode: str) -> int:
    """Start the `label`, `sidecar` or `null` webhook and register it after vramshare (for namespaces
    labelled `e2e.vramshare.io/<mode>=on`); returns its port."""
    port = free_port()
    pair = cluster.ca.issue(f"e2e-{mode}", common_name=f"e2e-{mode}", server_ips=("127.0.0.1",))
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    start_part(
        cluster,
        name=f"e2e-{mode}-webhook",
        args=[mode, f"--port={port}", f"--cert={pair.cert_path}", f"--key={pair.key_path}"],
        ready=lambda: http_ok(f"https://127.0.0.1:{port}/healthz", context=ctx),
    )
    # Mutating webhooks run in the order of their configurations' names: "zz-" comes after vramshare's.
    cluster.apply_objects(
        [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": f"zz-e2e-{mode}"},
                "webhooks": [
                    {
                        "name": f"{mode}.e2e.vramshare.io",
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Fail",
                        "reinvocationPolicy": "Never",
                        "timeoutSeconds": 5,
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{port}/mutate",
                            "caBundle": base64.b64encode(cluster.ca.cert_pem).decode(),
                        },
                        "rules": POD_CREATE_RULES,
                        "namespaceSelector": {"matchLabels": {f"e2e.vramshare.io/{mode}": "on"}},
                    }
                ],
            }
        ]
    )
    return port


def start_delay_proxy(cluster: LocalCluster, *, name: str, target: int, delay_s: float) -> int:
    """A proxy to the webhook on `target` that holds its answers back by `delay_s`; returns its port."""
    port = free_port()
    start_part(
        cluster,
        name=name,
        args=["delay-proxy", f"--port={port}", f"--target={target}", f"--delay-s={delay_s}"],
        ready=lambda: _listening(port),
    )
    return port


def start_auth_proxy(cluster: LocalCluster, *, token: str, header: str) -> int:
    """An HTTPS gateway to the cluster's Prometheus that wants `token` and `header` (see
    `auth_proxy_app`), with a certificate from the cluster's CA; returns its port."""
    port = free_port()
    pair = cluster.ca.issue("auth-proxy", common_name="auth-proxy", server_ips=("127.0.0.1",))
    start_part(
        cluster,
        name="e2e-auth-proxy",
        args=[
            "auth-proxy",
            f"--port={port}",
            f"--cert={pair.cert_path}",
            f"--key={pair.key_path}",
            f"--upstream={cluster.prometheus_url}",
            f"--token={token}",
            f"--header={header}",
        ],
        ready=lambda: _listening(port),
    )
    return port


def start_endpoints(cluster: LocalCluster, *, backends: list[int]) -> int:
    """A Service's worth of load balancing over the webhook replicas on `backends` (see
    `endpoints_balancer`); returns the port to put in the webhook configuration."""
    port = free_port()
    start_part(
        cluster,
        name="e2e-endpoints",
        args=["endpoints", f"--port={port}", f"--backends={','.join(map(str, backends))}"],
        ready=lambda: _listening(port),
    )
    return port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    main()
