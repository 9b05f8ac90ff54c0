"""Tenancy, pure: what a namespace holds, kept up to date by the LedgerIndex one change at a time and
equal to summing the ledger; the quota and pending bounds; refusals remembered for holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW
from vramshare.domain import Gpu, LedgerIndex, Reservation, ReservationPhase
from vramshare.domain.tenancy import (
    Holdings,
    Limit,
    Quota,
    RefusalMemory,
    TenancySettings,
    advertised_mib,
    creator_of,
    holdings_of,
    over_limit,
    pending_of_user,
    why_no_hold,
    with_pods_seen,
)

NAMESPACES = ("a", "b")
USERS = ("alice", "bob", "")
KEYS = [f"k{i}" for i in range(8)]


@st.composite
def bookings(draw: st.DrawFn) -> Reservation:
    phase = draw(st.sampled_from(list(ReservationPhase)))
    queued = phase is ReservationPhase.QUEUED or draw(st.booleans())
    return Reservation(
        name=draw(st.sampled_from(KEYS)),
        namespace=draw(st.sampled_from(NAMESPACES)),
        pod="p",
        mib=draw(st.integers(1, 50_000)),
        node="n",
        gpu_uuid="" if phase is ReservationPhase.QUEUED else draw(st.sampled_from(["GPU-a", "GPU-b"])),
        gpu_index=0,
        phase=phase,
        reserved_at=NOW,
        held_for="task" if phase is ReservationPhase.HELD else "",
        user=draw(st.sampled_from(USERS)),
        queue_entry=queued and phase is not ReservationPhase.HELD,
    )


@pytest.mark.slow
@settings(max_examples=300)
@given(changes=st.lists(st.tuples(st.sampled_from(KEYS), st.none() | bookings()), max_size=40))
def test_the_index_holdings_agree_with_summing_the_ledger(
    changes: list[tuple[str, Reservation | None]],
) -> None:
    index, ledger = LedgerIndex(), {}
    for key, reservation in changes:
        index.put(key, reservation)
        if reservation is None:
            ledger.pop(key, None)
        else:
            ledger[key] = reservation
        for ns in NAMESPACES:
            assert index.holdings(ns) == holdings_of(ledger.values(), ns)
        for user in USERS:
            assert index.pending_of_user(user) == pending_of_user(ledger.values(), user)


def res(mib: int, phase: ReservationPhase, **kw: object) -> Reservation:
    return Reservation(
        name="r",
        namespace="a",
        pod="p",
        mib=mib,
        node="n",
        gpu_uuid="GPU-a",
        gpu_index=0,
        phase=phase,
        reserved_at=NOW,
        **kw,  # type: ignore[arg-type]
    )


def test_each_way_of_holding_is_counted_once_and_ended_ones_not_at_all() -> None:
    ledger = [
        res(1, ReservationPhase.BOUND),
        res(2, ReservationPhase.LOST),
        res(4, ReservationPhase.RESERVED),
        res(8, ReservationPhase.RESERVED, queue_entry=True),  # placed from the queue, its pod gated
        res(16, ReservationPhase.QUEUED, queue_entry=True),
        res(32, ReservationPhase.HELD, held_for="t"),
        res(64, ReservationPhase.RELEASED),
        res(128, ReservationPhase.EXPIRED),
    ]
    assert holdings_of(ledger, "a") == Holdings(
        bound_mib=3, pending_mib=4, queued_mib=24, held_mib=32, holds=1
    )
    assert holdings_of(ledger, "b") == Holdings()


def check(
    holdings: Holdings,
    mib: int,
    *,
    quotas: tuple[Quota, ...] = (),
    user_pending: int = 0,
    credit: int = 0,
    **kw: int,
):  # type: ignore[no-untyped-def]
    return over_limit(
        namespace="a",
        user="alice",
        mib=mib,
        holdings=holdings,
        user_pending_mib=user_pending,
        quotas=quotas,
        settings=TenancySettings(**kw),
        resource="vramshare.io/gpu-mem-mib",
        credit_mib=credit,
    )


@pytest.mark.slow
@given(
    held=st.integers(0, 100_000),
    mib=st.integers(1, 100_000),
    hard=st.integers(0, 200_000),
    credit=st.integers(0, 50_000),
)
def test_the_quota_admits_exactly_up_to_its_hard_limit(held: int, mib: int, hard: int, credit: int) -> None:
    credit = min(credit, held)
    over = check(
        Holdings(bound_mib=held),
        mib,
        quotas=(Quota(name="q", hard_mib=hard),),
        credit=credit,
        max_pending_mib_per_namespace=0,
        max_pending_mib_per_user=0,
    )
    assert (over is None) == (held - credit + mib <= hard)
    if over is not None:
        assert over.limit is Limit.QUOTA
        assert 'ResourceQuota "q"' in over.message
        assert "exceeded quota" in over.message


@given(pending=st.integers(0, 200_000), mib=st.integers(1, 200_000), bound=st.integers(1, 150_000))
def test_pending_is_bounded_but_one_pod_always_passes_alone(pending: int, mib: int, bound: int) -> None:
    over = check(
        Holdings(pending_mib=pending), mib, max_pending_mib_per_namespace=bound, max_pending_mib_per_user=0
    )
    assert (over is None) == (pending == 0 or pending + mib <= bound)
    # So pods that never appear hold at most the bound, or one pod when that is larger.
    if over is None:
        assert pending + mib <= max(bound, mib)


def test_the_user_bound_names_the_user() -> None:
    over = check(Holdings(), 10, user_pending=131_070)
    assert over is not None
    assert over.limit is Limit.PENDING_USER
    assert over.message.startswith("user alice already has 131070 MiB")


def test_holds_per_namespace_and_within_the_quota() -> None:
    s = TenancySettings(max_holds_per_namespace=1)
    assert why_no_hold(mib=10, holdings=Holdings(), quotas=(), settings=s) is None
    assert "its most" in (
        why_no_hold(mib=10, holdings=Holdings(held_mib=5, holds=1), quotas=(), settings=s) or ""
    )
    quota = (Quota(name="q", hard_mib=100),)
    assert why_no_hold(mib=10, holdings=Holdings(bound_mib=90), quotas=quota, settings=s) is None
    assert "ResourceQuota" in (
        why_no_hold(mib=11, holdings=Holdings(bound_mib=90), quotas=quota, settings=s) or ""
    )


def test_a_hold_goes_to_a_task_seen_twice_within_the_window() -> None:
    memory = RefusalMemory(window_s=100, capacity=2)
    assert not memory.refused("t", now=0)
    assert memory.refused("t", now=50)
    assert not memory.refused("u", now=50)
    assert not memory.refused("t", now=151)  # past the window: a first refusal again
    memory.forget("t")
    assert not memory.refused("t", now=152)
    memory.refused("v", now=153)
    memory.refused("w", now=154)  # capacity 2: the oldest is forgotten
    assert not memory.refused("t", now=155)


def test_a_nodes_capacity_is_the_sum_of_its_gpus_present() -> None:
    def g(uuid: str, node: str, total: int, *, missing: bool = False) -> Gpu:
        return Gpu(
            uuid=uuid,
            node=node,
            index=0,
            model="m",
            total_mib=total,
            used_mib=0,
            free_mib=total,
            sampled_at=NOW,
            missing=missing,
        )

    assert advertised_mib(
        [g("a", "n1", 40_000), g("b", "n1", 40_000), g("c", "n2", 16_000, missing=True)]
    ) == {
        "n1": 80_000,
        "n2": 0,
    }


def test_a_booking_whose_pod_appeared_is_not_pending() -> None:
    mine = res(30_000, ReservationPhase.RESERVED, user="alice")
    theirs = replace(mine, name="other", namespace="b", mib=5000, user="alice")
    holdings = holdings_of([mine], "a")
    assert holdings.pending_mib == 30_000
    seen, user_pending = with_pods_seen(
        holdings, [mine, theirs], namespace="a", user="alice", appeared=lambda r: r.name == "r"
    )
    assert (seen.bound_mib, seen.pending_mib, user_pending) == (30_000, 0, 5000)


def test_a_service_account_is_one_creator_per_namespace_a_person_one_across_them() -> None:
    sa = "system:serviceaccount:kube-system:job-controller"
    assert creator_of(sa, "a") != creator_of(sa, "b")
    assert creator_of("alice", "a") == creator_of("alice", "b") == "alice"
    ledger = [
        replace(res(mib, ReservationPhase.RESERVED, user=user), name=f"r{mib}", namespace=namespace)
        for mib, namespace, user in ((100, "a", sa), (200, "b", sa), (300, "a", "alice"), (400, "b", "alice"))
    ]
    index = LedgerIndex()
    for r in ledger:
        index.put(f"{r.namespace}/{r.name}", r)
    for creator, mib in ((creator_of(sa, "a"), 100), (creator_of(sa, "b"), 200), ("alice", 700)):
        assert pending_of_user(ledger, creator) == mib
        assert index.pending_of_user(creator) == mib
