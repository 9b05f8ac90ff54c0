"""choose(): policies, exclusions, node constraints, tie-breaks."""

from __future__ import annotations

import pytest

from tests.unit.domain.builders import NOW, gpu, request, reservation
from vramshare.domain import (
    Accounting,
    AllocationSettings,
    Choice,
    Exclusion,
    Policy,
    Refusal,
    StaleGpuMode,
    choose,
)

NO_MARGIN = AllocationSettings(accounting=Accounting(safety_margin_mib=0))


def fleet() -> list:
    return [
        gpu("GPU-big", node="node-a", index=0, total=40_960),
        gpu("GPU-mid", node="node-a", index=1, total=24_576),
        gpu("GPU-small", node="node-b", index=0, total=16_384),
    ]


def test_spread_takes_the_gpu_with_the_most_headroom() -> None:
    decision = choose(request(4_096), fleet(), [], settings=NO_MARGIN, now=NOW)
    assert isinstance(decision, Choice)
    assert decision.gpu.uuid == "GPU-big"
    assert decision.headroom.headroom_mib == 40_960


def test_binpack_takes_the_smallest_gpu_that_fits() -> None:
    settings = AllocationSettings(policy=Policy.BINPACK, accounting=Accounting(safety_margin_mib=0))
    decision = choose(request(20_000), fleet(), [], settings=settings, now=NOW)
    assert isinstance(decision, Choice)
    assert decision.gpu.uuid == "GPU-mid"


def test_reservations_move_spread_to_another_gpu() -> None:
    busy = [reservation(30_000, gpu_uuid="GPU-big")]
    decision = choose(request(4_096), fleet(), busy, settings=NO_MARGIN, now=NOW)
    assert isinstance(decision, Choice)
    assert decision.gpu.uuid == "GPU-mid"


@pytest.mark.parametrize("policy", list(Policy))
def test_ties_break_by_node_then_index_then_uuid(policy: Policy) -> None:
    twins = [
        gpu("GPU-z", node="node-b", index=0),
        gpu("GPU-y", node="node-a", index=1),
        gpu("GPU-x", node="node-a", index=0),
    ]
    settings = AllocationSettings(policy=policy, accounting=Accounting(safety_margin_mib=0))
    decision = choose(request(1_000), twins, [], settings=settings, now=NOW)
    assert isinstance(decision, Choice)
    assert decision.gpu.uuid == "GPU-x"


def test_node_constraint_limits_candidates() -> None:
    decision = choose(request(1_000, node="node-b"), fleet(), [], settings=NO_MARGIN, now=NOW)
    assert isinstance(decision, Choice)
    assert decision.gpu.uuid == "GPU-small"
    others = {v.gpu.uuid: v.excluded for v in decision.verdicts if v.gpu.uuid != "GPU-small"}
    assert others == {"GPU-big": Exclusion.OTHER_NODE, "GPU-mid": Exclusion.OTHER_NODE}


def test_refusal_explains_every_gpu() -> None:
    gpus = [
        gpu("GPU-1", index=0, total=16_384),
        gpu("GPU-2", index=1, sampled_at=NOW - 1_000),
        gpu("GPU-3", index=2, missing=True),
        gpu("GPU-4", index=3, healthy=False),
    ]
    decision = choose(request(20_000), gpus, [], settings=NO_MARGIN, now=NOW)
    assert isinstance(decision, Refusal)
    assert {v.gpu.uuid: v.excluded for v in decision.verdicts} == {
        "GPU-1": Exclusion.TOO_SMALL,
        "GPU-2": Exclusion.STALE,
        "GPU-3": Exclusion.MISSING,
        "GPU-4": Exclusion.UNHEALTHY,
    }
    assert decision.best_headroom_mib == 16_384


def test_stale_gpu_is_refused_by_default() -> None:
    stale = gpu(sampled_at=NOW - 121)
    decision = choose(request(1_000), [stale], [], settings=NO_MARGIN, now=NOW)
    assert isinstance(decision, Refusal)
    assert decision.verdicts[0].excluded is Exclusion.STALE
    assert decision.verdicts[0].sample_age_s == pytest.approx(121)


def test_stale_gpu_counted_by_ledger_when_configured() -> None:
    settings = AllocationSettings(
        accounting=Accounting(safety_margin_mib=0, stale_mode=StaleGpuMode.LEDGER_ONLY)
    )
    stale = gpu(total=16_384, used=16_000, sampled_at=NOW - 1_000)
    decision = choose(request(10_000), [stale], [reservation(4_000)], settings=settings, now=NOW)
    assert isinstance(decision, Choice)
    assert decision.headroom.ledger_only
    assert decision.headroom.headroom_mib == 16_384 - 4_000


def test_sample_exactly_at_max_age_is_still_fresh() -> None:
    g = gpu(sampled_at=NOW - 120)
    assert isinstance(choose(request(1), [g], [], settings=NO_MARGIN, now=NOW), Choice)


def test_request_equal_to_headroom_fits() -> None:
    g = gpu(total=16_384)
    settings = AllocationSettings(accounting=Accounting(safety_margin_mib=384))
    assert isinstance(choose(request(16_000), [g], [], settings=settings, now=NOW), Choice)
    assert isinstance(choose(request(16_001), [g], [], settings=settings, now=NOW), Refusal)


def test_no_gpus_is_a_refusal_without_verdicts() -> None:
    decision = choose(request(1), [], [], settings=NO_MARGIN, now=NOW)
    assert isinstance(decision, Refusal)
    assert decision.verdicts == ()
    assert decision.best_headroom_mib is None


def test_several_allowed_nodes_limit_candidates() -> None:
    decision = choose(
        request(1_000, nodes=frozenset({"node-b", "node-x"})), fleet(), [], settings=NO_MARGIN, now=NOW
    )
    assert isinstance(decision, Choice)
    assert decision.gpu.uuid == "GPU-small"


def test_near_ties_go_to_each_replicas_own_preference() -> None:
    gpus = [gpu(f"GPU-{i}", index=i, total=16_384, used=i * 100) for i in range(4)]  # headroom 16384..16084
    far = gpu("GPU-far", index=9, total=8_192)  # 8 GiB less: never tied with the best
    settings = AllocationSettings(accounting=Accounting(safety_margin_mib=0), near_tie_mib=512)
    picks = {
        choose(request(1_000), [*gpus, far], [], settings=settings, now=NOW, prefer=f"replica-{r}").gpu.uuid  # type: ignore[union-attr]
        for r in range(8)
    }
    assert len(picks) > 1, "replicas should not all prefer the same GPU"
    assert "GPU-far" not in picks
    # The same replica always decides the same way.
    again = choose(request(1_000), [*gpus, far], [], settings=settings, now=NOW, prefer="replica-0")
    first = choose(request(1_000), [*gpus, far], [], settings=settings, now=NOW, prefer="replica-0")
    assert isinstance(again, Choice)
    assert isinstance(first, Choice)
    assert again.gpu == first.gpu
    # Without a preference, or with no tolerance, the strict policy.
    strict = choose(request(1_000), [*gpus, far], [], settings=NO_MARGIN, now=NOW, prefer="replica-3")
    assert isinstance(strict, Choice)
    assert strict.gpu.uuid == "GPU-0"
