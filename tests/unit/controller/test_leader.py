"""LeaseElector against a fake client: acquire, stand by, take over an expired lease, step down."""

from __future__ import annotations

import pytest

from tests.unit.domain.builders import NOW
from tests.unit.fake_kube import FakeKube
from vramshare.controller.leader import LeadershipLostError, LeaseElector
from vramshare.kube.client import ApiError
from vramshare.kube.resources import format_time_precise

PATH = "/apis/coordination.k8s.io/v1/namespaces/vramshare/leases/vramshare-controller"


def elector(kube: FakeKube, identity: str, *, now: list[float], duration_s: float = 15.0) -> LeaseElector:
    return LeaseElector(
        kube=kube,  # type: ignore[arg-type]
        namespace="vramshare",
        name="vramshare-controller",
        identity=identity,
        duration_s=duration_s,
        clock=lambda: now[0],
    )


async def test_first_replica_creates_the_lease_and_others_stand_by() -> None:
    kube, now = FakeKube(), [NOW]
    assert await elector(kube, "a", now=now).try_acquire()
    spec = kube.objects[PATH]["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("a", 0)
    now[0] += 10  # renewed 10 s ago, duration 15 s: still held
    assert not await elector(kube, "b", now=now).try_acquire()
    assert kube.objects[PATH]["spec"]["holderIdentity"] == "a"


async def test_an_expired_lease_is_taken_over_and_counted() -> None:
    kube, now = FakeKube(), [NOW]
    await elector(kube, "a", now=now).try_acquire()
    now[0] += 16
    assert await elector(kube, "b", now=now).try_acquire()
    spec = kube.objects[PATH]["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert spec["renewTime"] == format_time_precise(now[0])


async def test_the_holder_renews_its_own_lease_without_a_transition() -> None:
    kube, now = FakeKube(), [NOW]
    a = elector(kube, "a", now=now)
    await a.try_acquire()
    now[0] += 5
    assert await a.try_acquire()
    assert kube.objects[PATH]["spec"]["leaseTransitions"] == 0


async def test_hold_steps_down_when_another_replica_took_the_lease() -> None:
    kube, now = FakeKube(), [NOW]
    a = elector(kube, "a", now=now, duration_s=0.03)
    await a.try_acquire()
    lease = kube.objects[PATH]
    await kube.replace(PATH, {**lease, "spec": {**lease["spec"], "holderIdentity": "b"}})
    with pytest.raises(LeadershipLostError, match="taken by another replica"):
        await a.hold()


async def test_hold_steps_down_when_renewals_fail_for_a_whole_duration() -> None:
    kube, now = FakeKube(), [NOW]
    a = elector(kube, "a", now=now, duration_s=0.03)
    await a.try_acquire()

    def away(op: str, path: str) -> ApiError:
        now[0] += 0.02  # time passes while the API server does not answer
        return ApiError(status=503, reason="ServiceUnavailable", message="etcd away")

    kube.fail = away
    with pytest.raises(LeadershipLostError, match="could not renew"):
        await a.hold()
