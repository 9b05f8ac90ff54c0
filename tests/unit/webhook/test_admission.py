"""The Admitter against an in-memory ledger: outcomes, conflict retries, reinvocation, taken names,
bad input, errors and its settings."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.unit.domain.builders import NOW, gpu
from tests.unit.webhook.fakes import (
    TLS_FILES,
    MemoryLedger,
    admitter,
    airflow,
    applied,
    patch_of,
    request,
)
from vramshare.settings import SettingsError
from vramshare_webhook.admission import ClusterView
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
