"""Delivery modes cdi and volume-mounts, and hiding against every field NVIDIA's stack reads a GPU
request from: NRI annotations, CDI annotations, device-list mounts, the variable."""

from __future__ import annotations

import asyncio
import copy
import re
from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.webhook.fakes import MemoryLedger, admitter, apply, delivering, patch_of, request, with_spec
from vramshare.domain.delivery_judgement import MODES
from vramshare_webhook.admission import Admitter, ClusterView
from vramshare_webhook.delivery_modes import (
    DEVICE_LIST_ROOT,
    DeliveryMode,
    foreign_gpu_requests,
    is_device_mount,
)
from vramshare_webhook.pod_patch import ephemeral_patch, hide_gpus_patch
from vramshare_webhook.settings import WebhookSettings

UUID = "GPU-a"


def patched(review: Any, req: Any) -> dict[str, Any]:
    return apply(req.object, patch_of(review))


def with_init(req: Any) -> Any:
    return with_spec(
        req,
        initContainers=[{"name": "fetch", "image": "x"}],
        containers=[{"name": "base", "image": "x"}, {"name": "side", "image": "x"}],
    )


async def test_cdi_mode_asks_nvidias_nri_plugin_for_exactly_the_booked_gpus() -> None:
    ledger = MemoryLedger()
    req = with_init(request())
    review = await delivering(ledger, delivery_mode=DeliveryMode.CDI).review(req)
    pod = patched(review, req)
    assert pod["metadata"]["annotations"]["nvidia.cdi.k8s.io/pod"] == f"nvidia.com/gpu={UUID}"
    assert "runtimeClassName" not in pod["spec"]  # the NRI plugin works under any runtime, runc too
    # The variables too, in every container (CUDA numbers from them).
    for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]:
        assert {e["name"]: e["value"] for e in c["env"]}["NVIDIA_VISIBLE_DEVICES"] == UUID


async def test_cdi_mode_names_every_gpu_of_a_set() -> None:
    ledger = MemoryLedger()
    ledger.gpus = tuple(g for g in ledger.gpus)  # GPU-a and GPU-b, one node
    req = request("4096", annotations={"gpu-count": "2"})
    review = await delivering(ledger, delivery_mode=DeliveryMode.CDI).review(req)
    devices = patched(review, req)["metadata"]["annotations"]["nvidia.cdi.k8s.io/pod"].split(",")
    assert sorted(devices) == ["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"]


async def test_a_users_own_nri_request_is_replaced_by_the_booking() -> None:
    ledger = MemoryLedger()
    req = request(annotations={"nvidia.cdi.k8s.io/container.base": "nvidia.com/gpu=all"})
    review = await delivering(ledger, delivery_mode=DeliveryMode.CDI).review(req)
    annotations = patched(review, req)["metadata"]["annotations"]
    # The per-container key would win over the pod's (NRI reads container.<name> first): gone.
    assert "nvidia.cdi.k8s.io/container.base" not in annotations
    assert annotations["nvidia.cdi.k8s.io/pod"] == f"nvidia.com/gpu={UUID}"


async def test_volume_mounts_mode_mounts_the_device_list_in_every_container() -> None:
    ledger = MemoryLedger()
    req = with_init(request())
    review = await delivering(ledger, delivery_mode=DeliveryMode.VOLUME_MOUNTS).review(req)
    pod = patched(review, req)
    assert pod["spec"]["volumes"] == [
        {"name": "vramshare-gpus", "hostPath": {"path": "/dev/null", "type": "CharDevice"}}
    ]
    for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]:
        assert c["volumeMounts"] == [
            {"name": "vramshare-gpus", "mountPath": f"{DEVICE_LIST_ROOT}/{UUID}", "readOnly": True}
        ]


async def test_volume_mounts_mode_uses_the_claim_in_restricted_namespaces() -> None:
    ledger = MemoryLedger()
    req = with_spec(
        request(),
        volumes=[{"name": "data", "emptyDir": {}}],
        containers=[
            {
                "name": "base",
                "image": "x",
                "volumeMounts": [
                    {"name": "data", "mountPath": "/data"},
                    {"name": "data", "mountPath": f"{DEVICE_LIST_ROOT}/all"},  # the user's: removed
                ],
            }
        ],
    )
    review = await delivering(
        ledger, delivery_mode=DeliveryMode.VOLUME_MOUNTS, device_list_claim="gpu-device-list"
    ).review(req)
    pod = patched(review, req)
    assert pod["spec"]["volumes"] == [
        {"name": "data", "emptyDir": {}},
        {
            "name": "vramshare-gpus",
            "persistentVolumeClaim": {"claimName": "gpu-device-list", "readOnly": True},
        },
    ]
    assert [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]] == [
        "/data",
        f"{DEVICE_LIST_ROOT}/{UUID}",
    ]


async def test_volume_mounts_mode_refuses_a_pod_that_uses_the_volumes_name() -> None:
    ledger = MemoryLedger()
    req = with_spec(
        request(),
        volumes=[{"name": "vramshare-gpus", "emptyDir": {}}],
        containers=[
            {
                "name": "base",
                "image": "x",
                "volumeMounts": [{"name": "vramshare-gpus", "mountPath": "/scratch"}],
            }
        ],
    )
    review = await delivering(ledger, delivery_mode=DeliveryMode.VOLUME_MOUNTS).review(req)
    assert review["response"]["status"]["code"] == 400
    assert review["response"]["status"]["message"] == (
        'spec.containers[0] mounts a volume named "vramshare-gpus": vramshare adds the volume of that name '
        "for the GPU's device list (delivery mode volume-mounts); rename the pod's volume"
    )
    assert ledger.objects == []


async def test_modes_that_fix_devices_at_creation_refuse_rather_than_queue() -> None:
    async def second_pod(mode: DeliveryMode) -> Any:
        ledger = MemoryLedger()
        first = await delivering(ledger, delivery_mode=mode).review(request("10000"))
        assert first["response"]["allowed"] is True
        # 12 000 MiB fits neither GPU now (6 384 and 8 192 MiB left), but GPU-a once the first is done.
        later = request("12000", uid="u2", annotations={"gpu-queue": "true"})
        return await delivering(ledger, delivery_mode=mode).review(later)

    for mode in (DeliveryMode.CDI, DeliveryMode.VOLUME_MOUNTS):
        review = await second_pod(mode)
        assert review["response"]["allowed"] is False, mode
        assert review["response"]["status"]["code"] == 403, mode
        assert "pod waits in the queue" not in review["response"]["status"]["message"], mode
    # The same pod in runtime-class mode waits, and is given its class now.
    queued = await second_pod(DeliveryMode.RUNTIME_CLASS)
    assert queued["response"]["allowed"] is True
    assert {"op": "add", "path": "/spec/runtimeClassName", "value": "nvidia"} in patch_of(queued)
    assert "waits in the queue" in queued["response"]["warnings"][0]


def test_foreign_requests_cover_every_key_of_the_nri_plugin_and_every_nvidia_vendor() -> None:
    annotations = {
        "nvidia.cdi.k8s.io": "nvidia.com/gpu=all",
        "nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=0",
        "nvidia.cdi.k8s.io/container.base": "nvidia.com/gpu=GPU-x",
        "cdi.k8s.io/mgmt": "management.nvidia.com/gpu=all",
        "cdi.k8s.io/two": "vendor.com/fpga=0, nvidia.com/gpu=1",
        "cdi.k8s.io/fpga": "vendor.com/fpga=0",
        "nvidia.cdi.k8s.iox": "unrelated",
        "example.com/nvidia.cdi.k8s.io": "unrelated",
    }
    assert foreign_gpu_requests(annotations) == [
        "cdi.k8s.io/mgmt",
        "cdi.k8s.io/two",
        "nvidia.cdi.k8s.io",
        "nvidia.cdi.k8s.io/container.base",
        "nvidia.cdi.k8s.io/pod",
    ]


def test_device_mounts_are_recognised_as_nvidias_runtime_cleans_paths() -> None:
    for path in (
        f"{DEVICE_LIST_ROOT}/all",
        f"{DEVICE_LIST_ROOT}/GPU-x",
        f"/{DEVICE_LIST_ROOT}//0",
        "/var/run/nvidia-container-devices/../nvidia-container-devices/cdi/nvidia.com/gpu/all",
        DEVICE_LIST_ROOT,
        f"{DEVICE_LIST_ROOT}/",
    ):
        assert is_device_mount({"name": "v", "mountPath": path}), path
    for path in ("/var/run/nvidia-container-devicesX/all", "/data", "/run/nvidia-container-devices/0"):
        assert not is_device_mount({"name": "v", "mountPath": path}), path
    assert not is_device_mount({"name": "v"})
    assert not is_device_mount("not a mount")


async def test_a_pod_without_a_request_loses_every_gpu_request_whatever_its_form() -> None:
    req = with_spec(
        request(
            None,
            annotations={
                "nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=all",
                "cdi.k8s.io/x": "nvidia.com/gpu=all",
                "keep": "me",
            },
        ),
        runtimeClassName="nvidia",
        volumes=[{"name": "null", "hostPath": {"path": "/dev/null"}}],
        initContainers=[
            {
                "name": "i",
                "image": "x",
                "volumeMounts": [{"name": "null", "mountPath": f"{DEVICE_LIST_ROOT}/all"}],
            }
        ],
        containers=[
            {
                "name": "base",
                "image": "x",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                "volumeMounts": [
                    {"name": "null", "mountPath": f"{DEVICE_LIST_ROOT}/0"},
                    {"name": "null", "mountPath": "/dev/null-copy"},
                ],
            }
        ],
    )
    review = await admitter(MemoryLedger()).review(req)
    pod = patched(review, req)
    assert pod["metadata"]["annotations"] == {"keep": "me"}
    assert pod["spec"]["initContainers"][0]["volumeMounts"] == []
    assert pod["spec"]["containers"][0]["volumeMounts"] == [{"name": "null", "mountPath": "/dev/null-copy"}]
    assert pod["spec"]["containers"][0]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]


async def test_a_gpu_pod_keeps_only_its_booked_gpu_in_env_mode() -> None:
    req = with_spec(
        request(),
        containers=[
            {
                "name": "base",
                "image": "x",
                "volumeMounts": [{"name": "null", "mountPath": f"{DEVICE_LIST_ROOT}/all"}],
            }
        ],
    )
    review = await admitter(MemoryLedger()).review(req)
    assert patched(review, req)["spec"]["containers"][0]["volumeMounts"] == []


def test_a_debug_container_gets_the_pods_device_list_or_none() -> None:
    placed = {
        "metadata": {
            "annotations": {"vramshare.io/gpu-uuid": "GPU-a,GPU-b"},
            "labels": {"vramshare.io/reservation": "task-1"},
        },
        "spec": {
            "volumes": [{"name": "vramshare-gpus", "hostPath": {"path": "/dev/null"}}],
            "containers": [{"name": "base", "image": "x"}],
            "ephemeralContainers": [{"name": "debug", "image": "x"}],
        },
    }
    debug = apply(placed, ephemeral_patch(placed, gpus=("GPU-a", "GPU-b"), device_lists=True))["spec"][
        "ephemeralContainers"
    ][0]
    assert [m["mountPath"] for m in debug["volumeMounts"]] == [
        f"{DEVICE_LIST_ROOT}/GPU-a",
        f"{DEVICE_LIST_ROOT}/GPU-b",
    ]
    stranger = copy.deepcopy(placed)
    stranger["metadata"] = {}
    stranger["spec"]["ephemeralContainers"][0]["volumeMounts"] = [
        {"name": "vramshare-gpus", "mountPath": f"{DEVICE_LIST_ROOT}/all"}
    ]
    debug = apply(stranger, ephemeral_patch(stranger))["spec"]["ephemeralContainers"][0]
    assert debug["volumeMounts"] == []
    assert debug["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]


_paths = st.sampled_from(
    [
        f"{DEVICE_LIST_ROOT}/all",
        f"{DEVICE_LIST_ROOT}/GPU-1",
        f"//{DEVICE_LIST_ROOT[1:]}/./0",
        "/var/run/nvidia-container-devices/x/../cdi/nvidia.com/gpu/all",
        "/data",
        "/var/run/other",
    ]
)
_keys = st.sampled_from(
    [
        "nvidia.cdi.k8s.io",
        "nvidia.cdi.k8s.io/pod",
        "nvidia.cdi.k8s.io/container.c0",
        "cdi.k8s.io/a",
        "other.io/a",
    ]
)
_values = st.sampled_from(["nvidia.com/gpu=all", "management.nvidia.com/gpu=0", "vendor.com/fpga=0", "x"])


@given(
    annotations=st.dictionaries(_keys, _values, max_size=5),
    mounts=st.lists(st.lists(_paths, max_size=4), min_size=1, max_size=3),
)
def test_hiding_leaves_nothing_nvidias_stack_would_read_as_a_request(
    annotations: dict[str, str], mounts: list[list[str]]
) -> None:
    pod = {
        "metadata": {"name": "p", "annotations": annotations},
        "spec": {
            "containers": [
                {
                    "name": f"c{i}",
                    "image": "x",
                    "volumeMounts": [{"name": "v", "mountPath": p} for p in paths],
                }
                for i, paths in enumerate(mounts)
            ]
        },
    }
    hidden = apply(pod, hide_gpus_patch(pod))
    left = hidden["metadata"].get("annotations", {})
    assert not foreign_gpu_requests(left)
    assert not [k for k in left if k.startswith("nvidia.cdi.k8s.io")]
    assert {k: v for k, v in annotations.items() if k not in foreign_gpu_requests(annotations)} == left
    for before, after in zip(pod["spec"]["containers"], hidden["spec"]["containers"], strict=True):
        # No device-list mount is left, and every other mount of the user's is kept, in order.
        assert [m["mountPath"] for m in after.get("volumeMounts") or []] == [
            m["mountPath"] for m in before["volumeMounts"] if not is_device_mount(m)
        ]
        assert {e["name"]: e["value"] for e in after["env"]} == {"NVIDIA_VISIBLE_DEVICES": "void"}


async def test_a_namespace_names_its_own_device_list_claim_and_a_bad_one_is_named() -> None:
    def labelled(labels: dict[str, str]) -> Admitter:
        return admitter(MemoryLedger(), cluster=ClusterView(namespace_labels=lambda namespace: labels))

    req = request()
    review = await labelled(
        {"vramshare.io/delivery": "volume-mounts", "vramshare.io/device-list-claim": "dev-null"}
    ).review(req)
    (volume,) = patched(review, req)["spec"]["volumes"]
    assert volume == {
        "name": "vramshare-gpus",
        "persistentVolumeClaim": {"claimName": "dev-null", "readOnly": True},
    }
    bad = await labelled(
        {"vramshare.io/delivery": "volume-mounts", "vramshare.io/device-list-claim": "Dev_Null"}
    ).review(req)
    assert bad["response"]["status"]["code"] == 400
    assert bad["response"]["status"]["message"] == (
        'namespace label "vramshare.io/device-list-claim" is "Dev_Null": accepted values are '
        "PersistentVolumeClaim names (lower-case DNS subdomains)"
    )


def test_the_preflight_judges_exactly_the_webhooks_modes() -> None:
    assert tuple(m.value for m in DeliveryMode) == MODES


async def test_the_default_mode_is_runtime_class_as_a_gpu_operator_install_needs() -> None:
    assert WebhookSettings().delivery_mode is DeliveryMode.RUNTIME_CLASS
    review = await admitter(MemoryLedger()).review(request())
    assert {"op": "add", "path": "/spec/runtimeClassName", "value": "nvidia"} in patch_of(review)


def policy_refuses_mount(path: str, *, booked: tuple[str, ...]) -> bool:
    """The chart's hiding policy on one volumeMount of a created pod (its CEL, in Python): a path naming
    nvidia-container-devices is refused unless it is vramshare's mount of a GPU it booked."""
    return "nvidia-container-devices" in path and not any(
        path == f"/var/run/nvidia-container-devices/{u}" for u in booked
    )


@given(
    paths=st.lists(
        st.sampled_from(
            [
                f"{DEVICE_LIST_ROOT}/all",
                f"//{DEVICE_LIST_ROOT[1:]}/./0",
                "/x/nvidia-container-devices",
                "/data/nvidia-container-devices/all",
                "/nvidia-container-devices-cache",
                "/data",
            ]
        ),
        max_size=4,
    )
)
def test_a_gpu_pod_the_policy_would_refuse_for_a_mount_is_refused_before_anything_is_booked(
    paths: list[str],
) -> None:
    """Issue #42, 6: every mount the webhook keeps on a GPU pod it admits passes the hiding policy; a
    pod with one the policy refuses is refused (400) before a booking is made."""
    pod = {
        "metadata": {"name": "task", "annotations": {"gpu-mem-mb": "4096"}},
        "spec": {
            "volumes": [{"name": "v", "emptyDir": {}}],
            "containers": [
                {"name": "base", "image": "x", "volumeMounts": [{"name": "v", "mountPath": p} for p in paths]}
            ],
        },
    }
    ledger = MemoryLedger()
    req = replace(request(), object=pod)
    review = asyncio.run(admitter(ledger).review(req))
    if review["response"]["allowed"]:
        (booking,) = ledger.objects
        kept = [m["mountPath"] for m in patched(review, req)["spec"]["containers"][0].get("volumeMounts", [])]
        assert not [p for p in kept if policy_refuses_mount(p, booked=(booking.spec.gpu_uuid,))]
    else:
        assert review["response"]["status"]["code"] == 400
        assert "nvidia-container-devices" in review["response"]["status"]["message"]
        assert ledger.objects == []
        assert any(policy_refuses_mount(p, booked=()) and not p.startswith(DEVICE_LIST_ROOT) for p in paths)


def policy_refuses_host_path(path: str) -> bool:
    """The chart's hiding policy on one hostPath volume (its CEL `matches`, in Python)."""
    return path != "/dev/null" and bool(re.search(r"^/+$|^/+dev(/.*)?$|nvidia", path))


@given(
    privileged=st.lists(st.sampled_from([None, False, True]), min_size=1, max_size=3),
    host_paths=st.lists(
        st.sampled_from(
            ["/", "//", "/dev", "//dev/nvidia0", "/dev/shm", "/run/nvidia/driver", "/data", "/devices"]
        ),
        max_size=3,
    ),
)
def test_a_gpu_pod_that_would_see_every_gpu_is_refused_before_anything_is_booked(
    privileged: list[bool | None], host_paths: list[str]
) -> None:
    """Issue #42, 9: a privileged container or a hostPath of the node's devices shows the container every
    GPU, whatever NVIDIA_VISIBLE_DEVICES says: such a GPU pod is refused (400, naming the field) with
    nothing booked, exactly when the chart's hiding policy would refuse it."""
    containers = [
        {"name": f"c{i}", "image": "x", **({} if p is None else {"securityContext": {"privileged": p}})}
        for i, p in enumerate(privileged)
    ]
    volumes = [{"name": f"h{i}", "hostPath": {"path": p}} for i, p in enumerate(host_paths)]
    pod = {
        "metadata": {"name": "task", "annotations": {"gpu-mem-mb": "4096"}},
        "spec": {"volumes": volumes, "containers": containers},
    }
    ledger = MemoryLedger()
    review = asyncio.run(admitter(ledger).review(replace(request(), object=pod)))
    refused = any(p is True for p in privileged) or any(policy_refuses_host_path(p) for p in host_paths)
    assert review["response"]["allowed"] is not refused
    if refused:
        status = review["response"]["status"]
        assert status["code"] == 400
        assert "privileged: true" in status["message"] or "hostPath" in status["message"]
        assert ledger.objects == []
    else:
        assert len(ledger.objects) == 1
