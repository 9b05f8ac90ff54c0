"""Refuse mode's fairness: holds, the credit a task gets for its own hold, Retry-After from releases."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW, gpu, request, reservation
from vramshare.domain import (
    Accounting,
    AllocationSettings,
    Choice,
    FairnessSettings,
    LedgerIndex,
    Refusal,
    ReleaseLog,
    ReservationPhase,
    choose,
    gpu_to_hold,
    retry_after_s,
)

SETTINGS = AllocationSettings(accounting=Accounting(safety_margin_mib=0, settle_s=0))
FAIR = FairnessSettings(hold_min_mib=10_000, hold_limit_s=600)


def hold(mib: int, gpu_uuid: str, task: str = "t-big") -> object:
    return replace(
        reservation(mib, gpu_uuid=gpu_uuid, name=f"hold-{task}", phase=ReservationPhase.HELD), held_for=task
    )


def refused(mib: int, gpus: list, ledger: list) -> Refusal:  # type: ignore[type-arg]
    decision = choose(request(mib), gpus, ledger, settings=SETTINGS, now=NOW)
    assert isinstance(decision, Refusal)
    return decision


def test_the_hold_goes_to_the_gpu_closest_to_fitting_that_holds_nothing_yet() -> None:
    a = gpu("GPU-a", total=16_384, used=12_000)
    b = gpu("GPU-b", index=1, total=40_960, used=30_000)
    c = gpu("GPU-c", index=2, total=8_192)
    refusal = refused(12_000, [a, b, c], [])
    assert gpu_to_hold(refusal, held=set(), settings=SETTINGS, fairness=FAIR) == b  # 10960 free, the most
    assert gpu_to_hold(refusal, held={"GPU-b"}, settings=SETTINGS, fairness=FAIR) == a
    assert (
        gpu_to_hold(refusal, held={"GPU-a", "GPU-b"}, settings=SETTINGS, fairness=FAIR) is None
    )  # c too small
    small = refused(9_000, [gpu("GPU-a", total=16_384, used=16_000)], [])
    assert gpu_to_hold(small, held=set(), settings=SETTINGS, fairness=FAIR) is None  # below hold_min_mib


def test_a_hold_counts_against_everyone_but_its_own_task() -> None:
    card = gpu("GPU-a", total=16_384)
    held = [hold(12_000, "GPU-a")]
    assert isinstance(choose(request(8_000), [card], held, settings=SETTINGS, now=NOW), Refusal)
    own = choose(request(12_000), [card], held, settings=SETTINGS, now=NOW, credit={"GPU-a": 12_000})
    assert isinstance(own, Choice)
    assert own.headroom.headroom_mib == 16_384


def test_the_ledger_index_finds_holds_by_task_and_gpu() -> None:
    index = LedgerIndex()
    index.put("ns/hold-1", hold(12_000, "GPU-a"))  # type: ignore[arg-type]
    index.put("ns/r1", reservation(2_000, gpu_uuid="GPU-b"))
    assert [h.gpu_uuid for h in index.holds_for("t-big")] == ["GPU-a"]
    assert index.held_gpus() == {"GPU-a"}
    index.put("ns/hold-1", None)
    assert index.holds_for("t-big") == []
    assert index.held_gpus() == set()


def test_the_release_log_forgets_what_left_its_window() -> None:
    log = ReleaseLog(window_s=100)
    log.add(at=0, gpu_uuid="GPU-a", mib=1_000)
    log.add(at=50, gpu_uuid="GPU-b", mib=3_000)
    assert log.rate_mib_per_s(now=60) == 40.0
    assert log.rate_mib_per_s(now=60, gpu_uuid="GPU-a") == 10.0
    assert log.rate_mib_per_s(now=120) == 30.0  # the first release is older than the window


@given(
    deficit=st.integers(-1_000, 100_000),
    rate=st.floats(0, 10_000, allow_nan=False),
    floor=st.integers(1, 30),
    extra=st.integers(0, 300),
)
def test_retry_after_stays_within_its_bounds(deficit: int, rate: float, floor: int, extra: int) -> None:
    ceiling = floor + extra
    value = retry_after_s(deficit_mib=deficit, rate_mib_per_s=rate, floor_s=floor, ceiling_s=ceiling)
    assert floor <= value <= ceiling
    if rate == 0 and deficit > 0:
        assert value == ceiling
