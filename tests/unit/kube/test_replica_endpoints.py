"""The replicas up, read from the webhook Service's EndpointSlices (issue #31), against a fake client."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from tests.unit.fake_kube import FakeKube
from vramshare.kube.replicas import MAX_REPLICAS, ReplicaEndpoints, ready_pods

SLICES = "/apis/discovery.k8s.io/v1/namespaces/vramshare/endpointslices"


def endpoint(pod: str, *, ready: bool | None = True, kind: str = "Pod") -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": ["10.0.0.1"], "conditions": conditions, "targetRef": {"kind": kind, "name": pod}}


def endpoint_slice(
    name: str, *endpoints: dict[str, Any], service: str = "vramshare-webhook"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": list(endpoints),
    }


def test_only_ready_pods_count() -> None:
    got = ready_pods(
        endpoint_slice(
            "s",
            endpoint("a"),
            endpoint("b", ready=None),  # the API: a consumer that does not know the condition takes ready
            endpoint("draining", ready=False),
            endpoint("a-node", kind="Node"),
            {"addresses": ["10.0.0.9"]},  # no targetRef
        )
    )
    assert got == {"a", "b"}


@pytest.mark.parametrize("bad", [{"endpoints": None}, {"endpoints": ["x", 3]}, {}])
def test_a_malformed_slice_names_no_one(bad: dict[str, Any]) -> None:
    assert ready_pods(bad) == frozenset()


def test_a_name_too_long_is_left_out() -> None:
    assert ready_pods(endpoint_slice("s", endpoint("x" * 254), endpoint("ok"))) == {"ok"}


async def test_the_replicas_up_follow_the_slices_of_their_own_service() -> None:
    kube = FakeKube()
    ups: list[int] = []
    await kube.create(SLICES, endpoint_slice("web-1", endpoint("web-b"), endpoint("web-a")))
    await kube.create(SLICES, endpoint_slice("other-1", endpoint("stranger"), service="something-else"))
    replicas = ReplicaEndpoints(kube, namespace="vramshare", service="vramshare-webhook", on_up=ups.append)  # type: ignore[arg-type]
    task = asyncio.create_task(replicas.run())
    try:
        await asyncio.wait_for(replicas.cache.synced.wait(), 2)
        assert replicas.up() == ("web-a", "web-b")  # in name order; other Services' pods are not peers
        # A second slice (the controller splits large Services), with a pod listed in both while it moves.
        await kube.create(SLICES, endpoint_slice("web-2", endpoint("web-c"), endpoint("web-b")))
        assert await replicas.cache.wait_for(kube.version, timeout_s=2)
        assert replicas.up() == ("web-a", "web-b", "web-c")
        # web-a drains for shutdown: not ready, so its peers deal its share at once.
        await kube.merge_patch(
            f"{SLICES}/web-1", {"endpoints": [endpoint("web-b"), endpoint("web-a", ready=False)]}
        )
        assert await replicas.cache.wait_for(kube.version, timeout_s=2)
        assert replicas.up() == ("web-b", "web-c")
        await kube.delete(f"{SLICES}/web-2")
        assert await replicas.cache.wait_for(kube.version, timeout_s=2)
        assert replicas.up() == ("web-b",)
        assert ups == [2, 3, 2, 1]  # told only when it changed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_service_with_too_many_endpoints_deals_nothing() -> None:
    kube = FakeKube()
    many = [endpoint(f"web-{i:03d}") for i in range(MAX_REPLICAS + 1)]
    await kube.create(SLICES, endpoint_slice("web-1", *many))
    replicas = ReplicaEndpoints(kube, namespace="vramshare", service="vramshare-webhook")  # type: ignore[arg-type]
    task = asyncio.create_task(replicas.run())
    try:
        await asyncio.wait_for(replicas.cache.synced.wait(), 2)
        assert replicas.up() == ()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
