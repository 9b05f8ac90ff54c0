"""The Admitter against an in-memory ledger: outcomes, conflict retries, reinvocation, errors."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from tests.unit.domain.builders import NOW, gpu
from tests.unit.webhook.fakes import MemoryLedger, admitter, airflow, delivering, patch_of, request, with_spec
from vramshare.domain import ReservationPhase
from vramshare.kube.objects import GpuReservation
from vramshare.settings import SettingsError
from vramshare_webhook import review as rv
from vramshare_webhook.admission import ClusterView
from vramshare_webhook.delivery_modes import DeliveryMode
from vramshare_webhook.settings import WebhookSettings


async def test_admits_and_commits_one_reservation() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger).review(request())
    assert review["response"]["allowed"]
    (obj,) = ledger.objects
    assert obj.spec.gpu_uuid == "GPU-a"
    assert obj.spec.admission_uid == "u1"
    annotations = next(op["value"] for op in patch_of(review) if op["path"] == "/metadata/annotations")
    assert annotations["vramshare.io/reservation"] == obj.name


async def test_refuses_with_the_configured_code_and_commits_nothing() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger, denial_code=429, retry_after_s=30).review(request("20000"))
    status = review["response"]["status"]
    assert review["response"]["allowed"] is False
    assert (status["code"], status["reason"], status["details"]) == (
        429,
        "TooManyRequests",
        {"retryAfterSeconds": 30},
    )
    assert "retry after 30 s" in status["message"]
    assert ledger.objects == []
    assert ledger.fresh_reads == 1  # a refusal is decided on a consistent view


async def test_conflicts_are_retried_and_counted() -> None:
    ledger = MemoryLedger(conflicts=3)
    a = admitter(ledger)
    review = await a.review(request())
    assert review["response"]["allowed"]
    assert len(ledger.objects) == 1
    assert a.metrics.conflicts._value.get() == 3


async def test_contention_past_the_deadline_is_a_refusal_not_an_error() -> None:
    ledger = MemoryLedger(conflicts=10_000)
    review = await admitter(ledger, decision_deadline_s=0.05).review(request())
    assert review["response"]["status"]["code"] == 403
    assert "too many concurrent admissions" in review["response"]["status"]["message"]


async def test_dry_run_patches_without_committing() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger).review(request(dry_run=True))
    assert review["response"]["allowed"]
    assert patch_of(review)
    assert ledger.objects == []


def applied(req: rv.Request, review: rv.Review) -> rv.Request:
    """The request as the API server sends it again after a later webhook: the first pass's patch
    applied (plus a sidecar container), under a new request UID."""
    pod = copy.deepcopy(req.object)
    for op in patch_of(review):
        parts = op["path"].strip("/").split("/")
        target = pod
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
        key = parts[-1]
        if isinstance(target, list):
            target[int(key)] = op["value"]
        else:
            target[key] = op["value"]
    pod["spec"]["containers"].append({"name": "sidecar", "image": "proxy"})
    return replace(req, uid=req.uid + "-again", object=pod)


async def test_a_reinvocation_keeps_the_first_placement_and_books_nothing_more() -> None:
    ledger = MemoryLedger()
    a = admitter(ledger)
    req = request()
    first = await a.review(req)
    again_req = applied(req, first)
    again = await a.review(again_req)
    assert len(ledger.objects) == 1
    ops = {op["path"]: op["value"] for op in patch_of(again)}
    first_ops = {op["path"]: op["value"] for op in patch_of(first)}
    assert ops["/metadata/annotations"] == first_ops["/metadata/annotations"]
    # The sidecar a later webhook added is pinned to the same GPU.
    uuid = first_ops["/metadata/annotations"]["vramshare.io/gpu-uuid"]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": uuid} in ops["/spec/containers/1/env"]
    # The node affinity is not duplicated.
    (term,) = ops["/spec/affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert len(term["matchFields"]) == 1
    # The API server reinvokes at most once: a third pass with the same annotations is a copy.
    third = await a.review(replace(again_req, uid="u-third"))
    assert len(ledger.objects) == 2
    assert patch_of(third) != patch_of(first)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"name": "other-task"}, "another pod or size"),
        ({"username": "mallory"}, "another user"),
        ({"mib": "8192"}, "another pod or size"),
        ({"carried": True}, "a pod already carries"),
        ({"age": 31}, "older than 30 s"),
    ],
)
async def test_copied_annotations_get_no_placement_they_did_not_pay_for(
    change: dict[str, Any], why: str
) -> None:
    ledger = MemoryLedger()
    now = [NOW]
    a = admitter(ledger, clock=lambda: now[0])
    original = request()
    first = await a.review(original)
    (booked,) = ledger.objects
    forged = applied(original, first)
    if "name" in change:
        forged.object["metadata"]["name"] = change["name"]
        forged = replace(forged, name=change["name"])
    if "username" in change:
        forged = replace(forged, username=change["username"])
    if "mib" in change:
        forged.object["metadata"]["annotations"]["gpu-mem-mb"] = change["mib"]
    if change.get("carried"):
        ledger.carried.add(booked.name)
    now[0] += change.get("age", 0)
    review = await a.review(forged)
    assert len(ledger.objects) == 2, "a forged pass must pay for its own booking"
    annotations = {op["path"]: op["value"] for op in patch_of(review)}["/metadata/annotations"]
    assert annotations["vramshare.io/reservation"] != booked.name
    assert "vramshare.io/reinvoked-by" not in ledger.objects[0].meta.annotations
    assert why  # the reason is logged as placement_not_honoured


async def test_the_reinvocation_window_runs_on_the_api_servers_clock() -> None:
    """A webhook whose clock is 40 s ahead (window 30 s) refused every reinvocation as too old, so
    pods in namespaces with a sidecar injector booked twice (issue #30, 3)."""
    ledger = MemoryLedger()
    a = admitter(
        ledger,
        clock=lambda: NOW + 40,
        # the clock that stamped the booking's creationTimestamp
        cluster=ClusterView(server_clock=lambda: NOW),
    )
    original = request()
    first = await a.review(original)
    again = await a.review(applied(original, first))
    assert len(ledger.objects) == 1
    assert {op["path"]: op["value"] for op in patch_of(again)}["/metadata/annotations"] == {
        op["path"]: op["value"] for op in patch_of(first)
    }["/metadata/annotations"]


async def test_the_whole_answer_is_bounded_by_the_deadline() -> None:
    ledger = MemoryLedger()
    ledger.hang_commit = True
    review = await admitter(ledger, decision_deadline_s=0.2).review(request())
    status = review["response"]["status"]
    assert review["response"]["allowed"] is False
    assert status["code"] == 403
    assert "could not decide within 0.2 s" in status["message"]
    assert "nothing was reserved" in status["message"]
    assert ledger.objects == []


async def test_a_name_already_taken_is_refused_as_already_existing_and_books_nothing() -> None:
    ledger = MemoryLedger()
    ledger.pods.add("task")  # a plain pod of that name: it holds no booking
    again = await admitter(ledger).review(request(uid="u-dup"))
    status = again["response"]["status"]
    assert (status["code"], status["reason"]) == (409, "AlreadyExists")
    assert 'pods "task" already exists' in status["message"]
    assert ledger.objects == []


@pytest.mark.parametrize(
    ("mib", "annotations", "the_way_out"),
    [
        ("20000", {}, "a refusal"),
        ("8000", {"gpu-queue": "true"}, "a queue entry"),
        ("14000", {}, "a hold for a task refused again"),
    ],
)
async def test_a_taken_name_is_answered_as_taken_on_every_way_out_and_books_nothing(
    mib: str, annotations: dict[str, str], the_way_out: str
) -> None:
    """Whatever the placement would have said, a taken name is the answer, and nothing is written: no
    queue entry, no hold (issue #45's second round moved the look-up beside the placement, and took it
    back: these held there too)."""
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=14_000 if the_way_out == "a queue entry" else 0),)
    ledger.pods.add("task")
    hook = admitter(ledger, max_holds=4)
    for i in range(2):  # the second try of a refused task would get a hold
        review = await hook.review(request(mib, uid=f"u{i}", labels=airflow("t"), annotations=annotations))
        status = review["response"]["status"]
        assert (status["code"], status["reason"]) == (409, "AlreadyExists"), the_way_out
    assert ledger.objects == []


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"name": ":"}, "metadata.name"),
        ({"name": "task-"}, "metadata.name"),
        ({"name": "task..b"}, "metadata.name"),
        ({"name": "", "generateName": "Task-"}, "metadata.generateName"),
        ({"name": "", "generateName": "-"}, "metadata.generateName"),
    ],
)
async def test_a_pod_name_the_api_server_would_refuse_is_a_400_and_books_nothing(
    meta: dict[str, str], field: str
) -> None:
    """A fuzzed review with metadata.name ':' was answered 500: the booking named after it was refused
    by the API server (422). A name is a lower-case RFC 1123 subdomain; anything else is said so. The
    cases were checked against a real API server (`kubectl create --dry-run=server`): each refused
    there, and generateName 'task-' and name 'task-1.b' accepted."""
    ledger = MemoryLedger()
    review = await admitter(ledger).review(request(**meta))
    status = review["response"]["status"]
    assert status["code"] == 400
    assert f"{field} " in status["message"]
    assert "is not a pod name" in status["message"]
    assert ledger.objects == []
    assert (await admitter(ledger).review(request(name="task-1.b")))["response"]["allowed"]
    assert (await admitter(ledger).review(request(name="", generateName="task-")))["response"]["allowed"]


@pytest.mark.parametrize(("mib", "problem"), [("abc", "it is not a number"), ("0", "it is zero")])
async def test_invalid_annotation_is_a_400(mib: str, problem: str) -> None:
    review = await admitter(MemoryLedger()).review(request(mib))
    assert review["response"]["status"]["code"] == 400
    assert problem in review["response"]["status"]["message"]


async def test_device_plugin_pods_with_the_annotation_are_refused() -> None:
    req = request()
    req.object["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    review = await admitter(MemoryLedger()).review(req)
    assert review["response"]["status"]["code"] == 400
    assert "nvidia.com/gpu" in review["response"]["status"]["message"]


async def test_unannotated_pods_are_hidden_or_left_alone() -> None:
    hidden = await admitter(MemoryLedger()).review(request(None))
    assert patch_of(hidden)[0]["value"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    untouched = await admitter(MemoryLedger(), hide_gpus=False).review(request(None))
    assert "patch" not in untouched["response"]


@pytest.mark.slow
async def test_internal_failure_is_a_well_formed_errored_answer() -> None:
    review = await admitter(MemoryLedger(fail=RuntimeError("API server unreachable"))).review(
        request(uid="u7")
    )
    assert review["response"]["uid"] == "u7"
    assert review["response"]["status"]["code"] == 500
    assert "API server unreachable" in review["response"]["status"]["message"]


TLS_FILES = {"VRAMSHARE_TLS_CERT_FILE": "/tls/tls.crt", "VRAMSHARE_TLS_KEY_FILE": "/tls/tls.key"}


def test_settings_from_env_and_their_errors() -> None:
    s = WebhookSettings.from_env(
        {
            "VRAMSHARE_POLICY": "binpack",
            "VRAMSHARE_DENIAL_CODE": "429",
            "VRAMSHARE_HIDE_GPUS": "false",
            "VRAMSHARE_SETTLE_S": "30",
            **TLS_FILES,
        }
    )
    assert (s.policy.value, s.denial_code, s.hide_gpus, s.accounting.settle_s) == (
        "binpack",
        429,
        False,
        30.0,
    )
    with pytest.raises(
        SettingsError, match=r"VRAMSHARE_POLICY='pack' is not valid: expected one of spread, binpack"
    ):
        WebhookSettings.from_env({"VRAMSHARE_POLICY": "pack", **TLS_FILES})
    with pytest.raises(SettingsError, match=r"VRAMSHARE_DENIAL_CODE=500 is not valid: expected 403 or 429"):
        WebhookSettings.from_env({"VRAMSHARE_DENIAL_CODE": "500", **TLS_FILES})
    with pytest.raises(
        SettingsError,
        match=r"VRAMSHARE_LOG_LEVEL='verbose' is not valid: expected debug, info, warning, error",
    ):
        WebhookSettings.from_env({"VRAMSHARE_LOG_LEVEL": "verbose", **TLS_FILES})
    assert WebhookSettings.from_env({"VRAMSHARE_LOG_LEVEL": "DEBUG", **TLS_FILES}).log_level == "DEBUG"
    with pytest.raises(SettingsError, match=r"VRAMSHARE_MEMORY_RESOURCE='gpu-mem' is not valid"):
        WebhookSettings.from_env({"VRAMSHARE_MEMORY_RESOURCE": "gpu-mem", **TLS_FILES})
    with pytest.raises(SettingsError, match=r"VRAMSHARE_MAX_PENDING_MIB_PER_USER=-1 is not valid"):
        WebhookSettings.from_env({"VRAMSHARE_MAX_PENDING_MIB_PER_USER": "-1", **TLS_FILES})
    with pytest.raises(SettingsError, match=r"VRAMSHARE_TLS_CERT_FILE='' is not valid: expected both"):
        WebhookSettings.from_env({})
    with pytest.raises(
        SettingsError, match=r"VRAMSHARE_TLS_MODE='acme' is not valid: expected one of files, secret"
    ):
        WebhookSettings.from_env({"VRAMSHARE_TLS_MODE": "acme"})
    with pytest.raises(
        SettingsError, match=r"VRAMSHARE_TLS_NAMES='' is not valid: expected the DNS names or IPs"
    ):
        WebhookSettings.from_env({"VRAMSHARE_TLS_MODE": "self-managed"})
    managed = WebhookSettings.from_env(
        {
            "VRAMSHARE_TLS_MODE": "self-managed",
            "VRAMSHARE_TLS_NAMES": " vramshare-webhook.vramshare.svc, 127.0.0.1 ",
        }
    )
    assert managed.tls_name_list == ("vramshare-webhook.vramshare.svc", "127.0.0.1")
    service = {"VRAMSHARE_REPLICA_SERVICE": "vramshare-webhook", **TLS_FILES}
    assert WebhookSettings.from_env(service).replica_service == "vramshare-webhook"
    with pytest.raises(
        SettingsError,
        match=r"VRAMSHARE_REPLICA_SERVICE='Webhook.svc' is not valid: expected empty or a Service",
    ):
        WebhookSettings.from_env({"VRAMSHARE_REPLICA_SERVICE": "Webhook.svc", **TLS_FILES})
    with pytest.raises(
        SettingsError,
        match=r"VRAMSHARE_REPLICA_LEASE_S=15.0 is not valid: expected 0 while replica_service is set",
    ):
        WebhookSettings.from_env({"VRAMSHARE_REPLICA_LEASE_S": "15", **service})


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


def env_of(review: rv.Review, container: int = 0) -> dict[str, Any]:
    ops = {op["path"]: op["value"] for op in patch_of(review)}
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in ops[f"/spec/containers/{container}/env"]}


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


async def test_a_zero_device_plugin_request_does_not_escape_hiding() -> None:
    zero = [{"name": "base", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "0"}}}]
    hidden = await admitter(MemoryLedger()).review(with_spec(request(None), containers=zero))
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in env_list(hidden)
    # With the annotation it is an ordinary vramshare pod, not a device-plugin one.
    ledger = MemoryLedger()
    admitted = await admitter(ledger).review(with_spec(request("4096"), containers=zero))
    assert admitted["response"]["allowed"]
    assert len(ledger.objects) == 1
    one = [{"name": "base", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    plugin = await admitter(MemoryLedger()).review(with_spec(request(None), containers=one))
    assert "patch" not in plugin["response"]  # the device plugin's pod: left alone


def env_list(review: rv.Review) -> list[dict[str, Any]]:
    return next(op["value"] for op in patch_of(review) if op["path"] == "/spec/containers/0/env")  # type: ignore[no-any-return]


async def test_an_unannotated_pod_loses_the_vramshare_keys_it_set_itself() -> None:
    forged = request(
        None,
        labels={"vramshare.io/reservation": "someone-elses", "team": "a"},
        annotations={"vramshare.io/gpu-uuid": "GPU-a", "note": "x"},
    )
    review = await admitter(MemoryLedger()).review(forged)
    ops = {op["path"]: op["value"] for op in patch_of(review)}
    assert ops["/metadata/labels"] == {"team": "a"}
    assert ops["/metadata/annotations"] == {"note": "x"}
    (warning,) = review["response"]["warnings"]
    assert "removed label vramshare.io/reservation, annotation vramshare.io/gpu-uuid" in warning
    # Also where pods are not hidden (the device plugin's, or hiding turned off): only the keys go.
    ops = {
        op["path"]: op["value"]
        for op in patch_of(await admitter(MemoryLedger(), hide_gpus=False).review(forged))
    }
    assert set(ops) == {"/metadata/labels", "/metadata/annotations"}


def debug_request(
    annotations: dict[str, str], labels: dict[str, str], *, sent: dict[str, Any] | None = None
) -> rv.Request:
    """A `kubectl debug` review of the stored pod with these marks; `sent`: the metadata the client
    sent instead (the API server restores the stored metadata only after mutating admission)."""
    stored = {
        "metadata": {"name": "task", "uid": "uid-1", "annotations": annotations, "labels": labels},
        "spec": {
            "containers": [{"name": "base", "image": "x"}],
            "ephemeralContainers": [
                {"name": "debugger", "image": "busybox", "env": [{"name": "A", "value": "1"}]}
            ],
        },
    }
    pod = {**stored, "metadata": sent} if sent is not None else stored
    return replace(
        request(), operation="UPDATE", object=pod, old_object=stored, sub_resource="ephemeralcontainers"
    )


def booked(ledger: MemoryLedger, *, pod_uid: str | None = "uid-1", gpus: int = 2) -> None:
    """The booking the debugged pod's label names, on GPU-a (of `gpus`), bound to `pod_uid`."""
    booking = GpuReservation.new(
        name="task-1",
        namespace="airflow",
        pod="task",
        mib=4096,
        gpu=ledger.gpus[0],
        admission_uid="u0",
        user="airflow",
        set_name="task-1" if gpus > 1 else "",
        gpu_count=gpus,
    )
    if pod_uid is not None:
        booking = replace(
            booking, status=replace(booking.status, phase=ReservationPhase.BOUND, pod_uid=pod_uid)
        )
    ledger.objects.append(booking)


def debug_env(review: rv.Review) -> dict[str, str]:
    (op,) = patch_of(review)
    assert op["path"] == "/spec/ephemeralContainers/0/env"
    return {e["name"]: e["value"] for e in op["value"]}


async def test_debug_containers_see_the_pods_gpus_or_none() -> None:
    placed = debug_request(
        {"gpu-mem-mb": "4096", "vramshare.io/gpu-uuid": "GPU-a,GPU-b"},
        {"vramshare.io/reservation": "task-1"},
    )
    ledger = MemoryLedger()
    booked(ledger)
    review = await admitter(ledger).review(placed)
    (op,) = patch_of(review)
    assert op["path"] == "/spec/ephemeralContainers/0/env"
    assert op["value"] == [
        {"name": "A", "value": "1"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-a,GPU-b"},
        {"name": "CUDA_VISIBLE_DEVICES", "value": "0,1"},
    ]
    for marks, labels in (({}, {}), ({"gpu-mem-mb": "4096"}, {})):  # not placed (yet): no GPU
        (op,) = patch_of(await admitter(MemoryLedger()).review(debug_request(marks, labels)))
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in op["value"]
    other_update = replace(placed, sub_resource="")
    assert "patch" not in (await admitter(MemoryLedger()).review(other_update))["response"]


async def test_a_debug_container_takes_its_gpus_from_the_stored_pod_never_from_the_request() -> None:
    """Issue #42, 1: on pods/ephemeralcontainers the webhook sees the metadata the client sent; a client
    that writes the placement marks into its update chooses nothing."""
    forged = {
        "name": "task",
        "uid": "uid-1",
        "annotations": {"gpu-mem-mb": "4096", "vramshare.io/gpu-uuid": "all"},
        "labels": {"vramshare.io/reservation": "task-1"},
    }
    ledger = MemoryLedger()
    booked(ledger)
    plain = debug_request({}, {}, sent=forged)  # the stored pod has no GPU
    assert debug_env(await admitter(ledger).review(plain))["NVIDIA_VISIBLE_DEVICES"] == "void"
    placed = debug_request(
        {"gpu-mem-mb": "4096", "vramshare.io/gpu-uuid": "GPU-a,GPU-b"},
        {"vramshare.io/reservation": "task-1"},
        sent=forged,
    )
    assert debug_env(await admitter(ledger).review(placed))["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"


async def test_a_debug_container_sees_no_gpu_where_the_booking_does_not_confirm_the_pods_marks() -> None:
    marks = {"gpu-mem-mb": "4096", "vramshare.io/gpu-uuid": "GPU-a,GPU-b"}
    label = {"vramshare.io/reservation": "task-1"}
    cases = {
        "no booking": lambda ledger: None,
        "bound to another pod": lambda ledger: booked(ledger, pod_uid="uid-other"),
        "for fewer GPUs": lambda ledger: booked(ledger, gpus=1),
    }
    for why, book in cases.items():
        ledger = MemoryLedger()
        book(ledger)
        env = debug_env(await admitter(ledger).review(debug_request(marks, label)))
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void", why
    on_other_gpu = debug_request({**marks, "vramshare.io/gpu-uuid": "GPU-b"}, label)
    ledger = MemoryLedger()
    booked(ledger, gpus=1)
    assert debug_env(await admitter(ledger).review(on_other_gpu))["NVIDIA_VISIBLE_DEVICES"] == "void"
    # Not bound yet (the pod has not run): a booking made for a pod of this name confirms it.
    ledger = MemoryLedger()
    booked(ledger, pod_uid=None)
    env = debug_env(await admitter(ledger).review(debug_request(marks, label)))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"


async def test_bookings_whose_pods_never_appear_are_bounded_per_namespace() -> None:
    ledger = MemoryLedger()
    a = admitter(ledger, max_pending_per_namespace=3)
    answers = [await a.review(request("100", uid=f"forged-{i}")) for i in range(5)]
    assert [r["response"]["allowed"] for r in answers] == [True, True, True, False, False]
    assert (
        "namespace airflow already has 3 GPU bookings whose pods have not appeared yet"
        in (answers[3]["response"]["status"]["message"])
    )
    assert len(ledger.objects) == 3
    assert a.metrics.decisions.labels("refused", "pending-limit")._value.get() == 2
    # Once a pod appears (the booking is Bound) there is room again; dry runs book nothing and pass.
    first = ledger.objects[0]
    bound = replace(
        first,
        spec=replace(first.spec, pod_name="first-pod"),
        status=replace(first.status, phase=ReservationPhase.BOUND),
    )
    ledger.objects[0] = bound
    assert (await a.review(request("100", uid="real")))["response"]["allowed"]
    assert (await admitter(ledger, max_pending_per_namespace=1).review(request("100", dry_run=True)))[
        "response"
    ]["allowed"]


EXECUTOR_POD = {"labels": {"kubernetes_executor": "True", "dag_id": "d", "task_id": "t"}}


def refusal_of(review: rv.Review) -> tuple[int, str, Any]:
    status = review["response"]["status"]
    return status["code"], status["message"], status.get("details")


async def test_the_executors_pods_are_refused_so_it_requeues_them_without_pausing_others() -> None:
    ledger = MemoryLedger()
    code, message, details = refusal_of(await admitter(ledger).review(request("20000", **EXECUTOR_POD)))
    # The executor re-queues a 403 whose message contains "exceeded quota"; no Retry-After, which
    # would pause the creation of every pod.
    assert (code, details) == (403, None)
    assert "exceeded quota" in message
    assert "re-queues the task without spending a try" in message
    # Even where 429 is the default for the KubernetesPodOperator's pods.
    code, message, details = refusal_of(
        await admitter(ledger, denial_code=429).review(request("20000", uid="u2", **EXECUTOR_POD))
    )
    assert (code, details) == (403, None)
    assert "exceeded quota" in message
    # Other pods keep the configured default, without the quota words.
    code, message, _ = refusal_of(await admitter(ledger).review(request("20000", uid="u3")))
    assert code == 403
    assert "exceeded quota" not in message
    assert "after its retry_delay" in message
    assert ledger.objects == []


async def test_the_refusal_is_chosen_per_pod_then_per_namespace_and_a_bad_value_is_a_400() -> None:
    ledger = MemoryLedger()
    labelled = admitter(
        ledger,
        cluster=ClusterView(namespace_labels=lambda namespace: {"vramshare.io/refusal": "retry-after"}),
        retry_after_s=40,
    )
    code, message, details = refusal_of(await labelled.review(request("20000", **EXECUTOR_POD)))
    assert (code, details) == (429, {"retryAfterSeconds": 40})  # nothing frees: the longest wait
    assert "retry after 40 s" in message
    code, message, details = refusal_of(
        await labelled.review(request("20000", uid="u2", annotations={"gpu-refusal": "Requeue"}))
    )
    assert (code, details) == (403, None)
    assert "exceeded quota" in message
    code, _, _ = refusal_of(
        await labelled.review(
            request("20000", uid="u3", annotations={"gpu-refusal": "forbidden"}, **EXECUTOR_POD)
        )
    )
    assert code == 403
    bad = await labelled.review(request("1000", uid="u4", annotations={"gpu-refusal": "later"}))
    assert refusal_of(bad)[:2] == (
        400,
        'annotation "gpu-refusal" is "later": accepted values are forbidden, retry-after, requeue',
    )
    assert ledger.objects == []


def test_the_executor_refusal_setting_is_checked() -> None:
    env = {"VRAMSHARE_EXECUTOR_REFUSAL": "forbidden", **TLS_FILES}
    assert WebhookSettings.from_env(env).executor_refusal == "forbidden"
    with pytest.raises(SettingsError, match="VRAMSHARE_EXECUTOR_REFUSAL='never' is not valid"):
        WebhookSettings.from_env({**env, "VRAMSHARE_EXECUTOR_REFUSAL": "never"})


@pytest.mark.parametrize("metadata", [True, "\x00huge:1000", ["a"], {"annotations": 7, "labels": "x"}])
async def test_the_refusal_choice_reads_any_body_without_failing(metadata: Any) -> None:
    # Found by the fuzzer: choosing the refusal read metadata before the pod's shape was checked.
    req = request()
    req = replace(req, object={"metadata": metadata, "spec": {}})
    review = await admitter(MemoryLedger()).review(req)
    assert review["response"]["uid"] == "u1"
    assert review["response"]["allowed"] in (True, False)


async def test_runtime_class_mode_sets_the_class_and_refuses_another() -> None:
    ledger = MemoryLedger()
    admitted = await delivering(ledger, delivery_mode=DeliveryMode.RUNTIME_CLASS).review(request())
    ops = patch_of(admitted)
    assert {"op": "add", "path": "/spec/runtimeClassName", "value": "nvidia"} in ops
    assert env_of(admitted)["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")  # the variable in every mode
    # Its own class named already: kept, nothing added.
    same = await delivering(ledger, delivery_mode=DeliveryMode.RUNTIME_CLASS).review(
        with_spec(request(uid="u2"), runtimeClassName="nvidia")
    )
    assert same["response"]["allowed"]
    assert not [o for o in patch_of(same) if o["path"] == "/spec/runtimeClassName"]
    other = await delivering(ledger, delivery_mode=DeliveryMode.RUNTIME_CLASS).review(
        with_spec(request(uid="u3"), runtimeClassName="kata")
    )
    assert other["response"]["status"]["code"] == 400
    assert other["response"]["status"]["message"] == (
        'pod spec.runtimeClassName is "kata": vramshare delivers GPUs through the runtime class "nvidia" '
        'here (delivery mode runtime-class); leave runtimeClassName unset or set it to "nvidia"'
    )
    assert len(ledger.objects) == 2  # the refused pod booked nothing
    # env mode adds no class; runtime-class is the default.
    plain = await admitter(ledger, delivery_mode=DeliveryMode.ENV).review(request(uid="u4"))
    assert not [o for o in patch_of(plain) if o["path"] == "/spec/runtimeClassName"]


async def test_the_namespace_label_chooses_the_mode_and_a_bad_one_is_named() -> None:
    ledger = MemoryLedger()
    chosen = await delivering(ledger, label="runtime-class").review(request())
    assert {"op": "add", "path": "/spec/runtimeClassName", "value": "nvidia"} in patch_of(chosen)
    back = await delivering(ledger, label="env", delivery_mode=DeliveryMode.RUNTIME_CLASS).review(
        request(uid="u2")
    )
    assert not [o for o in patch_of(back) if o["path"] == "/spec/runtimeClassName"]
    bad = await delivering(ledger, label="cdi-please").review(request(uid="u3"))
    assert bad["response"]["status"]["code"] == 400
    assert bad["response"]["status"]["message"] == (
        'namespace label "vramshare.io/delivery" is "cdi-please": accepted values are env, runtime-class, '
        "cdi, volume-mounts"
    )


async def test_cdi_requests_for_nvidia_gpus_are_removed_from_every_pod_and_others_kept() -> None:
    cdi = {"cdi.k8s.io/all-gpus": "nvidia.com/gpu=all", "cdi.k8s.io/fpga": "vendor.com/fpga=0"}
    hidden = await admitter(MemoryLedger()).review(request(None, annotations=cdi))
    annotations = next(o["value"] for o in patch_of(hidden) if o["path"] == "/metadata/annotations")
    assert annotations == {"cdi.k8s.io/fpga": "vendor.com/fpga=0"}
    assert hidden["response"]["warnings"] == [
        "vramshare removed annotation cdi.k8s.io/all-gpus: GPUs in this namespace are booked with the "
        'annotation "gpu-mem-mb"'
    ]
    admitted = await admitter(MemoryLedger()).review(request(annotations=cdi))
    annotations = next(o["value"] for o in patch_of(admitted) if o["path"] == "/metadata/annotations")
    assert "cdi.k8s.io/all-gpus" not in annotations
    assert annotations["cdi.k8s.io/fpga"] == "vendor.com/fpga=0"


def test_the_runtime_class_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="VRAMSHARE_RUNTIME_CLASS_NAME"):
        WebhookSettings.from_env(
            {
                "VRAMSHARE_RUNTIME_CLASS_NAME": "No Such/Class",
                "VRAMSHARE_TLS_CERT_FILE": "c",
                "VRAMSHARE_TLS_KEY_FILE": "k",
            }
        )
    settings = WebhookSettings.from_env(
        {
            "VRAMSHARE_DELIVERY_MODE": "runtime-class",
            "VRAMSHARE_TLS_CERT_FILE": "c",
            "VRAMSHARE_TLS_KEY_FILE": "k",
        }
    )
    assert settings.delivery_mode is DeliveryMode.RUNTIME_CLASS
