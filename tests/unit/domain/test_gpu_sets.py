"""Several GPUs per pod: all on one node, each with the asked memory, or a refusal naming the closest."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW, gpu, request, reservation
from tests.unit.domain.strategies import allocation_settings, fleet
from vramshare.domain import (
    Accounting,
    AllocationRequest,
    AllocationSettings,
    Choice,
    Gpu,
    InvalidCountError,
    Policy,
    Refusal,
    choose,
    parse_gpu_count,
    refusal_message,
)

SETTINGS = AllocationSettings(accounting=Accounting(safety_margin_mib=0))


def of(count: int, mib: int) -> AllocationRequest:
    return replace(request(mib), count=count)


def fleet_of_two_nodes() -> list[Gpu]:
    return [
        gpu("GPU-a0", node="node-a", index=0, total=40_960),
        gpu("GPU-a1", node="node-a", index=1, total=40_960, used=30_000),
        gpu("GPU-b0", node="node-b", index=0, total=24_576),
        gpu("GPU-b1", node="node-b", index=1, total=24_576),
        gpu("GPU-b2", node="node-b", index=2, total=24_576, used=20_000),
    ]


def test_two_gpus_come_from_one_node_where_both_have_room() -> None:
    # node-a has the single biggest GPU, but only one of its two has 16 GiB free.
    choice = choose(of(2, 16_384), fleet_of_two_nodes(), [], settings=SETTINGS, now=NOW)
    assert isinstance(choice, Choice)
    assert [g.uuid for g in choice.gpus] == ["GPU-b0", "GPU-b1"]
    assert {g.node for g in choice.gpus} == {"node-b"}


def test_spread_takes_the_set_with_most_headroom_and_binpack_the_least() -> None:
    gpus = [
        gpu("GPU-a0", node="node-a", index=0, total=40_960),
        gpu("GPU-a1", node="node-a", index=1, total=40_960),
        gpu("GPU-b0", node="node-b", index=0, total=16_384),
        gpu("GPU-b1", node="node-b", index=1, total=16_384),
        gpu("GPU-b2", node="node-b", index=2, total=16_384, used=8_000),
    ]
    spread = choose(of(2, 8_192), gpus, [], settings=SETTINGS, now=NOW)
    binpack = choose(of(2, 8_192), gpus, [], settings=replace(SETTINGS, policy=Policy.BINPACK), now=NOW)
    assert isinstance(spread, Choice)
    assert isinstance(binpack, Choice)
    assert [g.uuid for g in spread.gpus] == ["GPU-a0", "GPU-a1"]
    # Best fit: node-b's GPU with 8384 MiB left and one of the 16 GiB ones.
    assert [g.uuid for g in binpack.gpus] == ["GPU-b0", "GPU-b2"]


def test_reservations_count_on_every_gpu_of_the_set() -> None:
    booked = [reservation(20_000, gpu_uuid="GPU-b1", name="other")]
    choice = choose(of(2, 16_384), fleet_of_two_nodes(), booked, settings=SETTINGS, now=NOW)
    assert isinstance(choice, Refusal)


def test_a_set_that_conflicted_is_tried_elsewhere_first() -> None:
    gpus = [gpu(f"GPU-{n}{i}", node=f"node-{n}", index=i) for n in "ab" for i in range(2)]
    first = choose(of(2, 4_096), gpus, [], settings=SETTINGS, now=NOW)
    assert isinstance(first, Choice)
    again = choose(of(2, 4_096), gpus, [], settings=SETTINGS, now=NOW, avoid={first.gpus[1].uuid})
    assert isinstance(again, Choice)
    assert again.gpu.node != first.gpu.node


def test_the_refusal_names_the_node_that_came_closest() -> None:
    refusal = choose(of(3, 16_384), fleet_of_two_nodes(), [], settings=SETTINGS, now=NOW)
    assert isinstance(refusal, Refusal)
    node, verdicts = refusal.closest_node or ("", [])
    assert node == "node-b"
    assert [v.gpu.uuid for v in verdicts] == ["GPU-b0", "GPU-b1"]
    text = refusal_message(refusal, max_sample_age_s=60, retry_hint="Retried later.")
    assert text.startswith(
        "no node has 3 GPUs with 16384 MiB of headroom each for pod airflow/train-model-x; "
        "the closest is node node-b, where 2 of the 3 GPUs needed have room: GPU-b0 (index 0) 24576 MiB, "
        "GPU-b1 (index 1) 24576 MiB."
    )
    nothing = choose(of(2, 50_000), fleet_of_two_nodes(), [], settings=SETTINGS, now=NOW)
    assert isinstance(nothing, Refusal)
    assert "no GPU on any node has that much headroom" in refusal_message(
        nothing, max_sample_age_s=60, retry_hint=""
    )


@given(
    gpus=fleet(),
    count=st.integers(1, 4),
    mib=st.integers(1, 100_000),
    settings=allocation_settings,
)
def test_a_set_is_granted_exactly_when_some_node_has_enough_gpus_that_fit_alone(
    gpus: list[Gpu], count: int, mib: int, settings: AllocationSettings
) -> None:
    alone = choose(request(mib), gpus, [], settings=settings, now=NOW)
    fitting_per_node = Counter(v.gpu.node for v in alone.verdicts if v.fits)
    result = choose(of(count, mib), gpus, [], settings=settings, now=NOW)
    possible = any(n >= count for n in fitting_per_node.values())
    assert isinstance(result, Choice) == possible
    if isinstance(result, Choice):
        chosen = result.gpus
        assert len(chosen) == count == len({g.uuid for g in chosen})
        assert len({g.node for g in chosen}) == 1
        fits = {v.gpu.uuid for v in result.verdicts if v.fits}
        assert {g.uuid for g in chosen} <= fits


@pytest.mark.parametrize(("value", "count"), [("1", 1), ("2", 2), (" 8 ", 8)])
def test_gpu_count_accepts_whole_numbers_up_to_the_limit(value: str, count: int) -> None:
    assert parse_gpu_count(value) == count


@pytest.mark.parametrize("value", ["0", "9", "-1", "2.0", "two", "", "1e1", "00000000000000002"])
def test_gpu_count_refuses_everything_else_naming_the_annotation_value_and_range(value: str) -> None:
    with pytest.raises(InvalidCountError) as caught:
        parse_gpu_count(value)
    assert str(caught.value) == (
        f'annotation "gpu-count" has value {value!r}: expected a whole number of GPUs between 1 and 8, '
        'for example "2" (each GPU gets the memory the memory annotation asks for)'
    )
