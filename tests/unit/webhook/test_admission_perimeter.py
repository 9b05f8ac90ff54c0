"""The Admitter at the edges of a booking: pods it hides, debug containers, bookings whose pods never
appear, the refusal chosen for executors, delivery modes and CDI requests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.unit.webhook.fakes import (
    TLS_FILES,
    MemoryLedger,
    admitter,
    delivering,
    env_list,
    env_of,
    patch_of,
    request,
    with_spec,
)
from vramshare.domain import ReservationPhase
from vramshare.kube.objects import GpuReservation
from vramshare.settings import SettingsError
from vramshare_webhook import review as rv
from vramshare_webhook.admission import ClusterView
from vramshare_webhook.delivery_modes import DeliveryMode
from vramshare_webhook.settings import WebhookSettings


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
