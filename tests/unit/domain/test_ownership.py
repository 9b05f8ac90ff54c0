"""Whose GPUs these are (issue #43): a node where NVIDIA's device plugin advertises nvidia.com/gpu is not
vramshare's to share unless dedicated; its GPUs are NotShared, with no headroom, and no pod is placed
there, with a refusal that says why."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.domain.builders import NOW, gpu
from tests.unit.domain.test_inventory import SETTINGS, sample
from vramshare.domain import AllocationRequest, AllocationSettings, Refusal, choose
from vramshare.domain.inventory import DeviceState, observe
from vramshare.domain.messages import refusal_message
from vramshare.domain.ownership import (
    DEDICATED_LABEL,
    GPU_OPERATOR_PLUGIN_LABEL,
    NodeGpus,
    not_shared,
    ownership,
)


@given(
    advertised=st.sampled_from([None, "0", "1", "8", "x"]),
    dedicated=st.sampled_from([None, "true", "false"]),
    plugin_off=st.sampled_from([None, "false", "true"]),
)
def test_a_node_is_not_vramshares_where_the_device_plugin_advertises_gpus_and_it_is_not_dedicated(
    advertised: str | None, dedicated: str | None, plugin_off: str | None
) -> None:
    labels = {
        **({DEDICATED_LABEL: dedicated} if dedicated else {}),
        **({GPU_OPERATOR_PLUGIN_LABEL: plugin_off} if plugin_off else {}),
    }
    allocatable = {"nvidia.com/gpu": advertised} if advertised is not None else {}
    found = not_shared([NodeGpus(name="n", labels=labels, allocatable=allocatable)])
    expected = advertised not in (None, "0") and dedicated != "true" and plugin_off != "false"
    assert ("n" in found) is expected
    if expected:
        assert "advertises nvidia.com/gpu" in found["n"]
        assert f"{DEDICATED_LABEL}=true" in found["n"]


def test_gpus_on_such_a_node_are_not_shared_with_no_headroom_and_a_reason() -> None:
    owned = ownership([NodeGpus(name="node-b", labels={}, allocatable={"nvidia.com/gpu": "2"})])
    why = owned.nodes
    statuses = observe(
        known=[],
        samples=[sample("GPU-1", node="node-a"), sample("GPU-2", node="node-b")],
        reservations=[],
        nodes={"node-a", "node-b"},
        now=NOW,
        settings=SETTINGS,
        ownership=owned,
    )
    by_uuid = {s.gpu.uuid: s for s in statuses}
    assert by_uuid["GPU-1"].state is DeviceState.READY
    assert by_uuid["GPU-2"].state is DeviceState.NOT_SHARED
    assert by_uuid["GPU-2"].headroom.headroom_mib == 0
    assert by_uuid["GPU-2"].message == why["node-b"]
    assert by_uuid["GPU-2"].gpu.not_shared == why["node-b"]


def test_a_pod_is_never_placed_on_a_gpu_not_shared_and_the_refusal_says_why() -> None:
    shared = gpu("GPU-1", node="node-a", total=16_000)
    theirs = replace(
        gpu("GPU-2", node="node-b", total=80_000), not_shared="node node-b advertises nvidia.com/gpu"
    )
    request = AllocationRequest(mib=40_000, namespace="airflow", pod="big")
    choice = choose(request, [shared, theirs], [], settings=AllocationSettings(), now=NOW)
    assert isinstance(choice, Refusal)
    message = refusal_message(choice, max_sample_age_s=120, retry_hint="")
    assert "GPU-2 (node-b, index 0)" in message
    assert "not shared: node node-b advertises nvidia.com/gpu" in message
    small_request = AllocationRequest(mib=1000, namespace="airflow", pod="small")
    small = choose(small_request, [shared, theirs], [], settings=AllocationSettings(), now=NOW)
    assert not isinstance(small, Refusal)
    assert small.gpu.uuid == "GPU-1"
