"""Webhook replicas deal GPUs that tie out among themselves (issue #31), against the real stack: each
keeps a Lease, pods admitted at once through two replicas onto two tied A100s land one replica per
GPU with no commit racing another, a replica shut down deletes its Lease, and the Lease of one that
crashed is deleted by its peer once it went unrenewed for four durations."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.integration.replica_deal import (
    admit_40_pods_onto_two_tied_a100s,
    agreeing_identities,
    metric,
    start_two_replicas,
)
from vramshare.kube.replicas import LABEL_WEBHOOK_REPLICA
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

LEASE_S = 3
ENV = {"VRAMSHARE_REPLICA_LEASE_S": str(LEASE_S), "VRAMSHARE_SAFETY_MARGIN_MIB": "0"}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LocalCluster, dict[str, int]]]:
    with LocalCluster.start() as local:
        a100s = [g.uuid for _, g in local.settings.fleet.all_gpus() if "A100" in g.model]
        assert len(a100s) == 2
        names = agreeing_identities(a100s)
        ports = start_two_replicas(local, names=names, env=ENV)
        yield local, ports


def leases(local: LocalCluster) -> dict[str, str]:
    """Replica Lease name -> holder identity."""
    items = json.loads(
        local.kubectl("get", "leases", "-n", "default", "-l", LABEL_WEBHOOK_REPLICA, "-o", "json")
    )
    return {i["metadata"]["name"]: i["spec"]["holderIdentity"] for i in items["items"]}


def test_replicas_deal_tied_gpus_and_do_not_race(stack: tuple[LocalCluster, dict[str, int]]) -> None:
    local, ports = stack
    eventually(lambda: len(leases(local)) == 2, what="both replicas' Leases", timeout_s=20)
    eventually(
        lambda: all(metric(p, "vramshare_webhook_replicas_up") == 2 for p in ports.values()),
        what="each replica to see both up",
        timeout_s=20,
    )
    admit_40_pods_onto_two_tied_a100s(local, ports)


def test_a_replica_shut_down_deletes_its_lease_and_one_crashed_is_cleaned_up(
    stack: tuple[LocalCluster, dict[str, int]],
) -> None:
    local, ports = stack
    eventually(lambda: len(leases(local)) == 2, what="both replicas' Leases", timeout_s=20)
    local.stop_component("webhook-b")  # SIGTERM: a clean shutdown
    eventually(lambda: len(leases(local)) == 1, what="webhook-b's Lease deleted on shutdown", timeout_s=30)
    eventually(
        lambda: metric(ports["a"], "vramshare_webhook_replicas_up") == 1,
        what="webhook-a to see itself alone",
        timeout_s=10,
    )
    local.start_component("webhook-b")
    eventually(lambda: len(leases(local)) == 2, what="webhook-b's Lease back", timeout_s=20)
    local.stop_component("webhook-b", kill=True)  # SIGKILL: its Lease stays behind
    killed = time.monotonic()
    assert len(leases(local)) == 2
    eventually(
        lambda: metric(ports["a"], "vramshare_webhook_replicas_up") == 1,
        what="webhook-a to count the crashed replica gone",
        timeout_s=LEASE_S + 5,
    )
    eventually(lambda: len(leases(local)) == 1, what="the crashed replica's Lease deleted", timeout_s=30)
    # Not before it went unrenewed for four durations (its last renewal was at most a third before).
    assert time.monotonic() - killed >= 4 * LEASE_S - LEASE_S / 3 - 0.5
    local.start_component("webhook-b")
    eventually(lambda: len(leases(local)) == 2, what="webhook-b's Lease back", timeout_s=20)
