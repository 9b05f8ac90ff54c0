"""`vramshare-webhook`: run the admission webhook (settings from VRAMSHARE_* environment variables)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import structlog
from aiohttp import web

from vramshare import logs
from vramshare.kube.client import Connection, KubeClient
from vramshare.kube.ledger import KubeLedger
from vramshare_webhook.admission import Admitter
from vramshare_webhook.app import create_app
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.settings import SettingsError, WebhookSettings
from vramshare_webhook.tls import ReloadingTls

log = structlog.get_logger("vramshare.webhook")


async def serve(settings: WebhookSettings) -> None:
    if not settings.tls_cert_file:
        raise SettingsError("VRAMSHARE_TLS_CERT_FILE and VRAMSHARE_TLS_KEY_FILE are required")
    tls = ReloadingTls(cert_file=Path(settings.tls_cert_file), key_file=Path(settings.tls_key_file))
    connection = Connection.load(kubeconfig=settings.kubeconfig or None)
    async with KubeClient(connection, user_agent="vramshare-webhook") as kube:
        ledger = KubeLedger(kube)
        synced = asyncio.Event()

        async def sync() -> None:
            while True:
                try:
                    snapshot = await ledger.snapshot()
                except Exception as exc:  # not ready until the API server and the CRDs answer
                    log.warning("waiting for the API server", error=str(exc))
                    await asyncio.sleep(1)
                    continue
                log.info("synced", gpus=len(snapshot.gpus), reservations=len(snapshot.reservations))
                synced.set()
                return

        admitter = Admitter(settings=settings, ledger=ledger, metrics=WebhookMetrics())
        app = create_app(admitter=admitter, ready=synced.is_set)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port, ssl_context=tls.context, backlog=512)
        await site.start()
        log.info("serving", host=settings.host, port=settings.port, policy=settings.policy.value)
        tasks = [asyncio.create_task(sync()), asyncio.create_task(tls.watch())]
        try:
            await asyncio.Event().wait()
        finally:
            for t in tasks:
                t.cancel()
            await runner.cleanup()


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
