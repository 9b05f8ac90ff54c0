"""The inventory heartbeat (issue #31): what it confirms, and that applying it only ever dates a GPU
later, never changes its figures, and never outruns the device view it is applied to."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW, gpu, reservation
from vramshare.domain.freshness import (
    MAX_UNCONFIRMED,
    HeartbeatView,
    InventoryHeartbeat,
    compose_heartbeat,
    with_heartbeat,
)
from vramshare.domain.headroom import is_unseen


def beat(at: float, version: int, *unconfirmed: str) -> InventoryHeartbeat:
    return InventoryHeartbeat(sampled_at=at, devices_version=version, unconfirmed=frozenset(unconfirmed))


def test_a_heartbeat_is_dated_by_its_oldest_confirmed_sample_and_names_the_rest() -> None:
    made = compose_heartbeat(
        confirmed={"GPU-a": NOW + 10, "GPU-b": NOW + 8, "GPU-lagging": NOW - 40},
        known=["GPU-a", "GPU-b", "GPU-lagging", "GPU-stale"],
        devices_version=42,
        window_s=30,
    )
    assert made == beat(NOW + 8, 42, "GPU-lagging", "GPU-stale")


def test_no_heartbeat_with_nothing_confirmed_or_too_much_unconfirmed() -> None:
    assert compose_heartbeat(confirmed={}, known=["GPU-a"], devices_version=1, window_s=30) is None
    many = [f"GPU-{i}" for i in range(MAX_UNCONFIRMED + 1)]
    assert (
        compose_heartbeat(confirmed={"GPU-a": NOW}, known=["GPU-a", *many], devices_version=1, window_s=30)
        is None
    )


def test_a_heartbeat_dates_a_confirmed_gpu_later_and_leaves_the_others_as_they_are() -> None:
    old = gpu("GPU-a", sampled_at=NOW - 100, used=2_000)
    dated = with_heartbeat(old, beat(NOW, 5))
    assert dated.sampled_at == NOW
    assert replace(dated, sampled_at=old.sampled_at) == old  # the figures are untouched
    assert with_heartbeat(old, beat(NOW, 5, "GPU-a")) is old  # unconfirmed
    assert with_heartbeat(old, beat(NOW - 200, 5)) is old  # older than the GPU's own sample
    assert with_heartbeat(old, None) is old


@given(
    own=st.floats(min_value=0, max_value=1e6),
    heartbeat_at=st.floats(min_value=0, max_value=1e6),
    unconfirmed=st.booleans(),
    started=st.floats(min_value=0, max_value=1e6),
    settle=st.floats(min_value=0, max_value=100),
)
def test_a_heartbeat_never_dates_earlier_nor_shows_a_booking_its_own_sample_could_not(
    own: float, heartbeat_at: float, unconfirmed: bool, started: float, settle: float
) -> None:
    """The dated GPU's time is never before its own; a booking it counts as visible in used memory is
    one whose pod started before a sample that confirmed these figures (the GPU's own, or the
    heartbeat's, which re-read them)."""
    g = gpu("GPU-a", sampled_at=own)
    heartbeat = beat(heartbeat_at, 1, *(("GPU-a",) if unconfirmed else ()))
    dated = with_heartbeat(g, heartbeat)
    assert dated.sampled_at >= own
    assert dated.sampled_at in (own, heartbeat_at)
    if unconfirmed:
        assert dated is g
    r = reservation(1_000, running_since=started)
    if not is_unseen(r, sampled_at=dated.sampled_at, settle_s=settle):
        confirmed_at = own if dated is g else heartbeat_at
        assert started + settle <= confirmed_at


def test_a_reader_applies_a_heartbeat_only_once_its_device_view_holds_what_it_confirms() -> None:
    """The webhook follows the Lease and the GpuDevices on two streams: a heartbeat from a poll whose
    status writes its device stream has not brought yet would date the old figures with the new time."""
    view = HeartbeatView()
    first, second = beat(NOW, 10), beat(NOW + 5, 20)
    view.offer(first)
    assert view.current(devices_seen_to=9) is None
    assert view.current(devices_seen_to=10) is first
    view.offer(second)
    assert view.current(devices_seen_to=15) is first  # the last one that applied stands meanwhile
    assert view.for_read(devices_version=25) is second  # a consistent read at 25 holds its writes
    assert view.current(devices_seen_to=15) is first  # ...and leaves the live view's as it was
    assert view.current(devices_seen_to=20) is second
    view.offer(first)  # an older statement (a stale cache) does not go back
    assert view.current(devices_seen_to=30) is second
    view.offer(None)
    assert view.current(devices_seen_to=30) is second
