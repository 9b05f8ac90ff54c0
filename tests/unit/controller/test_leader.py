"""LeaseElector against a fake client, with client-go's semantics: expiry observed by the stand-by's own
clock (never the holder's renewTime), a renew deadline shorter than the lease, release on shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.unit.domain.builders import NOW
from tests.unit.fake_kube import FakeKube
from vramshare.controller.leader import LeadershipLostError, LeaseElector, LeaseTiming
from vramshare.kube.client import ApiError
from vramshare.kube.resources import format_time_precise

PATH = "/apis/coordination.k8s.io/v1/namespaces/vramshare/leases/vramshare-controller"


def elector(
    kube: FakeKube,
    identity: str,
    *,
    now: list[float] | None = None,
    wall: float = NOW,
    timing: LeaseTiming | None = None,
) -> LeaseElector:
    return LeaseElector(
        kube=kube,  # type: ignore[arg-type]
        namespace="vramshare",
        name="vramshare-controller",
        identity=identity,
        timing=timing or LeaseTiming(),
        clock=(lambda: now[0]) if now is not None else time.monotonic,
        wall_clock=lambda: wall,
    )


async def test_first_replica_creates_the_lease_and_others_stand_by() -> None:
    kube, now = FakeKube(), [100.0]
    assert await elector(kube, "a", now=now).try_acquire()
    spec = kube.objects[PATH]["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"], spec["leaseDurationSeconds"]) == ("a", 0, 15)
    b = elector(kube, "b", now=now)
    assert not await b.try_acquire()
    now[0] += 14.9  # unchanged for less than the duration, by b's own clock
    assert not await b.try_acquire()
    assert kube.objects[PATH]["spec"]["holderIdentity"] == "a"


async def test_a_skewed_renew_time_does_not_hand_over_a_live_lease() -> None:
    """The holder's clock is an hour behind: its renewTime looks long expired, but b has seen it change."""
    kube, now = FakeKube(), [100.0]
    a = elector(kube, "a", now=now, wall=NOW - 3600)
    b = elector(kube, "b", now=now, wall=NOW)
    await a.try_acquire()
    for _ in range(10):  # a renews every 5 s; b looks in between, for 50 s in all
        now[0] += 2.5
        assert not await b.try_acquire()
        now[0] += 2.5
        a.wall_clock = lambda t=now[0]: NOW - 3600 + t  # type: ignore[misc]
        assert await a.try_acquire()
    assert kube.objects[PATH]["spec"]["holderIdentity"] == "a"


async def test_a_lease_unchanged_for_its_duration_is_taken_over_and_counted() -> None:
    kube, now = FakeKube(), [100.0]
    await elector(kube, "a", now=now).try_acquire()
    b = elector(kube, "b", now=now, wall=NOW + 99)
    assert not await b.try_acquire()  # first sight: its clock starts now, whatever renewTime says
    now[0] += 15.1
    assert await b.try_acquire()
    spec = kube.objects[PATH]["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert spec["renewTime"] == format_time_precise(NOW + 99)


async def test_the_holder_renews_its_own_lease_without_a_transition() -> None:
    kube, now = FakeKube(), [100.0]
    a = elector(kube, "a", now=now)
    await a.try_acquire()
    acquired = kube.objects[PATH]["spec"]["acquireTime"]
    now[0] += 5
    assert await a.try_acquire()
    assert kube.objects[PATH]["spec"]["leaseTransitions"] == 0
    assert kube.objects[PATH]["spec"]["acquireTime"] == acquired


FAST = LeaseTiming(duration_s=0.6, renew_deadline_s=0.3, retry_period_s=0.05)


async def test_hold_steps_down_when_another_replica_took_the_lease() -> None:
    kube = FakeKube()
    a = elector(kube, "a", timing=FAST)
    await a.try_acquire()
    lease = kube.objects[PATH]
    await kube.replace(PATH, {**lease, "spec": {**lease["spec"], "holderIdentity": "b"}})
    with pytest.raises(LeadershipLostError, match="taken by another replica"):
        await a.hold()


async def test_a_renewal_that_hangs_is_cut_off_and_the_leader_steps_down_before_the_lease_ends() -> None:
    kube = FakeKube()
    a = elector(kube, "a", timing=FAST)
    await a.try_acquire()
    real_replace = kube.replace

    async def hanging(path: str, body: dict[str, object]) -> dict[str, object]:
        await asyncio.sleep(3600)  # the API server accepted the connection and never answers
        return await real_replace(path, body)

    kube.replace = hanging  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(LeadershipLostError, match=r"within the 0\.3 s renew deadline"):
        await a.hold()
    # Stepped down at the renew deadline (plus one retry period), well before the 0.6 s lease ends.
    assert time.monotonic() - started < FAST.duration_s


async def test_hold_steps_down_when_renewals_fail_until_the_deadline() -> None:
    kube = FakeKube()
    a = elector(kube, "a", timing=FAST)
    await a.try_acquire()
    kube.fail = lambda op, path: ApiError(status=503, reason="ServiceUnavailable", message="etcd away")
    with pytest.raises(LeadershipLostError, match="renew deadline"):
        await a.hold()


async def test_release_lets_a_stand_by_take_over_at_once() -> None:
    kube, now = FakeKube(), [100.0]
    a = elector(kube, "a", now=now)
    b = elector(kube, "b", now=now)
    await a.try_acquire()
    assert not await b.try_acquire()
    await a.release()
    spec = kube.objects[PATH]["spec"]
    assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == ("", 1, 0)
    assert await b.try_acquire()  # no wait for the old duration
    assert kube.objects[PATH]["spec"]["holderIdentity"] == "b"
    await a.release()  # no longer the holder: nothing written
    assert kube.objects[PATH]["spec"]["holderIdentity"] == "b"
