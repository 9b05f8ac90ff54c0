"""`vramshare-webhook`: run the admission webhook (settings from VRAMSHARE_* environment variables)."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from vramshare import logs
from vramshare.domain import has_room_for_its_bookings
from vramshare.domain.scheduling import NodeView
from vramshare.kube.client import Connection, KubeClient
from vramshare.kube.lease_watch import HeartbeatSource, LeaseHeartbeat
from vramshare.kube.ledger import KubeLedger
from vramshare.kube.ledger.grants import Grants
from vramshare.kube.pods import node_view
from vramshare.kube.replicas import ReplicaEndpoints, ReplicaLeases
from vramshare.kube.watch import WatchCache
from vramshare.settings import SettingsError
from vramshare_webhook.admission import Admitter, ClusterView
from vramshare_webhook.app import create_app, create_metrics_app
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.settings import TlsMode, WebhookSettings
from vramshare_webhook.tls import ReloadingTls, SecretTls

log = structlog.get_logger("vramshare.webhook")


async def _certificates(settings: WebhookSettings, kube: KubeClient) -> tuple[ReloadingTls, SecretTls | None]:
    """The serving certificate per the TLS mode; in the Secret modes, keep trying until it is there."""
    client_ca = Path(settings.client_ca_file) if settings.client_ca_file else None
    if settings.tls_mode is TlsMode.FILES:
        return ReloadingTls(
            cert_file=Path(settings.tls_cert_file),
            key_file=Path(settings.tls_key_file),
            client_ca_file=client_ca,
        ), None
    secret = SecretTls(
        kube=kube,
        namespace=settings.namespace,
        secret=settings.tls_secret,
        directory=Path(tempfile.mkdtemp(prefix="vramshare-tls-")),
        manage=settings.tls_mode is TlsMode.SELF_MANAGED,
        names=settings.tls_name_list,
        webhook_configuration=settings.webhook_configuration,
        serving_validity=dt.timedelta(seconds=settings.tls_serving_validity_s),
        ca_validity=dt.timedelta(seconds=settings.tls_ca_validity_s),
    )
    while True:
        try:
            await secret.sync()
            return ReloadingTls(
                cert_file=secret.cert_file, key_file=secret.key_file, client_ca_file=client_ca
            ), secret
        except Exception as exc:  # e.g. RBAC not there yet, or the webhook configuration not applied
            log.warning("waiting for the serving certificate", mode=settings.tls_mode.value, error=str(exc))
            await asyncio.sleep(2)


async def serve(settings: WebhookSettings) -> None:
    connection = Connection.load(kubeconfig=settings.kubeconfig or None)
    async with KubeClient(connection, user_agent="vramshare-webhook") as kube:
        metrics = WebhookMetrics()
        lease_namespace, lease_name = settings.lease_ref
        heartbeat = LeaseHeartbeat(kube, namespace=lease_namespace, name=lease_name)
        ledger = KubeLedger(
            kube,
            on_write=lambda resource, verb: metrics.api_writes.labels(resource, verb).inc(),
            on_consistent_read=metrics.consistent_reads.inc,
            has_room=lambda gpu, index: has_room_for_its_bookings(
                gpu, index, accounting=settings.accounting, now=time.time()
            ),
            on_rebase=metrics.rebased_commits.inc,
            heartbeat=HeartbeatSource(heartbeat.latest),
            # GPU pods (those carrying vramshare's label): a booking whose pod appeared is not pending,
            # and counts from its pod's start, before the controller writes either.
            watch_pods=True,
        )
        if settings.grants.enabled:
            ledger.grants = Grants(
                kube,
                terms=settings.grants,
                namespace=settings.namespace,
                holder=settings.identity,
                index=lambda: ledger.index,
                clock=ledger.clock,
                on_write=ledger.on_write,
            )
            ledger.on_inside_grant = metrics.grant_bookings.inc
            grants = ledger.grants
            metrics.grants_held.set_function(lambda: len(grants.held()))
        gpu_pods = ledger.pods
        assert gpu_pods is not None
        tls, secret = await _certificates(settings, kube)
        # Namespaces choose queue mode and guardrails by label.
        namespaces: WatchCache[dict[str, str]] = WatchCache(
            kube,
            "/api/v1/namespaces",
            decode=lambda o: dict(o["metadata"].get("labels") or {}),
            name="namespaces",
        )

        async def announce_sync() -> None:
            await ledger.devices.synced.wait()
            await ledger.reservations.synced.wait()
            log.info("synced", gpus=len(ledger.devices.items), reservations=len(ledger.reservations.items))

        def ready() -> bool:
            # Ready once the watch caches hold the inventory and the live ledger.
            synced = ledger.synced and all(
                c.synced.is_set() for c in (namespaces, nodes, quotas, gpu_pods, heartbeat.cache)
            )
            return synced and (secret is None or not secret.manage or secret.injected)

        # ResourceQuotas: a namespace's GPU-memory quota (only those on the memory resource are kept).
        quota_key = f"requests.{settings.memory_resource}"
        quotas: WatchCache[dict[str, Any]] = WatchCache(
            kube,
            "/api/v1/resourcequotas",
            decode=lambda o: o if quota_key in ((o.get("spec") or {}).get("hard") or {}) else {},
            name="resourcequotas",
        )

        def quotas_of(namespace: str) -> list[dict[str, Any]]:
            prefix = f"{namespace}/"
            return [q for k, q in quotas.items.items() if q and k.startswith(prefix)]

        # Nodes: a GPU on a node the pod could never be scheduled onto is passed over.
        nodes: WatchCache[NodeView] = WatchCache(kube, "/api/v1/nodes", decode=node_view, name="nodes")
        # Its peers, so that GPUs that tie are dealt out among the replicas up: the pods ready behind
        # its Service (read-only), or each replica's own Lease (for replicas outside the cluster).
        replicas: ReplicaEndpoints | ReplicaLeases | None = None
        if settings.replica_service:
            replicas = ReplicaEndpoints(
                kube,
                namespace=settings.namespace,
                service=settings.replica_service,
                on_up=metrics.replicas_up.set,
            )
        elif settings.replica_lease_s:
            replicas = ReplicaLeases(
                kube,
                namespace=settings.namespace,
                identity=settings.identity,
                lease_s=settings.replica_lease_s,
                on_up=metrics.replicas_up.set,
            )
        admitter = Admitter(
            settings=settings,
            ledger=ledger,
            metrics=metrics,
            cluster=ClusterView(
                server_clock=kube.server_clock.now,
                namespace_labels=lambda namespace: namespaces.items.get(f"/{namespace}", {}),
                nodes=lambda: nodes.items.values(),
                resource_quotas=quotas_of,
                gpu_pods=lambda: ((p.namespace, p.label) for p in gpu_pods.items.values()),
                replicas=replicas.up if replicas is not None else tuple,
            ),
        )
        stopping = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stopping.set)
        runner = web.AppRunner(
            create_app(
                admitter=admitter,
                ready=ready,
                draining=stopping.is_set,
                callers=settings.client_name_list if settings.client_ca_file else None,
            ),
            access_log=None,
            # Answers in flight when the listener closes are finished: they are bounded by the deadline.
            shutdown_timeout=settings.decision_deadline_s + 2,
        )
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port, ssl_context=tls.context, backlog=512)
        await site.start()
        metrics_runner = None
        if settings.metrics_port:
            metrics_runner = web.AppRunner(create_metrics_app(admitter=admitter), access_log=None)
            await metrics_runner.setup()
            await web.TCPSite(metrics_runner, settings.host, settings.metrics_port).start()
        log.info(
            "serving",
            host=settings.host,
            port=settings.port,
            metrics_port=settings.metrics_port or settings.port,
            policy=settings.policy.value,
            tls_mode=settings.tls_mode.value,
        )
        tasks = [
            asyncio.create_task(ledger.run()),
            asyncio.create_task(namespaces.run()),
            asyncio.create_task(nodes.run()),
            asyncio.create_task(quotas.run()),
            asyncio.create_task(heartbeat.run()),
            asyncio.create_task(announce_sync()),
        ]
        if replicas is not None:
            tasks.append(asyncio.create_task(replicas.run()))
        if secret is None:
            tasks.append(asyncio.create_task(tls.watch()))
        else:
            tasks.append(asyncio.create_task(secret.run(tls=tls, interval_s=settings.tls_sync_interval_s)))
        try:
            await stopping.wait()
            # Drain: not ready at once (the endpoints drop this replica), still answering meanwhile,
            # then no new connections, the answers in flight finished, and out.
            log.info("draining", delay_s=settings.shutdown_delay_s)
            await asyncio.sleep(settings.shutdown_delay_s)
        finally:
            await runner.cleanup()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            if replicas is not None:
                await replicas.release()
            # The last answers are out: their committed labels and withdrawals still finish.
            await ledger.drain(timeout_s=settings.shutdown_delay_s + 2)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            log.info("stopped")


def main() -> None:
    try:
        settings = WebhookSettings.from_env()
    except SettingsError as exc:
        print(f"vramshare-webhook: {exc}", file=sys.stderr)
        sys.exit(2)
    logs.configure(level=settings.log_level)
    try:
        asyncio.run(serve(settings))
    except SettingsError as exc:
        print(f"vramshare-webhook: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
