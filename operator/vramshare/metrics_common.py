"""What every vramshare /metrics serves besides its own series: the process (CPU, memory, open files)
and which build is running."""

from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector


def version() -> str:
    try:
        return metadata.version("vramshare")
    except metadata.PackageNotFoundError:
        return "unknown"


def register_standard(registry: CollectorRegistry, *, component: str) -> None:
    """`process_*`, `python_info` and `vramshare_build_info{component, version, python}` = 1."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Gauge(
        "vramshare_build_info",
        "1, labelled with the component, vramshare's version and Python's.",
        ["component", "version", "python"],
        registry=registry,
    ).labels(component, version(), platform.python_version()).set(1)
