"""Grants (`vramshare.domain.grants`): what a reader counts, what a booking inside one changes, the
holder's rules, and the index agreeing with the definition."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.unit.domain import builders
from tests.unit.domain.builders import NOW
from tests.unit.domain.strategies import booked_by_definition, gpus, reservations
from vramshare.domain import Gpu, LedgerIndex, PodState, Reservation, ReservationPhase, next_phase
from vramshare.domain.grants import GrantTerms, grant_size, granted_by_gpu, lapsed, relieves, takes
from vramshare.domain.headroom import booked
from vramshare.domain.tenancy import Holdings, awaits_its_pod, holding_of

GPU = "GPU-a"


def grant(mib: int, *, name: str = "grant-1", gpu_uuid: str = GPU) -> Reservation:
    return replace(
        builders.reservation(mib, name=name, gpu_uuid=gpu_uuid, phase=ReservationPhase.GRANTED), pod=""
    )


def inside(
    mib: int, *, name: str, of: str = "airflow/grant-1", running_since: float | None = None
) -> Reservation:
    phase = ReservationPhase.RESERVED if running_since is None else ReservationPhase.BOUND
    return replace(builders.reservation(mib, name=name, phase=phase, running_since=running_since), grant=of)


def _gpu() -> Gpu:
    return Gpu(
        uuid=GPU,
        node="node-a",
        index=0,
        model="fake",
        total_mib=80_000,
        used_mib=0,
        free_mib=80_000,
        sampled_at=NOW,
        healthy=True,
    )


def test_a_grant_counts_what_its_bookings_do_not_use_yet() -> None:
    g = _gpu()
    assert booked(g, [grant(8_000)], settle_s=30) == (8_000, 8_000)
    ledger = [grant(8_000), inside(1_000, name="a"), inside(2_000, name="b")]
    assert booked(g, ledger, settle_s=30) == (8_000, 8_000)  # 3 000 in pods not started + 5 000 left
    settled = [grant(8_000), inside(1_000, name="a", running_since=NOW - 600)]
    assert booked(g, settled, settle_s=30) == (8_000, 7_000)  # its usage shows in the sample
    # Over-filled (the holder never does this): each booking counts, the grant nothing more.
    over = [grant(1_000), inside(800, name="a"), inside(800, name="b")]
    assert booked(g, over, settle_s=30) == (1_600, 1_600)
    # Once the grant ends, its bookings count on their own.
    assert booked(g, ledger[1:], settle_s=30) == (3_000, 3_000)
    # A booking naming a grant on another GPU, or none that exists, is an ordinary booking.
    elsewhere = [grant(8_000, gpu_uuid="GPU-b"), inside(1_000, name="a")]
    assert booked(g, elsewhere, settle_s=30) == (1_000, 1_000)


def test_a_grant_belongs_to_no_namespace_and_waits_for_no_pod() -> None:
    g = grant(8_000)
    assert holding_of(g) is None
    assert not awaits_its_pod(g)
    index = LedgerIndex()
    index.put("airflow/grant-1", g)
    assert index.holdings("airflow") == Holdings()
    assert index.pending_in("airflow") == 0
    assert index.pending_bookings() == []


def test_a_grant_lapses_only_unrenewed_and_ignores_pods() -> None:
    terms = GrantTerms(pods=8, lasts_s=15, margin_s=2)
    for pod in PodState:
        assert (
            next_phase(
                phase=ReservationPhase.GRANTED,
                pod=pod,
                gpu_missing=True,
                age_s=16.9,
                ttl_s=1,
                grant_lapses_after_s=terms.lapses_after_s,
            )
            is None
        )
    ended = next_phase(
        phase=ReservationPhase.GRANTED,
        pod=PodState.ABSENT,
        gpu_missing=False,
        age_s=17,
        ttl_s=1,
        grant_lapses_after_s=terms.lapses_after_s,
    )
    assert ended is not None
    assert ended.phase is ReservationPhase.EXPIRED
    assert ended.reason == "GrantLapsed"
    assert "17 s" in ended.message
    assert lapsed(unrenewed_s=17, lasts_s=15, margin_s=2)
    assert not lapsed(unrenewed_s=16.9, lasts_s=15, margin_s=2)


def test_the_holder_stops_before_the_controller_ends_it() -> None:
    terms = GrantTerms(pods=8, lasts_s=15, margin_s=2)
    assert terms.usable_for_s == 13
    assert terms.lapses_after_s == 17
    assert terms.renew_every_s == 5
    assert terms.usable_for_s + 2 * terms.margin_s == terms.lapses_after_s


def test_grant_size_takes_at_most_a_quarter_of_the_room_left_and_holds_a_pod() -> None:
    terms = GrantTerms(pods=8)
    assert grant_size(terms=terms, pod_mib=1_000, room_left_mib=70_000) == 8_000
    assert grant_size(terms=terms, pod_mib=1_000, room_left_mib=20_000) == 5_000
    assert grant_size(terms=terms, pod_mib=1_000, room_left_mib=3_999) == 0  # not one more pod
    assert grant_size(terms=GrantTerms(pods=0), pod_mib=1_000, room_left_mib=70_000) == 0
    assert takes(grant_mib=8_000, inside_mib=7_000, pod_mib=1_000)
    assert not takes(grant_mib=8_000, inside_mib=7_001, pod_mib=1_000)


@pytest.mark.slow
@settings(max_examples=300)
@given(
    gpu=gpus(),
    ledger=st.lists(reservations(), max_size=12),
    granted=st.integers(1, 60_000),
    pod=st.integers(1, 60_000),
    settle=st.floats(0, 300),
)
def test_a_booking_inside_a_grant_that_takes_it_changes_no_figure(
    gpu: Gpu, ledger: list[Reservation], granted: int, pod: int, settle: float
) -> None:
    """The reason the holder needs no token bump: any reader, whatever else it sees, computes the same
    reserved and unseen MiB for the GPU with the new booking as without it."""
    holder_grant = replace(grant(granted, name="held", gpu_uuid=gpu.uuid), namespace="ns")
    ledger = [r for r in ledger if r.key != holder_grant.key and r.grant != holder_grant.key]
    made = [*ledger, holder_grant]
    used = sum(r.mib for r in made if r.is_active and r.grant == holder_grant.key)
    assume(takes(grant_mib=granted, inside_mib=used, pod_mib=pod))
    new = replace(inside(pod, name="new", of=holder_grant.key), namespace="ns", gpu_uuid=gpu.uuid)
    assert booked(gpu, [*made, new], settle_s=settle) == booked(gpu, made, settle_s=settle)


@pytest.mark.slow
@settings(max_examples=300)
@given(
    gpu=gpus(),
    ledger=st.lists(reservations(), max_size=14),
    missed=st.sets(st.integers(0, 13)),
    settle=st.floats(0, 300),
)
def test_a_reader_that_misses_bookings_inside_grants_never_counts_less(
    gpu: Gpu, ledger: list[Reservation], missed: set[int], settle: float
) -> None:
    """A reader's view may lag behind a holder's creates: as long as every grant holds what is inside
    it (the holder's rule), what the reader has not seen is still counted, as the remainder."""
    for key in {r.key for r in ledger if r.phase is ReservationPhase.GRANTED}:
        granted = sum(
            r.mib
            for r in ledger
            if r.is_active and r.phase is ReservationPhase.GRANTED and r.key == key and r.gpu_uuid == gpu.uuid
        )
        used = sum(
            r.mib
            for r in ledger
            if r.is_active
            and r.grant == key
            and r.gpu_uuid == gpu.uuid
            and r.phase is not ReservationPhase.GRANTED
        )
        assume(used <= granted or granted == 0)
    seen = [
        r
        for i, r in enumerate(ledger)
        if not (
            i in missed
            and r.grant
            and r.phase is not ReservationPhase.GRANTED
            and any(
                g.phase is ReservationPhase.GRANTED
                and g.key == r.grant
                and g.gpu_uuid == r.gpu_uuid
                and g.is_active
                for g in ledger
            )
        )
    ]
    full = booked(gpu, ledger, settle_s=settle)
    lagging = booked(gpu, seen, settle_s=settle)
    assert lagging[0] >= full[0]
    assert lagging[1] >= full[1]


@pytest.mark.slow
@settings(max_examples=300)
@given(changes=st.lists(st.none() | reservations(), max_size=40), gpu=gpus(), settle=st.floats(0, 300))
def test_the_index_counts_grants_by_their_definition(
    changes: list[Reservation | None], gpu: Gpu, settle: float
) -> None:
    index, ledger = LedgerIndex(), {}
    names = iter(range(10**6))
    for change in changes:
        key = next(iter(ledger), None) if change is None else change.key
        if key is None:
            continue
        index.put(key, change)
        if change is None:
            ledger.pop(key, None)
        else:
            ledger[key] = change
        at = replace(gpu, sampled_at=NOW + next(names))
        assert index.booked(at, settle_s=settle)[0] == booked_by_definition(at, list(ledger.values()))
        assert index.booked(at, settle_s=settle) == booked(at, ledger.values(), settle_s=settle)
    for key, r in ledger.items():
        if r.is_active and r.phase is ReservationPhase.GRANTED:
            left = index.grant_remainder(key, r.gpu_uuid)
            assert left is not None
            assert left >= 0


def test_what_grants_hold_is_summed_per_gpu_for_messages() -> None:
    ledger = [
        grant(8_000),
        inside(3_000, name="a"),
        grant(2_000, name="grant-2", gpu_uuid="GPU-b"),
        replace(grant(4_000, name="grant-3"), phase=ReservationPhase.EXPIRED),  # ended: holds nothing
        grant(1_000, name="grant-4"),
        inside(1_500, name="b", of="airflow/grant-4"),  # over-filled: holds nothing more
    ]
    assert granted_by_gpu(ledger) == {GPU: 5_000, "GPU-b": 2_000}


def test_a_grant_is_given_back_once_it_holds_more_than_its_gpu_has_left_for_others() -> None:
    assert not relieves(remainder_mib=3_000, room_for_others_mib=3_000)
    assert relieves(remainder_mib=3_000, room_for_others_mib=2_999)
    assert not relieves(remainder_mib=0, room_for_others_mib=0)  # full: nothing held back
