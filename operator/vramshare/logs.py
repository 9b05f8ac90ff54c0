"""structlog set-up shared by the webhook and the controller: one JSON object per line on stdout.

vramshare logs through structlog; kopf, aiohttp, asyncio and the kubernetes client log through the
standard library. Their records go through structlog's formatter too, so a log collector sees one
stream of JSON objects with the same keys (`event`, `level`, `timestamp`, and `logger` for theirs).
"""

from __future__ import annotations

import logging
import sys

import structlog

_TIMESTAMP = structlog.processors.TimeStamper(fmt="iso", utc=True)


LEVELS = ("debug", "info", "warning", "error")
"""The log levels the VRAMSHARE_LOG_LEVEL settings accept."""


def configure(*, level: str = "info") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                _TIMESTAMP,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _TIMESTAMP,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
