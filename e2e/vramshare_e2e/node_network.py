"""Real nodes' addresses on this machine's loopback interface, behind a guard route, so a node's
traffic never leaves the machine."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Iterator

from vramshare_e2e.process import ClusterError
from vramshare_e2e.tools import images_cache

NODE_NETWORK = "198.18.0.0/15"
"""Where node addresses come from: the range set aside for benchmarking networks (RFC 2544), so no
real network here uses it. Each node's address is put on this machine's loopback interface, for its
kubelet and its hostNetwork pods: Endpoints and EndpointSlices refuse 127.0.0.0/8 addresses, so a
webhook on a node with a 127.x address could never be called through its Service. Beside them an
`unreachable` route for the whole range: a packet for a node address that is not (or no longer) on
loopback is refused here instead of leaving the machine by the default route."""


def node_address(number: int) -> str:
    if not 2 <= number <= 254:
        raise ValueError(f"node number must be 2..254 (the address 198.18.0.N), not {number}")
    return f"198.18.0.{number}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def claim_address(address: str) -> None:
    """Put `address` on loopback, behind the guard route (both idempotent, parallel-safe)."""
    if os.geteuid() != 0:
        raise ClusterError("a real node needs root: its address goes on the loopback interface")
    with _network_lock():
        if "unreachable 198.18.0.0/15" not in _ip("route", "show", "type", "unreachable").stdout:
            _ip("route", "add", "unreachable", NODE_NETWORK)
        if f"inet {address}/32" not in _ip("-4", "addr", "show", "dev", "lo").stdout:
            _ip("addr", "add", f"{address}/32", "dev", "lo")
        route = _ip("route", "get", address).stdout
        if not route.startswith(f"local {address} dev lo"):
            raise ClusterError(f"{address} is not local after putting it on loopback: {route.strip()}")


def release_address(address: str) -> None:
    """Take `address` off loopback; the guard route goes with the last node address."""
    with _network_lock():
        _ip("addr", "del", f"{address}/32", "dev", "lo", check=False)
        if "inet 198.18." not in _ip("-4", "addr", "show", "dev", "lo").stdout:
            _ip("route", "del", "unreachable", NODE_NETWORK, check=False)


@contextlib.contextmanager
def _network_lock() -> Iterator[None]:
    path = images_cache().parent / ".node-network.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


__all__ = ["NODE_NETWORK", "claim_address", "node_address", "release_address"]
