"""Free loopback ports for the local stack's components, outside the kernel's ephemeral range."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

from vramshare_e2e.process import ClusterError

_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: free when checked, but maybe not bound yet (a cluster picks all
its ports before starting any component), so never handed out twice."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: an outgoing connection can take a port
    from that range between our check and the server's bind (seen in CI as 'address already in use')."""
    low, high = 10_000, max(10_001, _ephemeral_range()[0])
    # Parallel test workers (pytest-xdist's gw0, gw1, ...) each draw from their own slice, so two
    # clusters starting at once never pick the same port between one's check and its bind.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit() and workers > 1:
        size = (high - low) // workers
        low += int(worker[2:]) * size
        high = low + size
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise ClusterError("no free loopback port found below the ephemeral range")
