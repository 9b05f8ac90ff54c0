"""LedgerIndex: sums kept one change at a time agree with summing the whole ledger, always."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.domain import builders
from tests.unit.domain.builders import NOW
from tests.unit.domain.strategies import allocation_settings, fleet, requests, reservations
from vramshare.domain import Gpu, LedgerIndex, Reservation, ReservationPhase, choose
from vramshare.domain.headroom import booked, headroom_mib

KEYS = [f"ns/r{i}" for i in range(8)]


@pytest.mark.slow
@settings(max_examples=300)
@given(
    changes=st.lists(st.tuples(st.sampled_from(KEYS), st.none() | reservations()), max_size=40),
    gpus=fleet(),
    ages=st.lists(st.floats(0, 9), min_size=1, max_size=4),
    settle=st.floats(0, 300),
)
def test_the_index_agrees_with_summing_the_ledger(
    changes: list[tuple[str, Reservation | None]], gpus: list[Gpu], ages: list[float], settle: float
) -> None:
    index, ledger = LedgerIndex(), {}
    # Samples only get newer (DCGM's own timestamps): each change is followed by newer ones.
    samples = iter(sorted((NOW - 1_200 + i * 10 + age for i, _ in enumerate(changes) for age in ages)))
    for key, reservation in changes:
        index.put(key, reservation)
        if reservation is None:
            ledger.pop(key, None)
        else:
            ledger[key] = reservation
        for _ in ages:
            sampled_at = next(samples)
            for gpu in gpus:
                at = replace(gpu, sampled_at=sampled_at)
                assert index.booked(at, settle_s=settle) == booked(at, ledger.values(), settle_s=settle)
    active = [r for r in ledger.values() if r.is_active]
    assert len(index) == len(active)


@pytest.mark.slow
@settings(max_examples=200)
@given(
    ledger=st.lists(reservations(), max_size=30), gpus=fleet(), config=allocation_settings, request=requests
)
def test_choose_decides_the_same_from_the_index(
    ledger: list[Reservation], gpus: list[Gpu], config: object, request: object
) -> None:
    index = LedgerIndex()
    for i, r in enumerate(ledger):
        index.put(f"k{i}", r)
    plain = choose(request, gpus, ledger, settings=config, now=NOW)  # type: ignore[arg-type]
    indexed = choose(request, gpus, (), settings=config, now=NOW, index=index)  # type: ignore[arg-type]
    assert plain == indexed
    assert plain.verdicts == indexed.verdicts  # built later, from figures taken at the decision


@pytest.mark.slow
@settings(max_examples=300)
@given(
    changes=st.lists(st.tuples(st.sampled_from(KEYS), st.none() | reservations()), max_size=40),
    gpus=fleet(),
    settle=st.floats(0, 300),
    margin=st.integers(0, 2_048),
    ledger_only=st.booleans(),
)
def test_remembered_figures_follow_every_change_to_the_ledger(
    changes: list[tuple[str, Reservation | None]],
    gpus: list[Gpu],
    settle: float,
    margin: int,
    ledger_only: bool,
) -> None:
    """The same GPU objects asked again after each change (a decision between two samples): what
    the index remembers must never outlive a booking coming or going."""
    index, ledger = LedgerIndex(), {}
    figures = index.figures_by(settle_s=settle, safety_margin_mib=margin)
    for key, reservation in changes:
        index.put(key, reservation)
        if reservation is None:
            ledger.pop(key, None)
        else:
            ledger[key] = reservation
        for gpu in gpus:
            reserved, unseen = booked(gpu, ledger.values(), settle_s=settle)
            room = headroom_mib(
                gpu,
                reserved_mib=reserved,
                unseen_mib=unseen,
                safety_margin_mib=margin,
                ledger_only=ledger_only,
            )
            assert figures(gpu, ledger_only) == (reserved, unseen, room)


def test_pending_bookings_are_counted_per_namespace_as_they_come_and_go() -> None:
    index = LedgerIndex()
    index.put("a", builders.reservation(100, name="a", phase=ReservationPhase.RESERVED))
    index.put("b", builders.reservation(100, name="b", phase=ReservationPhase.RESERVED))
    index.put("c", builders.reservation(100, name="c", phase=ReservationPhase.BOUND))
    assert index.pending_in("airflow") == 2
    index.put("a", builders.reservation(100, name="a", phase=ReservationPhase.BOUND))  # its pod appeared
    index.put("b", None)  # expired and gone
    assert index.pending_in("airflow") == 0
    assert index.pending_in("other") == 0


def test_queue_entries_count_against_the_pending_bound_until_their_pod_is_seen() -> None:
    """Issue #42, 7: a queue entry books nothing, but one whose pod never appears is a record a loop of
    refused creates would otherwise leave without bound."""
    index = LedgerIndex()
    index.put("q1", builders.reservation(100, name="q1", phase=ReservationPhase.QUEUED))
    index.put("q2", builders.reservation(100, name="q2", phase=ReservationPhase.QUEUED))
    index.put("r", builders.reservation(100, name="r", phase=ReservationPhase.RESERVED))
    assert index.pending_in("airflow") == 3
    index.put(
        "q1", replace(builders.reservation(100, name="q1", phase=ReservationPhase.QUEUED), pod_seen=True)
    )
    assert index.pending_in("airflow") == 2
    index.put("q2", builders.reservation(100, name="q2", phase=ReservationPhase.EXPIRED))  # never came
    index.put("r", None)
    assert index.pending_in("airflow") == 0
