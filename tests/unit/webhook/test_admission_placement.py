"""The Admitter's placements beyond one GPU now: queue mode, holds for retried tasks, Retry-After,
GPU models, the budget told to the pod, and sets of GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.domain.builders import gpu
from tests.unit.webhook.fakes import (
    MemoryLedger,
    admitter,
    airflow,
    applied,
    env_of,
    patch_of,
    request,
)
from vramshare.domain import ReservationPhase
from vramshare.kube.objects import GpuReservation
from vramshare_webhook.admission import ClusterView


async def test_queue_mode_admits_behind_the_gate_with_a_queued_entry() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=14_000),)
    review = await admitter(ledger).review(request("8000", annotations={"gpu-queue": "true"}))
    assert review["response"]["allowed"]
    assert "waits in the queue" in review["response"]["warnings"][0]
    (entry,) = ledger.objects
    assert entry.phase is ReservationPhase.QUEUED
    assert not entry.spec.placed
    ops = {op["path"]: op["value"] for op in patch_of(review)}
    assert ops["/spec/schedulingGates"] == [{"name": "vramshare.io/gpu-memory"}]
    env = {e["name"]: e for e in ops["/spec/containers/0/env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['vramshare.io/gpu-uuid']"
    )
    assert ops["/metadata/labels"]["vramshare.io/reservation"] == entry.name


async def test_queue_mode_from_the_namespace_label_and_the_annotation_wins() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=14_000),)
    queued_ns = admitter(
        ledger, cluster=ClusterView(namespace_labels=lambda namespace: {"vramshare.io/queue": "true"})
    )
    assert (await queued_ns.review(request("8000")))["response"]["allowed"]
    refused = await queued_ns.review(request("8000", uid="u2", annotations={"gpu-queue": "false"}))
    assert refused["response"]["status"]["code"] == 403
    assert len(ledger.objects) == 1


async def test_queue_mode_refuses_what_no_gpu_could_ever_take_and_rejects_a_bad_value() -> None:
    ledger = MemoryLedger()
    too_big = await admitter(ledger, queue_by_default=True).review(request("20000"))
    assert too_big["response"]["status"]["code"] == 403
    bad = await admitter(ledger).review(request("1000", annotations={"gpu-queue": "soon"}))
    assert bad["response"]["status"]["code"] == 400
    assert bad["response"]["status"]["message"] == (
        'annotation "gpu-queue" is "soon": accepted values are "true" (wait for a GPU) and "false" '
        "(refuse when none fits now)"
    )
    assert ledger.objects == []


async def test_a_reinvocation_of_a_queued_pod_keeps_its_one_entry() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=14_000),)
    webhook = admitter(ledger, queue_by_default=True)
    first = await webhook.review(request("8000"))
    (entry,) = ledger.objects
    annotations = next(op["value"] for op in patch_of(first) if op["path"] == "/metadata/annotations")
    again = await webhook.review(request("8000", uid="u2", annotations=annotations))
    assert again["response"]["allowed"]
    assert len(ledger.objects) == 1
    labels = next(op["value"] for op in patch_of(again) if op["path"] == "/metadata/labels")
    assert labels["vramshare.io/reservation"] == entry.name
    # A third pass (a copy: the API server reinvokes once) gets an entry of its own.
    await webhook.review(request("8000", uid="u3", annotations=annotations))
    assert len(ledger.objects) == 2


async def test_a_refused_large_task_seen_retrying_gets_a_hold_that_only_its_next_try_may_use() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=10_000), gpu("GPU-b", index=1, total=8_192, used=8_000))
    webhook = admitter(ledger)
    first = await webhook.review(request("12000", labels=airflow("big")))
    assert first["response"]["status"]["code"] == 403
    assert ledger.objects == []  # asked once: it may never come back, so nothing is held for it
    refused = await webhook.review(request("12000", uid="u1b", labels=airflow("big")))
    assert refused["response"]["status"]["code"] == 403
    (hold,) = ledger.objects
    assert hold.phase is ReservationPhase.HELD
    assert (hold.spec.gpu_uuid, hold.spec.memory_mib, hold.spec.pod_name) == (
        "GPU-a",
        12_000,
        "train.big.manual-1",
    )
    assert (
        "GPU GPU-a (node-a, index 0) now keeps the memory that frees on it for this task"
        in (refused["response"]["status"]["message"])
    )
    # Another large task, retrying too, is refused without a hold: one at a time (max_holds 1).
    await webhook.review(request("12000", uid="u2", labels=airflow("other-big")))
    await webhook.review(request("12000", uid="u2b", labels=airflow("other-big")))
    assert len(ledger.objects) == 1
    # Memory frees on GPU-a: a small task is still kept off it, the held memory is not its own.
    ledger.gpus = (gpu("GPU-a", total=16_384, used=2_000), ledger.gpus[1])
    small = await webhook.review(request("4000", uid="u3", labels=airflow("small")))
    assert small["response"]["status"]["code"] == 403
    # The big task's next try (a new pod, the same task) is admitted there and the hold is gone.
    retry = await webhook.review(request("12000", uid="u4", labels=airflow("big", 2)))
    assert retry["response"]["allowed"]
    (booked,) = ledger.objects
    assert booked.phase is ReservationPhase.RESERVED
    assert booked.spec.gpu_uuid == "GPU-a"


async def test_no_hold_for_small_requests_or_when_turned_off() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=10_000),)
    await admitter(ledger).review(request("8000", labels=airflow("small")))
    await admitter(ledger, hold_min_mib=0).review(request("12000", uid="u2", labels=airflow("big")))
    assert ledger.objects == []


async def test_retry_after_follows_how_fast_memory_frees() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=12_000),)
    webhook = admitter(ledger, denial_code=429, retry_after_s=60, hold_min_mib=0)
    idle = await webhook.review(request("8000"))
    assert idle["response"]["status"]["details"]["retryAfterSeconds"] == 60  # nothing freed lately
    ledger.rate = 400.0  # MiB per second: the 3616 MiB missing free in about 10 s
    busy = await webhook.review(request("8000", uid="u2"))
    assert busy["response"]["status"]["details"]["retryAfterSeconds"] == 10
    assert "retry after 10 s" in busy["response"]["status"]["message"]


async def test_the_gpu_model_annotation_selects_gpus_and_an_unknown_model_is_a_400() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (
        replace(gpu("GPU-a", total=16_384), model="Tesla T4"),
        replace(gpu("GPU-b", index=1, total=40_960), model="NVIDIA A100-SXM4-40GB"),
    )
    webhook = admitter(ledger)
    exact = await webhook.review(request("2000", annotations={"gpu-model": "Tesla T4"}))
    assert exact["response"]["allowed"]
    assert ledger.objects[-1].spec.gpu_uuid == "GPU-a"  # spread alone would have taken the larger A100
    pattern = await webhook.review(request("2000", uid="u2", annotations={"gpu-model": "NVIDIA A100*"}))
    assert pattern["response"]["allowed"]
    assert ledger.objects[-1].spec.gpu_uuid == "GPU-b"
    unknown = await webhook.review(request("2000", uid="u3", annotations={"gpu-model": "*H100*"}))
    assert unknown["response"]["status"]["code"] == 400
    assert unknown["response"]["status"]["message"] == (
        'annotation "gpu-model" is "*H100*": no GPU in the fleet has that model; the models are: '
        "NVIDIA A100-SXM4-40GB, Tesla T4 (exact, or a pattern with * and ?)"
    )
    # A model that exists but has no room now is an ordinary refusal, naming why the others were passed over.
    full = await webhook.review(request("20000", uid="u4", annotations={"gpu-model": "Tesla T4"}))
    assert full["response"]["status"]["code"] == 403
    assert "model NVIDIA A100-SXM4-40GB is not the one asked for" in full["response"]["status"]["message"]


async def test_an_admitted_pod_is_told_its_budget_unless_it_opts_out() -> None:
    ledger = MemoryLedger()
    webhook = admitter(ledger)
    pod_env = [
        {"name": "XLA_PYTHON_CLIENT_MEM_FRACTION", "value": "0.05"},
        {"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "false"},
    ]
    req = request("4096")
    req.object["spec"]["containers"][0]["env"] = pod_env
    env = env_of(await webhook.review(req))
    assert env["VRAMSHARE_GPU_MEMORY_MIB"] == "4096"
    assert env["VRAMSHARE_GPU_MEMORY_FRACTION"] == "0.25"  # 4096 of GPU-a's 16384
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.05"  # the pod's own, lower: kept
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env  # no MPS node known
    opted_out = env_of(
        await webhook.review(request("4096", uid="u2", annotations={"gpu-guardrails": "false"}))
    )
    assert "VRAMSHARE_GPU_MEMORY_MIB" not in opted_out
    bad = await webhook.review(request("4096", uid="u3", annotations={"gpu-guardrails": "maybe"}))
    assert bad["response"]["status"]["code"] == 400


async def test_on_an_mps_node_the_driver_limit_is_set() -> None:
    from vramshare.domain.scheduling import NodeView

    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384),)
    webhook = admitter(
        ledger,
        cluster=ClusterView(
            nodes=lambda: [NodeView(name="node-a", labels={"nvidia.com/mps.capable": "true"})]
        ),
    )
    assert env_of(await webhook.review(request("4096")))["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"


async def test_a_queued_pod_reads_the_gpu_dependent_budget_from_the_placement() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=14_000),)
    env = env_of(await admitter(ledger, queue_by_default=True).review(request("8000")))
    assert env["VRAMSHARE_GPU_MEMORY_MIB"] == "8000"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['vramshare.io/gpu-memory-fraction']"}
    }
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['vramshare.io/mps-memory-limit']"}
    }


async def test_a_pod_with_two_gpus_books_both_on_one_node_under_one_label() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger).review(request("4096", annotations={"gpu-count": "2"}))
    assert review["response"]["allowed"]
    first, second = ledger.objects
    assert (first.spec.gpu_uuid, second.spec.gpu_uuid) == ("GPU-a", "GPU-b")
    assert second.name == f"{first.name}-gpu1"
    assert {o.pod_label for o in ledger.objects} == {first.name}
    assert {o.spec.gpu_count for o in ledger.objects} == {2}
    ops = {op["path"]: op["value"] for op in patch_of(review)}
    assert ops["/metadata/labels"]["vramshare.io/reservation"] == first.name
    env = {e["name"]: e.get("value") for e in ops["/spec/containers/0/env"]}
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]) == ("GPU-a,GPU-b", "0,1")
    # The budget is per GPU, a fraction of the smaller one (8 GiB).
    assert (env["VRAMSHARE_GPU_MEMORY_MIB"], env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == ("4096", "0.50")


async def test_a_set_is_booked_all_or_nothing_when_one_gpu_loses_its_race() -> None:
    ledger = MemoryLedger()
    ledger.conflict_on = {"GPU-b"}
    a = admitter(ledger)
    review = await a.review(request("4096", annotations={"gpu-count": "2"}))
    assert review["response"]["allowed"]
    assert len(ledger.withdrawn) == 1  # the first try's GPU-a booking, taken back
    assert sorted(o.spec.gpu_uuid for o in ledger.objects) == ["GPU-a", "GPU-b"]
    assert ledger.withdrawn[0] not in {o.name for o in ledger.objects}
    assert a.metrics.conflicts._value.get() == 1


async def test_a_reinvocation_of_a_pod_with_two_gpus_books_nothing_more() -> None:
    ledger = MemoryLedger()
    a = admitter(ledger)
    req = request("4096", annotations={"gpu-count": "2"})
    first = await a.review(req)
    again = await a.review(applied(req, first))
    assert len(ledger.objects) == 2
    ops = {op["path"]: op["value"] for op in patch_of(again)}
    sidecar = {e["name"]: e.get("value") for e in ops["/spec/containers/1/env"]}
    assert (sidecar["NVIDIA_VISIBLE_DEVICES"], sidecar["CUDA_VISIBLE_DEVICES"]) == ("GPU-a,GPU-b", "0,1")


async def test_a_set_no_node_can_take_is_refused_naming_the_closest_node() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger).review(request("12000", annotations={"gpu-count": "2"}))
    status = review["response"]["status"]
    assert status["code"] == 403
    assert status["message"].startswith(
        "no node has 2 GPUs with 12000 MiB of headroom each for pod airflow/task; the closest is node "
        "node-a, where 1 of the 2 GPUs needed has room: GPU-a (index 0) 16384 MiB."
    )
    assert ledger.objects == []


async def test_a_set_is_neither_held_nor_queued() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger, hold_min_mib=1, queue_by_default=True).review(
        request("12000", annotations={"gpu-count": "2"})
    )
    assert review["response"]["allowed"] is False
    assert ledger.objects == []


@pytest.mark.parametrize("value", ["0", "3", "two"])
async def test_a_bad_gpu_count_is_a_400_naming_it(value: str) -> None:
    review = await admitter(MemoryLedger(), max_gpus_per_pod=2).review(
        request("4096", annotations={"gpu-count": value})
    )
    status = review["response"]["status"]
    assert status["code"] == 400
    assert f'annotation "gpu-count" has value {value!r}' in status["message"]
    assert "between 1 and 2" in status["message"]


def _granted(ledger: MemoryLedger, *, mib: int, on: str) -> None:
    """This replica's grant of `mib` on GPU `on`, as every replica's ledger shows it."""
    g = next(x for x in ledger.gpus if x.uuid == on)
    ledger.objects.append(
        GpuReservation.granted(
            name="grant-1",
            namespace="vramshare",
            mib=mib,
            gpu_uuid=g.uuid,
            node=g.node,
            gpu_index=g.index,
            holder="webhook-0",
            holder_hash="h",
            lasts_s=15,
        )
    )
    ledger.granted[on] = mib


async def test_the_commit_is_told_the_room_a_grant_may_be_taken_from() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=6_000),)
    review = await admitter(ledger).review(request("1000"))
    assert review["response"]["allowed"]
    assert ledger.grant_rooms == [16_384 - 6_000 - 1000]


async def test_the_policy_ranks_gpus_by_the_room_every_replica_sees_before_counting_grants() -> None:
    """GPU-b has more room for this replica (its grant there), GPU-a more for everyone: spread picks
    GPU-a, so grants do not pull every pod onto the GPUs this replica happens to hold them on."""
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=6_384), gpu("GPU-b", index=1, total=16_384))
    _granted(ledger, mib=10_000, on="GPU-b")
    review = await admitter(ledger).review(request("1000"))
    assert review["response"]["allowed"]
    assert ledger.objects[-1].spec.gpu_uuid == "GPU-a"


async def test_a_pod_that_fits_only_inside_this_replicas_grant_is_placed_there() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=14_000), gpu("GPU-b", index=1, total=8_192))
    _granted(ledger, mib=6_000, on="GPU-b")  # others see 2 192 MiB left there
    review = await admitter(ledger).review(request("3000"))
    assert review["response"]["allowed"]
    assert ledger.objects[-1].spec.gpu_uuid == "GPU-b"
    ledger.granted.clear()  # another replica: the grant is not its own
    refused = await admitter(ledger).review(request("3000", uid="u2"))
    assert refused["response"]["status"]["code"] == 403
    message = refused["response"]["status"]["message"]
    assert "Room for it is held for webhook replicas' next pods (6000 MiB on GPU GPU-b" in message
    assert "given back within 10 s" in message
