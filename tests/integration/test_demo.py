"""`make demo` in its fast mode: the scripted scenario's outcomes, asserted."""

from __future__ import annotations

import pytest

from vramshare_e2e.demo import run_demo

pytestmark = pytest.mark.cluster


def test_demo_scenario() -> None:
    printed: list[str] = []
    outcome = run_demo(fast=True, keep=False, show=printed.append)
    text = "\n".join(printed)

    # Six tasks admitted, each pinned to one GPU by UUID, placed by spread across the fleet.
    assert len(outcome.admitted) == 6
    for placed in outcome.admitted.values():
        assert placed["visible_devices"] == placed["gpu"]
        assert placed["cuda_devices"] == "0"
    nodes = {name: p["node"] for name, p in outcome.admitted.items()}
    assert nodes["train-resnet"] == nodes["train-bert"] == "gpu-node-a"
    assert {nodes[n] for n in ("embed-docs", "infer-batch-1", "infer-batch-2", "infer-batch-3")} == {
        "gpu-node-b"
    }
    assert outcome.admitted["train-resnet"]["gpu"] != outcome.admitted["train-bert"]["gpu"]

    # The 24000 MiB task is refused with the message an Airflow user reads.
    message = outcome.refused["train-llm"]
    assert "no GPU has 24000 MiB of headroom for pod airflow/train-llm" in message
    assert "the most any GPU can give is 10592 MiB" in message
    assert "Airflow retries the task" in message

    # Retried after tasks finished, it is admitted where train-resnet's memory was released.
    assert outcome.retry_admitted == {"gpu": outcome.admitted["train-resnet"]["gpu"], "node": "gpu-node-a"}
    assert outcome.retry_attempts >= 1

    # In queue mode the same size waits behind a gate, is shown Queued #1, and is placed on an A100 once
    # memory frees, with no refusal.
    assert outcome.queued["gated"] is True
    assert outcome.queued["position"] == 1
    a100s = {outcome.admitted["train-resnet"]["gpu"], outcome.admitted["train-bert"]["gpu"]}
    assert outcome.queued["gpu"] in a100s

    assert outcome.hidden_pod_env == "void"
    # The demo's cluster applies the chart's own policies: an admitted pod's GPU cannot be changed.
    assert outcome.tamper_refusal is not None
    assert "ValidatingAdmissionPolicy 'vramshare-pinning'" in outcome.tamper_refusal
    assert "cannot be added, changed or removed afterwards" in outcome.tamper_refusal
    assert outcome.final is not None
    phases = {r.pod: r.phase for r in outcome.final.reservations}
    for name in ("train-resnet", "embed-docs", "infer-batch-1", "infer-batch-2", "infer-batch-3"):
        assert phases[name] == "Released"
    assert phases["train-bert"] == "Bound"
    # The tables were shown, with memory bars.
    assert text.count("== ") >= 3
    assert "MEMORY (#used +reserved .free)" in text
