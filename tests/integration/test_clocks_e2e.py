"""Clocks of other machines (issue #30, 3): the controller runs under libfaketime with its clock 20 s
ahead of the API server's, the webhook 40 s ahead. A booking's age is measured on the API server's
clock (from the Date of its answers), so a booking is not expired the moment it is created, and still
expires after its TTL; and a pod reinvoked after a sidecar injector keeps its one booking, where the
webhook's own clock would have found it older than the 30 s reinvocation window."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_RESERVATION
from vramshare_e2e.admission_parts import SIDECAR, start_mutating_webhook
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import bare_booking, start_controller, start_webhook, webhook_configuration
from vramshare_e2e.process import eventually
from vramshare_e2e.tools import apt_install

pytestmark = pytest.mark.cluster

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
AHEAD_S = 20
WEBHOOK_AHEAD_S = 40
TTL_S = 12


def ahead(seconds: int) -> dict[str, str]:
    # Wall clock only: timeouts and sleeps run on the monotonic clock, as on a real machine.
    return {"LD_PRELOAD": str(FAKETIME), "FAKETIME": f"+{seconds}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


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
                **ahead(AHEAD_S),
                "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
                "VRAMSHARE_RESERVATION_TTL_S": str(TTL_S),
            },
        )
        port = start_webhook(local, name="webhook-ahead", env=ahead(WEBHOOK_AHEAD_S))[1]
        local.apply_objects([webhook_configuration(local, ports={"ahead": port})])
        start_mutating_webhook(local, mode="sidecar")
        local.create_namespace("injected", {"vramshare-e2e/shard": "ahead", "e2e.vramshare.io/sidecar": "on"})
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


def test_the_webhooks_clock_ahead_keeps_a_reinvoked_pods_one_booking(stack: LocalCluster) -> None:
    """The sidecar injector runs after vramshare, so the API server calls vramshare again; the second
    call must find the booking the first made. Before: by the webhook's clock, 40 s ahead, the booking
    was older than the 30 s window, and the pod was booked a second time."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reinvoked", "namespace": "injected", "annotations": {"gpu-mem-mb": "2048"}},
        "spec": {"containers": [{"name": "base", "image": "example.invalid/task"}], "restartPolicy": "Never"},
    }
    made = json.loads(stack.kubectl("create", "-f", "-", "-o", "json", stdin=json.dumps(pod)))
    assert [c["name"] for c in made["spec"]["containers"]] == ["base", SIDECAR]  # reinvoked after it
    items = json.loads(stack.kubectl("get", "gpureservations", "-n", "injected", "-o", "json"))["items"]
    assert [r["metadata"]["name"] for r in items] == [made["metadata"]["annotations"][ANNOTATION_RESERVATION]]
    assert items[0]["spec"]["gpuUUID"] == made["metadata"]["annotations"][ANNOTATION_GPU_UUID]
