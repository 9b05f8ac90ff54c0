"""Hold what you share (issue #43): which GPUs of a device-plugin node vramshare shares (those it holds),
and how holds follow demand (a warm minimum of idle held GPUs per node, the surplus given back after
idle_release_s), never beyond the caps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vramshare.domain.holds import (
    RELEASE_SETTLE_S,
    Holder,
    HolderState,
    HoldNode,
    HoldPlan,
    HoldSettings,
    held,
    lost,
    plan_holds,
)
from vramshare.domain.ownership import (
    REPLICAS_LABEL,
    DevicePluginGpus,
    NodeGpus,
    ownership,
)

NOW = 10_000.0


def holder(name: str, node: str = "n1", uuid: str = "", state: HolderState = HolderState.HOLDING) -> Holder:
    return Holder(name=name, node=node, gpu_uuid=uuid, state=state)


def plugin_node(name: str = "n1", gpus: int = 4, **labels: str) -> NodeGpus:
    return NodeGpus(name=name, labels=labels, allocatable={"nvidia.com/gpu": str(gpus)})


def test_on_a_device_plugin_node_only_the_held_gpus_are_shared() -> None:
    owned = ownership(
        [plugin_node()],
        mode=DevicePluginGpus.HOLD,
        holders=[holder("h1", uuid="GPU-a"), holder("h2", state=HolderState.ACQUIRING)],
        gpus_seen={"n1": 4},
    )
    assert owned.reason(node="n1", uuid="GPU-a") == ""
    why = owned.reason(node="n1", uuid="GPU-b")
    assert why.startswith("not held: node n1 advertises nvidia.com/gpu: 4")
    assert "acquiring one now (holder pod h2)" in why
    assert owned.reason(node="elsewhere", uuid="GPU-z") == ""


def test_a_holder_that_is_leaving_or_has_not_said_its_gpu_holds_nothing() -> None:
    holders = [
        holder("gone", uuid="GPU-a", state=HolderState.LEAVING),
        holder("new", uuid="GPU-b", state=HolderState.ACQUIRING),
    ]
    owned = ownership([plugin_node()], mode=DevicePluginGpus.HOLD, holders=holders, gpus_seen={"n1": 4})
    assert owned.reason(node="n1", uuid="GPU-a")
    assert owned.reason(node="n1", uuid="GPU-b")


@given(
    mode=st.sampled_from(list(DevicePluginGpus)),
    replicas_label=st.sampled_from([None, "1", "4"]),
    advertised=st.sampled_from([2, 8]),
    can_hold=st.booleans(),
)
def test_time_sliced_gpus_and_exclude_mode_share_nothing_held_or_not(
    mode: DevicePluginGpus, replicas_label: str | None, advertised: int, can_hold: bool
) -> None:
    labels = {REPLICAS_LABEL: replicas_label} if replicas_label else {}
    node = plugin_node(gpus=advertised, **labels)
    owned = ownership(
        [node], mode=mode, holders=[holder("h", uuid="GPU-a")], gpus_seen={"n1": 2}, can_hold=can_hold
    )
    sliced = replicas_label == "4" or advertised > 2
    if sliced:
        assert "time-slicing or MPS" in owned.reason(node="n1", uuid="GPU-a")
    shared = not sliced and mode is DevicePluginGpus.HOLD and can_hold
    assert (owned.reason(node="n1", uuid="GPU-a") == "") is shared
    assert owned.reason(node="n1", uuid="GPU-b") != ""


def test_a_dedicated_node_is_vramshares_whatever_it_advertises() -> None:
    owned = ownership(
        [plugin_node(**{"vramshare.io/dedicated": "true"})], mode=DevicePluginGpus.HOLD, gpus_seen={"n1": 4}
    )
    assert owned.reason(node="n1", uuid="GPU-a") == ""


def test_each_node_gets_one_idle_held_gpu_and_no_more_while_one_is_on_its_way() -> None:
    nodes = [
        HoldNode(name="n1", advertised=4),
        HoldNode(name="n2", advertised=4),
        HoldNode(name="n3", advertised=4, schedulable=False),
    ]
    first = plan_holds(nodes=nodes, holders=[], booked=set(), idle_since={}, now=NOW, settings=HoldSettings())
    assert first.acquire == {"n1": 1, "n2": 1}
    pending = [holder("h1", "n1", state=HolderState.ACQUIRING), holder("h2", "n2", uuid="GPU-2")]
    second = plan_holds(
        nodes=nodes, holders=pending, booked=set(), idle_since={}, now=NOW, settings=HoldSettings()
    )
    assert second.acquire == {}
    assert second.release == ()


def test_a_booking_on_the_last_idle_held_gpu_acquires_another() -> None:
    nodes = [HoldNode(name="n1", advertised=4)]
    holders = [holder("h1", uuid="GPU-1")]
    plan = plan_holds(
        nodes=nodes, holders=holders, booked={"GPU-1"}, idle_since={}, now=NOW, settings=HoldSettings()
    )
    assert plan.acquire == {"n1": 1}


def test_an_idle_surplus_is_given_back_after_idle_release_s_the_longest_idle_first() -> None:
    nodes = [HoldNode(name="n1", advertised=4)]
    holders = [holder("h1", uuid="GPU-1"), holder("h2", uuid="GPU-2"), holder("h3", uuid="GPU-3")]
    settings = HoldSettings(idle_release_s=300)
    idle = {"GPU-1": NOW - 400, "GPU-2": NOW - 350, "GPU-3": NOW - 10}
    plan = plan_holds(nodes=nodes, holders=holders, booked=set(), idle_since=idle, now=NOW, settings=settings)
    assert plan.release == ("h1", "h2")
    early = {"GPU-1": NOW - 100, "GPU-2": NOW - 100, "GPU-3": NOW - 10}
    assert (
        plan_holds(
            nodes=nodes, holders=holders, booked=set(), idle_since=early, now=NOW, settings=settings
        ).release
        == ()
    )


@given(
    advertised=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    held_per_node=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    booked_share=st.floats(0, 1),
    min_idle=st.integers(0, 3),
    max_per_node=st.integers(0, 4),
    max_total=st.integers(0, 10),
    idle_for=st.floats(0, 1000),
)
def test_holds_never_exceed_the_caps_and_a_booked_gpu_is_never_given_back(
    advertised: list[int],
    held_per_node: list[int],
    booked_share: float,
    min_idle: int,
    max_per_node: int,
    max_total: int,
    idle_for: float,
) -> None:
    nodes = [HoldNode(name=f"n{i}", advertised=a) for i, a in enumerate(advertised)]
    holders = [
        holder(f"h{i}-{j}", f"n{i}", uuid=f"GPU-{i}-{j}")
        for i, node in enumerate(nodes)
        for j in range(min(held_per_node[i], node.advertised))
    ]
    uuids = sorted(h.gpu_uuid for h in holders)
    booked = set(uuids[: int(len(uuids) * booked_share)])
    settings = HoldSettings(
        min_idle_per_node=min_idle, max_per_node=max_per_node, max_total=max_total, idle_release_s=300
    )
    since = dict.fromkeys(uuids, NOW - idle_for)
    plan = plan_holds(
        nodes=nodes, holders=holders, booked=booked, idle_since=since, now=NOW, settings=settings
    )
    released = set(plan.release)
    assert not {h.gpu_uuid for h in holders if h.name in released} & booked
    total_before = len(holders)
    for node in nodes:
        mine = [h for h in holders if h.node == node.name]
        cap = node.advertised if max_per_node <= 0 else min(node.advertised, max_per_node)
        adding = plan.acquire.get(node.name, 0)
        if adding:
            assert len(mine) + adding <= cap
        idle_after = [h for h in mine if h.gpu_uuid not in booked and h.name not in released]
        idle_before = [h for h in mine if h.gpu_uuid not in booked]
        # Never released below the warm minimum.
        assert len(idle_after) >= min(min_idle, len(idle_before))
    if max_total > 0 and plan.acquire:
        assert total_before + sum(plan.acquire.values()) <= max(max_total, total_before)


def test_a_lost_hold_is_one_with_bookings_whose_holder_went() -> None:
    before = held([holder("h1", uuid="GPU-1"), holder("h2", uuid="GPU-2"), holder("h3", uuid="GPU-3")])
    after = held([holder("h3", uuid="GPU-3")])
    assert [h.name for h in lost(before, after, booked={"GPU-1", "GPU-3"})] == ["h1"]


def test_a_released_gpu_leaves_sharing_before_its_holder_goes_and_a_late_booking_keeps_it() -> None:
    nodes = [HoldNode(name="n1", advertised=4)]
    releasing = Holder(
        name="h2", node="n1", gpu_uuid="GPU-2", state=HolderState.RELEASING, release_requested_at=NOW - 5
    )
    holders = [holder("h1", uuid="GPU-1"), releasing]
    owned = ownership([plugin_node()], mode=DevicePluginGpus.HOLD, holders=holders, gpus_seen={"n1": 4})
    assert owned.reason(node="n1", uuid="GPU-2").startswith("being given back to NVIDIA's device plugin")
    assert owned.reason(node="n1", uuid="GPU-1") == ""

    def plan(*, booked: set[str], out: set[str], at: float = NOW) -> HoldPlan:
        return plan_holds(
            nodes=nodes,
            holders=holders,
            booked=booked,
            idle_since={},
            now=at,
            settings=HoldSettings(),
            out_of_sharing=out,
        )

    # Not yet out of sharing where the webhook reads it: the holder stays.
    assert plan(booked=set(), out=set()).give_back == ()
    # Out of sharing, nothing booked, settled: it goes.
    assert plan(booked=set(), out={"GPU-2"}).give_back == ("h2",)
    # Just marked: not before RELEASE_SETTLE_S.
    assert plan(booked=set(), out={"GPU-2"}, at=NOW - 5 + RELEASE_SETTLE_S / 2).give_back == ()
    # A booking landed before the GPU left sharing: it holds on.
    booked = plan(booked={"GPU-2"}, out={"GPU-2"})
    assert booked.give_back == ()
    assert booked.keep == ("h2",)
