"""The refusal message an Airflow user reads."""

from __future__ import annotations

from tests.unit.domain.builders import NOW, gpu, request, reservation
from vramshare.domain import AllocationSettings, Refusal, ReservationPhase, choose, refusal_message

HINT = "The pod was not created; Airflow retries the task after its retry_delay."


def refuse(mib: int, gpus: list, reservations: list | None = None, *, node: str | None = None) -> str:
    decision = choose(
        request(mib, node=node), gpus, reservations or [], settings=AllocationSettings(), now=NOW
    )
    assert isinstance(decision, Refusal)
    return refusal_message(decision, max_sample_age_s=120, retry_hint=HINT)


def test_message_says_what_was_asked_the_best_headroom_each_gpu_and_the_retry() -> None:
    gpus = [
        gpu("GPU-1", index=0, total=16_384, used=2_000),
        gpu("GPU-2", index=1, sampled_at=NOW - 300),
        gpu("GPU-3", index=2, missing=True),
    ]
    held = [reservation(4_000, gpu_uuid="GPU-1", phase=ReservationPhase.RESERVED)]
    message = refuse(20_000, gpus, held)
    assert message.startswith("no GPU has 20000 MiB of headroom for pod airflow/train-model-x; ")
    assert "the most any GPU can give is 9872 MiB" in message
    assert "GPU-1 (node-a, index 0): 9872 MiB headroom (total 16384, reserved 4000, free 14384, " in message
    assert "4000 reserved but not yet in use, margin 512)" in message
    assert "GPU-2 (node-a, index 1): metrics stale (last sample 300 s old, max 120 s)" in message
    assert "GPU-3 (node-a, index 2): missing from DCGM metrics" in message
    assert message.endswith(HINT)


def test_message_names_the_pinned_node() -> None:
    message = refuse(100_000, [gpu()], node="node-a")
    assert message.startswith("no GPU on node node-a has 100000 MiB")


def test_message_without_any_gpu_points_at_the_inventory() -> None:
    message = refuse(1, [])
    assert "no GPUs are known" in message
    assert message.endswith(HINT)


def test_large_fleets_are_summarised() -> None:
    gpus = [gpu(f"GPU-{i:04d}", index=i, total=8_192) for i in range(500)]
    gpus += [gpu(f"GPU-m{i}", node="node-z", index=i, missing=True) for i in range(3)]
    message = refuse(10_000, gpus)
    assert message.count("MiB headroom (") == 8
    assert "and 3 more missing, 492 more too-small" in message
    assert len(message) < 2_500


def test_message_names_several_allowed_nodes_or_none() -> None:
    several = choose(
        request(100_000, nodes=frozenset({"node-b", "node-a"})),
        [gpu()],
        [],
        settings=AllocationSettings(),
        now=NOW,
    )
    assert isinstance(several, Refusal)
    assert refusal_message(several, max_sample_age_s=120, retry_hint=HINT).startswith(
        "no GPU on nodes node-a, node-b has 100000 MiB"
    )
    nowhere = choose(request(1, nodes=frozenset()), [gpu()], [], settings=AllocationSettings(), now=NOW)
    assert isinstance(nowhere, Refusal)
    assert "on any node its node constraints allow (they allow none)" in refusal_message(
        nowhere, max_sample_age_s=120, retry_hint=HINT
    )
