"""Serving TLS from certificate files, reloaded in place when the files change.

Reloading into the same SSLContext means new connections get the new certificate while requests in
flight finish on the old one: rotation drops nothing. TLS 1.2 is the oldest version accepted.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import structlog

log = structlog.get_logger("vramshare.webhook.tls")


class ReloadingTls:
    def __init__(self, *, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._stamp: tuple[float, float] | None = None
        self.reload_if_changed()

    def _current_stamp(self) -> tuple[float, float]:
        return (self.cert_file.stat().st_mtime, self.key_file.stat().st_mtime)

    def reload_if_changed(self) -> bool:
        stamp = self._current_stamp()
        if stamp == self._stamp:
            return False
        self.context.load_cert_chain(str(self.cert_file), str(self.key_file))
        if self._stamp is not None:
            log.info("serving certificate reloaded", cert_file=str(self.cert_file))
        self._stamp = stamp
        return True

    async def watch(self, *, interval_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.reload_if_changed()
            except (OSError, ssl.SSLError) as exc:  # a half-written pair: keep serving the old one
                log.warning("serving certificate not reloaded", error=str(exc))
