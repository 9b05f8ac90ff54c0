"""Invariants of headroom and allocation, checked over generated fleets and ledgers."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW
from tests.unit.domain.strategies import (
    allocation_settings,
    booked_by_definition,
    fleet,
    gpus,
    requests,
    reservations,
)
from vramshare.domain import (
    AllocationRequest,
    AllocationSettings,
    Choice,
    Exclusion,
    Gpu,
    LedgerIndex,
    Policy,
    Refusal,
    Reservation,
    ReservationPhase,
    choose,
    has_room_for_its_bookings,
    headroom,
)


@pytest.mark.slow
@given(
    gpu=gpus(),
    ledger=st.lists(reservations(), max_size=12),
    settle=st.floats(0, 300),
    margin=st.integers(0, 2_048),
)
def test_headroom_never_exceeds_either_bound(
    gpu: Gpu, ledger: list[Reservation], settle: float, margin: int
) -> None:
    room = headroom(gpu, ledger, settle_s=settle, safety_margin_mib=margin)
    r_all = booked_by_definition(gpu, ledger)
    assert room.reserved_mib == r_all
    assert 0 <= room.unseen_mib <= r_all
    assert room.headroom_mib <= gpu.total_mib - r_all - margin
    assert room.headroom_mib <= gpu.free_mib - room.unseen_mib - margin


@pytest.mark.slow
@given(
    gpu=gpus(),
    ledger=st.lists(reservations(), max_size=12),
    extra=reservations(),
    settle=st.floats(0, 300),
    ledger_only=st.booleans(),
)
def test_adding_a_reservation_never_increases_headroom(
    gpu: Gpu, ledger: list[Reservation], extra: Reservation, settle: float, ledger_only: bool
) -> None:
    # A settled booking inside a grant may: its usage is in the sample, and the grant's remainder
    # (unseen) gave up as much. `test_a_booking_inside_a_grant...` covers those.
    assume(not extra.grant)
    before = headroom(gpu, ledger, settle_s=settle, safety_margin_mib=0, ledger_only=ledger_only)
    after = headroom(gpu, [*ledger, extra], settle_s=settle, safety_margin_mib=0, ledger_only=ledger_only)
    assert after.headroom_mib <= before.headroom_mib


@pytest.mark.slow
@settings(max_examples=300)
@given(
    request=requests, fleet=fleet(), ledger=st.lists(reservations(), max_size=12), config=allocation_settings
)
def test_choice_fits_and_follows_the_policy(
    request: AllocationRequest, fleet: list[Gpu], ledger: list[Reservation], config: AllocationSettings
) -> None:
    decision = choose(request, fleet, ledger, settings=config, now=NOW)
    # Every GPU gets exactly one verdict, in either outcome.
    assert sorted(v.gpu.uuid for v in decision.verdicts) == sorted(g.uuid for g in fleet)
    fitting = [v.headroom.headroom_mib for v in decision.verdicts if v.fits and v.headroom]
    if isinstance(decision, Choice):
        assert decision.headroom.headroom_mib >= request.mib
        assert not decision.gpu.missing
        assert decision.gpu.healthy
        if request.nodes is not None:
            assert decision.gpu.node in request.nodes
        expected = max(fitting) if config.policy is Policy.SPREAD else min(fitting)
        assert decision.headroom.headroom_mib == expected
    else:
        assert isinstance(decision, Refusal)
        assert fitting == []
        for v in decision.verdicts:
            assert v.excluded is not None
            if v.excluded is Exclusion.TOO_SMALL:
                assert v.headroom is not None
                assert v.headroom.headroom_mib < request.mib


@pytest.mark.slow
@given(
    request=requests, fleet=fleet(), ledger=st.lists(reservations(), max_size=12), config=allocation_settings
)
def test_choose_is_deterministic_under_reordering(
    request: AllocationRequest, fleet: list[Gpu], ledger: list[Reservation], config: AllocationSettings
) -> None:
    a = choose(request, fleet, ledger, settings=config, now=NOW)
    b = choose(request, list(reversed(fleet)), list(reversed(ledger)), settings=config, now=NOW)
    assert type(a) is type(b)
    if isinstance(a, Choice) and isinstance(b, Choice):
        assert a.gpu.uuid == b.gpu.uuid


@pytest.mark.slow
@settings(max_examples=200)
@given(
    fleet=fleet(), sizes=st.lists(st.integers(1, 30_000), min_size=1, max_size=30), config=allocation_settings
)
def test_admitting_one_after_another_never_overbooks_a_gpu(
    fleet: list[Gpu], sizes: list[int], config: AllocationSettings
) -> None:
    """Replaying admissions through choose(), the ledger stays within total - margin on every GPU."""
    ledger: list[Reservation] = []
    for i, mib in enumerate(sizes):
        req = AllocationRequest(mib=mib, namespace="ns", pod=f"p{i}")
        decision = choose(req, fleet, ledger, settings=config, now=NOW)
        if isinstance(decision, Choice):
            ledger.append(
                Reservation(
                    name=f"r{i}",
                    namespace="ns",
                    pod=f"p{i}",
                    mib=mib,
                    node=decision.gpu.node,
                    gpu_uuid=decision.gpu.uuid,
                    gpu_index=decision.gpu.index,
                    phase=ReservationPhase.RESERVED,
                    reserved_at=NOW,
                )
            )
    for gpu in fleet:
        booked = sum(r.mib for r in ledger if r.gpu_uuid == gpu.uuid)
        assert booked <= max(0, gpu.total_mib - config.accounting.safety_margin_mib)
        # Fresh metrics: nothing unseen may exceed the live free memory either.
        if booked and NOW - gpu.sampled_at <= config.accounting.max_sample_age_s:
            assert booked <= gpu.free_mib - config.accounting.safety_margin_mib


@pytest.mark.slow
@settings(max_examples=500)
@given(
    gpu=gpus(),
    ledger=st.lists(reservations(), max_size=12, unique_by=lambda r: r.name),
    mib=st.integers(1, 100_000),
    config=allocation_settings,
)
def test_a_gpu_has_room_for_a_booking_exactly_when_a_decision_would_have_chosen_it(
    gpu: Gpu, ledger: list[Reservation], mib: int, config: AllocationSettings
) -> None:
    """A commit that lost its race stands on the newer token only where `has_room_for_its_bookings`
    says so; that is safe because it agrees with deciding afresh on the same ledger."""
    request = AllocationRequest(mib=mib, namespace="ns", pod="p")
    fresh = choose(request, [gpu], ledger, settings=config, now=NOW)
    booking = Reservation(
        name="the-booking",
        namespace="ns",
        pod="p",
        mib=mib,
        node=gpu.node,
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        phase=ReservationPhase.RESERVED,
        reserved_at=NOW,
    )
    index = LedgerIndex()
    for r in [*ledger, booking]:
        index.put(r.name, r)
    stands = has_room_for_its_bookings(gpu, index, accounting=config.accounting, now=NOW)
    assert stands == isinstance(fresh, Choice)
