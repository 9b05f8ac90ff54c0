"""Clocks of other machines (issue #30, 3): the controller runs under libfaketime with its clock 20 s
ahead of the API server's. A booking's age is measured on the API server's clock (from the Date of
its answers), so a booking is not expired the moment it is created, and still expires after its TTL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramshare_e2e.cluster import LocalCluster, apt_install, eventually
from vramshare_e2e.components import bare_booking, start_controller

pytestmark = pytest.mark.cluster

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
AHEAD_S = 20
TTL_S = 12


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    if not FAKETIME.exists():
        apt_install("faketime")
    assert FAKETIME.exists(), "Debian's faketime installs libfaketime here"
    with LocalCluster.start() as local:
        local.kubectl("create", "namespace", "jobs")
        start_controller(
            local,
            name="controller-ahead",
            env={
                "LD_PRELOAD": str(FAKETIME),
                "FAKETIME": f"+{AHEAD_S}s",
                # Wall clock only: timeouts and sleeps run on the monotonic clock, as on a real machine.
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
                "VRAMSHARE_RESERVATION_TTL_S": str(TTL_S),
            },
        )
        yield local


def phase(stack: LocalCluster, name: str) -> str | None:
    res = json.loads(stack.kubectl("get", "gpureservation", name, "-n", "jobs", "-o", "json"))
    value: str | None = res.get("status", {}).get("phase")
    return value


def test_the_controllers_clock_ahead_does_not_expire_a_booking_early(stack: LocalCluster) -> None:
    node, gpu = stack.settings.fleet.all_gpus()[0]
    booking = bare_booking(
        name="fresh",
        namespace="jobs",
        pod="appears-soon",
        node=node.name,
        uuid=gpu.uuid,
        index=gpu.index,
        mib=2048,
    )
    stack.kubectl("create", "-f", "-", stdin=json.dumps(booking))
    created = time.monotonic()
    eventually(lambda: phase(stack, "fresh") == "Reserved", what="the booking Reserved", timeout_s=30)
    # By the controller's own clock it was already 20 s old, past its 12 s TTL: before, Expired at once.
    time.sleep(4)
    assert phase(stack, "fresh") == "Reserved"
    # On the API server's clock the TTL still runs out.
    eventually(lambda: phase(stack, "fresh") == "Expired", what="Expired after its TTL", timeout_s=30)
    waited = time.monotonic() - created
    print(
        f"\nexpired {waited:.1f} s after creation (TTL {TTL_S} s, the controller's clock {AHEAD_S} s ahead)"
    )
    assert waited >= TTL_S - 2  # the server clock's estimate is within about a second
