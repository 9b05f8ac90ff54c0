"""The API server's clock from the Date of its answers: offset, resolution, bad headers."""

from __future__ import annotations

from email.utils import formatdate

from hypothesis import given
from hypothesis import strategies as st

from vramshare.kube.server_clock import ServerClock


def date_of(server_time: float) -> str:
    return formatdate(server_time, usegmt=True)  # whole seconds, as the API server writes it


@given(
    offset=st.floats(min_value=-3600, max_value=3600),
    start=st.floats(min_value=1.7e9, max_value=1.9e9),
    rtt=st.floats(min_value=0.0, max_value=0.2),
)
def test_the_offset_is_found_within_half_a_second_and_half_the_round_trip(
    offset: float, start: float, rtt: float
) -> None:
    clock = ServerClock(local=lambda: start + 100.0)
    for n in range(5):
        sent = start + n * 0.37
        answered = sent + rtt / 2  # the server wrote Date halfway through the round trip
        clock.observe(date_of(answered + offset), sent=sent, received=sent + rtt)
    assert abs(clock.offset_s - offset) <= 0.5 + rtt / 2 + 1e-6
    assert abs(clock.now() - (start + 100.0 + offset)) <= 0.5 + rtt / 2 + 1e-6


def test_missing_or_malformed_dates_change_nothing() -> None:
    clock = ServerClock(local=lambda: 1_800_000_000.0)
    for bad in (None, "", "yesterday", "Mon, 99 Foo 2026 99:99:99 GMT"):
        clock.observe(bad, sent=1_800_000_000.0, received=1_800_000_000.1)
    assert clock.offset_s == 0.0
    assert clock.now() == 1_800_000_000.0


def test_one_stale_answer_does_not_move_the_estimate() -> None:
    clock = ServerClock()
    for n in range(10):
        clock.observe(date_of(1_800_000_020.0 + n), sent=1_800_000_000.0 + n, received=1_800_000_000.0 + n)
    clock.observe(date_of(1_800_000_000.0), sent=1_800_000_100.0, received=1_800_000_100.0)  # a proxy's cache
    assert abs(clock.offset_s - 20.5) < 0.01
