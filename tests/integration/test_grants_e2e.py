"""Grants (`vramshare.domain.grants`, issue #45) on the real stack: kube-apiserver, the controller, two
webhook replicas over TLS, each taking grants. Pods admitted through both at once, more than the
fleet holds: the ledger stays exact and no GPU is booked past its size, and most pods are booked
inside a grant with no token bump. A replica killed with grants held: the controller ends them once
they went unrenewed for their duration and the margin, not before. A replica shut down gives its
grants back at once."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.integration.replica_deal import metric
from vramshare.domain import ReservationPhase
from vramshare.domain.headroom import booked
from vramshare.kube.ledger.grants import holder_hash
from vramshare.kube.objects import GpuDevice, GpuReservation
from vramshare.kube.resources import LABEL_RESERVATION
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import start_controller, start_webhook, webhook_configuration
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

LASTS_S = 3
NAMES = {"a": "webhook-grants-a", "b": "webhook-grants-b"}
ENV = {
    "VRAMSHARE_GRANT_PODS": "8",
    "VRAMSHARE_GRANT_LASTS_S": str(LASTS_S),
    "VRAMSHARE_GRANT_IDLE_S": "120",
    "VRAMSHARE_SAFETY_MARGIN_MIB": "0",
    "VRAMSHARE_LOG_LEVEL": "warning",
}
CONTROLLER_ENV = {"VRAMSHARE_LIFECYCLE_INTERVAL_S": "1", "VRAMSHARE_LOG_LEVEL": "warning"}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LocalCluster, dict[str, int]]]:
    with LocalCluster.start() as local:
        ports = {
            s: start_webhook(local, name=f"webhook-{s}", env={**ENV, "VRAMSHARE_IDENTITY": NAMES[s]})[1]
            for s in ("a", "b")
        }
        local.apply_objects([webhook_configuration(local, ports=ports)])
        for s in ports:
            local.create_namespace(f"jobs-{s}", {"vramshare-e2e/shard": s})
        start_controller(local, name="controller", env=CONTROLLER_ENV)
        eventually(
            lambda: len(devices(local)) == len(local.settings.fleet.all_gpus()), what="the GPU inventory"
        )
        yield local, ports


def devices(local: LocalCluster) -> list[GpuDevice]:
    return [
        GpuDevice.from_wire(d) for d in json.loads(local.kubectl("get", "gpudevices", "-o", "json"))["items"]
    ]


def ledger(local: LocalCluster) -> list[GpuReservation]:
    items = json.loads(local.kubectl("get", "gpureservations", "-A", "-o", "json"))["items"]
    return [GpuReservation.from_wire(o) for o in items]


def grants_of(local: LocalCluster, replica: str) -> list[GpuReservation]:
    return [r for r in ledger(local) if r.granted_to == holder_hash(NAMES[replica])]


def burst(local: LocalCluster, *, pods: int, mib: int, prefix: str) -> list[tuple[str, str | None]]:
    """`pods` GPU pods of `mib` created at once (8 threads), alternately through replicas a and b;
    each one's namespace and booking, or None where it was refused."""
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(local.kubeconfig)))

    def create(i: int) -> tuple[str, str | None]:
        namespace = f"jobs-{'ab'[i % 2]}"
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{prefix}-{i}",
                "annotations": {"gpu-mem-mb": str(mib), "gpu-refusal": "forbidden"},
            },
            "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "example.invalid/x"}]},
        }
        try:
            pod = core.create_namespaced_pod(namespace, body)
        except ApiException as exc:
            if exc.status != 403:
                raise
            return namespace, None
        return namespace, pod.metadata.labels[LABEL_RESERVATION]

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(create, range(pods)))


def clear(local: LocalCluster) -> None:
    """Delete every pod of the test namespaces and wait until their bookings no longer count."""
    for namespace in ("jobs-a", "jobs-b"):
        local.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=false")
    eventually(
        lambda: (
            not [r for r in ledger(local) if r.granted_to == "" and r.labelled_active and r.phase.is_active]
        ),
        what="the pods' bookings to end",
        timeout_s=60,
    )


def test_pods_through_two_replicas_with_grants_never_overbook_and_mostly_skip_the_bump(
    stack: tuple[LocalCluster, dict[str, int]],
) -> None:
    local, ports = stack
    sizes = {d.spec.uuid: d.status.total_mib for d in devices(local) if d.status is not None}
    fit = sum(size // 2048 for size in sizes.values())
    try:
        placed = burst(local, pods=2 * fit, mib=2048, prefix="g")  # twice what the fleet holds
        check_the_burst(local, ports, placed=placed, fit=fit)
    finally:
        clear(local)  # the next tests need room


def check_the_burst(
    local: LocalCluster, ports: dict[str, int], *, placed: list[tuple[str, str | None]], fit: int
) -> None:
    admitted = {(ns, name) for ns, name in placed if name is not None}
    assert 0 < len(admitted) <= fit

    def active_bookings() -> set[tuple[str, str]]:
        return {
            (r.namespace, r.name)
            for r in ledger(local)
            if r.granted_to == "" and r.labelled_active and r.phase.is_active
        }

    # Every admitted pod booked once, nothing for a refused one: a booking withdrawn in the
    # background (an answer past its deadline under load) or left to expire counts until then.
    eventually(
        lambda: active_bookings() == admitted, what="one active booking per admitted pod", timeout_s=40
    )
    reservations = ledger(local)
    inside = [r for r in reservations if r.spec.grant and r.labelled_active and r.phase.is_active]
    for d in devices(local):
        assert d.status is not None
        on_gpu = [r.to_domain() for r in reservations if r.spec.gpu_uuid == d.spec.uuid]
        pods_mib = sum(r.mib for r in on_gpu if r.phase is not ReservationPhase.GRANTED and r.is_active)
        gpu = d.to_domain()
        assert gpu is not None
        reserved, _ = booked(gpu, on_gpu, settle_s=30)
        assert pods_mib <= reserved <= d.status.total_mib, (d.spec.uuid, pods_mib, reserved)
    bumps = sum(
        metric(p, 'vramshare_webhook_api_writes_total{resource="gpudevices",verb="patch"}')
        for p in ports.values()
    )
    made_inside = sum(metric(p, "vramshare_webhook_grant_bookings_total") for p in ports.values())
    held = [g for g in ledger(local) if g.granted_to and g.labelled_active]
    print(
        f"\n[grants] {len(admitted)} of {2 * fit} pods admitted through two replicas where {fit} fit, "
        f"{len(inside)} inside a grant, {bumps:g} token bumps; grants still held: {len(held)}"
    )
    assert made_inside >= len(inside) > 0  # an answer past its deadline withdraws its booking
    assert {g.status.phase for g in held} <= {ReservationPhase.GRANTED}  # recorded by the controller


def hold_grants(local: LocalCluster, prefix: str) -> None:
    """A few small pods through each replica, so each holds a grant the controller recorded."""
    burst(local, pods=8, mib=512, prefix=prefix)
    for replica in ("a", "b"):
        eventually(
            lambda r=replica: any(
                g.status.phase is ReservationPhase.GRANTED and g.labelled_active for g in grants_of(local, r)
            ),
            what=f"a recorded grant of webhook-{replica}",
            timeout_s=30,
        )


def test_a_replica_killed_with_grants_held_loses_them_once_they_lapse(
    stack: tuple[LocalCluster, dict[str, int]],
) -> None:
    local, ports = stack
    hold_grants(local, "k")
    held = {g.key for g in grants_of(local, "b") if g.phase is ReservationPhase.GRANTED}
    assert held
    assert metric(ports["b"], "vramshare_webhook_grants_held") >= 1
    local.stop_component("webhook-b", kill=True)  # its grants stay behind, unrenewed
    killed = time.monotonic()

    def lapsed() -> bool:
        now = {g.key: g for g in grants_of(local, "b")}
        return all(k not in now or now[k].status.reason == "GrantLapsed" for k in held)

    time.sleep(max(0.0, LASTS_S - LASTS_S / 3 - 0.5))
    assert not lapsed()  # renewed at most a third of its duration before the kill: not yet
    eventually(lapsed, what="the killed replica's grants to lapse", timeout_s=30)
    took = time.monotonic() - killed
    assert took >= LASTS_S + 2 - LASTS_S / 3 - 0.5, took
    ended = [g for g in grants_of(local, "b") if g.key in held]
    assert all(g.meta.labels.get("vramshare.io/active") == "false" for g in ended)
    local.start_component("webhook-b")


def test_a_replica_shut_down_gives_its_grants_back_at_once(
    stack: tuple[LocalCluster, dict[str, int]],
) -> None:
    local, _ = stack
    hold_grants(local, "s")
    assert [g for g in grants_of(local, "a") if g.phase is ReservationPhase.GRANTED]
    stopped = time.monotonic()
    local.stop_component("webhook-a")  # SIGTERM
    eventually(
        lambda: not [g for g in grants_of(local, "a") if g.phase is ReservationPhase.GRANTED],
        what="webhook-a's grants given back",
        timeout_s=20,
    )
    gone = time.monotonic() - stopped
    # Deleted by their holder, not lapsed: none is left Expired, and none waited for the controller.
    assert not [g for g in grants_of(local, "a") if g.status.reason == "GrantLapsed"], gone
    local.start_component("webhook-a")
