"""Webhook replicas known from their Service's EndpointSlices (issue #31; the chart's default), against
the real stack: kube-controller-manager's EndpointSlice controller writes the slices of a Service whose
pods kwok runs and marks ready, named as the two webhook processes name themselves (as the chart names
each replica by its pod). Pods admitted at once through both replicas onto two tied A100s land one
replica per GPU with no commit racing another, using no Lease and no write of the replicas' own; a
replica whose pod goes is dealt out at once."""

from __future__ import annotations

import json
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

SERVICE = "vramshare-webhook"
SELECTOR = {"app.kubernetes.io/component": "e2e-webhook-replica"}


def replica_pod(name: str, node: str) -> dict[str, object]:
    """The pod a replica would run in (kwok runs it and marks it ready; the process is outside)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": SELECTOR},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "webhook", "image": "example.invalid/vramshare", "ports": [{"containerPort": 8443}]}
            ],
        },
    }


def ready_in_slices(local: LocalCluster) -> set[str]:
    slices = json.loads(
        local.kubectl(
            "get",
            "endpointslices",
            "-n",
            "default",
            "-l",
            f"kubernetes.io/service-name={SERVICE}",
            "-o",
            "json",
        )
    )
    return {
        e["targetRef"]["name"]
        for s in slices["items"]
        for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready") is not False and e.get("targetRef")
    }


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LocalCluster, dict[str, int], dict[str, str]]]:
    with LocalCluster.start() as local:
        fleet = local.settings.fleet.all_gpus()
        a100s = [g.uuid for _, g in fleet if "A100" in g.model]
        assert len(a100s) == 2
        names = agreeing_identities(a100s)
        node = fleet[0][0].name
        local.apply_objects(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": SERVICE, "namespace": "default"},
                    "spec": {"selector": SELECTOR, "ports": [{"port": 443, "targetPort": 8443}]},
                },
                *(replica_pod(names[s], node) for s in ("a", "b")),
            ]
        )
        eventually(
            lambda: ready_in_slices(local) == set(names.values()),
            what="both replica pods ready in the Service's EndpointSlices",
            timeout_s=30,
        )
        env = {
            "VRAMSHARE_REPLICA_SERVICE": SERVICE,
            "VRAMSHARE_REPLICA_LEASE_S": "0",
            "VRAMSHARE_SAFETY_MARGIN_MIB": "0",
        }
        ports = start_two_replicas(local, names=names, env=env)
        yield local, ports, names


def test_replicas_from_endpoints_deal_tied_gpus_and_do_not_race(
    stack: tuple[LocalCluster, dict[str, int], dict[str, str]],
) -> None:
    local, ports, _ = stack
    eventually(
        lambda: all(metric(p, "vramshare_webhook_replicas_up") == 2 for p in ports.values()),
        what="each replica to see both up",
        timeout_s=20,
    )
    # As in test_replica_deal_e2e, whose replicas know each other by Leases.
    admit_40_pods_onto_two_tied_a100s(local, ports)
    # Known without a write of their own: no replica Lease.
    leases = json.loads(local.kubectl("get", "leases", "-A", "-l", LABEL_WEBHOOK_REPLICA, "-o", "json"))
    assert leases["items"] == []


def test_a_replica_whose_pod_goes_is_dealt_out(
    stack: tuple[LocalCluster, dict[str, int], dict[str, str]],
) -> None:
    local, ports, names = stack
    node = local.settings.fleet.all_gpus()[0][0].name
    local.kubectl("delete", "pod", names["b"], "-n", "default", "--wait=false")
    eventually(
        lambda: metric(ports["a"], "vramshare_webhook_replicas_up") == 1,
        what="webhook-a to see itself alone once webhook-b's pod is gone from the endpoints",
        timeout_s=30,
    )
    # webhook-b still answers (its pod is draining): it does not find itself up, and deals nothing.
    assert metric(ports["b"], "vramshare_webhook_replicas_up") == 1
    eventually(lambda: names["b"] not in ready_in_slices(local), what="the slice to drop it", timeout_s=30)
    local.apply_objects([replica_pod(names["b"], node)])
    eventually(
        lambda: all(metric(p, "vramshare_webhook_replicas_up") == 2 for p in ports.values()),
        what="both up again",
        timeout_s=30,
    )
