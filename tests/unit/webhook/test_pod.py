"""Patch building and pod reading: existing env, affinity terms, init containers, escaping."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.unit.webhook.fakes import apply
from vramshare_webhook.patching import pointer
from vramshare_webhook.pod import (
    Placement,
    pinned_nodes,
    placement_of,
    queued_entry_of,
    requested_device_resources,
    spoofed,
)
from vramshare_webhook.pod_patch import hide_gpus_patch, placement_patch

PLACE = Placement(reservation="task-1-abcd", gpu_uuid="GPU-1", gpu_index=2, node="gpu-node-a")


def pod(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "task-1", "annotations": {"gpu-mem-mb": "4096"}},
        "spec": {"containers": [{"name": "base", "image": "x"}], **spec},
    }


def env(container: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e["name"], e.get("value", "")) for e in container.get("env", [])]


def test_pointer_escapes_per_rfc_6901() -> None:
    assert (
        pointer("metadata", "annotations", "vramshare.io/gpu-uuid")
        == "/metadata/annotations/vramshare.io~1gpu-uuid"
    )
    assert pointer("a~b", 0) == "/a~0b/0"


def test_env_is_set_in_every_container_and_init_container_replacing_user_values() -> None:
    p = pod(
        initContainers=[
            {"name": "init", "image": "x", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
        ]
    )
    p["spec"]["containers"].append(
        {
            "name": "side",
            "image": "x",
            "env": [
                {"name": "A", "value": "1"},
                {"name": "CUDA_VISIBLE_DEVICES", "value": "3"},
                {"name": "CUDA_VISIBLE_DEVICES", "value": "4"},
            ],
        }
    )
    out = apply(p, placement_patch(p, PLACE))
    ours = [("NVIDIA_VISIBLE_DEVICES", "GPU-1"), ("CUDA_VISIBLE_DEVICES", "0")]
    assert env(out["spec"]["initContainers"][0]) == ours
    assert env(out["spec"]["containers"][0]) == ours
    assert env(out["spec"]["containers"][1]) == [("A", "1"), *ours]


def test_affinity_is_added_when_there_is_none() -> None:
    out = apply(pod(), placement_patch(pod(), PLACE))
    terms = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-a"]}]}]


def test_affinity_is_anded_into_every_existing_term_and_other_affinities_kept() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]},
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {}}],
        },
        "podAntiAffinity": {"x": 1},
    }
    p = pod(affinity=affinity)
    out = apply(p, placement_patch(p, PLACE))
    ours = {"key": "metadata.name", "operator": "In", "values": ["gpu-node-a"]}
    node_affinity = out["spec"]["affinity"]["nodeAffinity"]
    terms = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"] == [{"key": "zone", "operator": "In", "values": ["z1"]}]
    assert terms[0]["matchFields"] == [ours]
    assert terms[1]["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}, ours]
    assert "matchExpressions" not in terms[1]
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 1, "preference": {}}
    ]
    assert out["spec"]["affinity"]["podAntiAffinity"] == {"x": 1}
    assert p["spec"]["affinity"] == affinity  # the input is not modified


def test_annotations_replace_user_set_vramshare_keys_and_keep_others() -> None:
    p = pod()
    p["metadata"]["annotations"].update(
        {"vramshare.io/gpu-uuid": "GPU-mine", "vramshare.io/x": "y", "team": "a"}
    )
    out = apply(p, placement_patch(p, PLACE))
    assert out["metadata"]["annotations"] == {
        "gpu-mem-mb": "4096",
        "team": "a",
        "vramshare.io/reservation": "task-1-abcd",
        "vramshare.io/gpu-uuid": "GPU-1",
        "vramshare.io/gpu-index": "2",
        "vramshare.io/node": "gpu-node-a",
    }
    assert placement_of(out) == PLACE
    assert out["metadata"]["labels"] == {"vramshare.io/reservation": "task-1-abcd"}
    assert sorted(spoofed(p)) == ["annotation vramshare.io/gpu-uuid", "annotation vramshare.io/x"]


def test_reservation_label_replaces_user_set_vramshare_labels_and_keeps_others() -> None:
    p = pod()
    p["metadata"]["labels"] = {"app": "train", "vramshare.io/reservation": "stolen", "vramshare.io/x": "1"}
    out = apply(p, placement_patch(p, PLACE))
    assert out["metadata"]["labels"] == {"app": "train", "vramshare.io/reservation": "task-1-abcd"}


def test_pod_without_annotations_map_gets_one() -> None:
    p = {"metadata": {"generateName": "t-"}, "spec": {"containers": [{"name": "c"}]}}
    out = apply(p, placement_patch(p, PLACE))
    assert out["metadata"]["annotations"]["vramshare.io/reservation"] == "task-1-abcd"


def test_hide_gpus_sets_none_everywhere() -> None:
    p = pod(initContainers=[{"name": "i"}])
    p["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    out = apply(p, hide_gpus_patch(p))
    for c in (*out["spec"]["initContainers"], *out["spec"]["containers"]):
        assert env(c) == [("NVIDIA_VISIBLE_DEVICES", "void")]


def hostname_terms(*terms: list[str]) -> dict[str, Any]:
    """A required node affinity with one term per list, each allowing those hostnames."""
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": hosts}
                            ]
                        }
                        for hosts in terms
                    ]
                }
            }
        }
    }


@pytest.mark.parametrize(
    ("spec", "nodes"),
    [
        ({}, None),
        ({"nodeName": "n1"}, {"n1"}),
        ({"nodeSelector": {"kubernetes.io/hostname": "n2"}}, {"n2"}),
        (hostname_terms(["n3"]), {"n3"}),
        (hostname_terms(["n3"], ["n3"]), {"n3"}),
        (hostname_terms(["n3", "n4"]), {"n3", "n4"}),
        (hostname_terms(["n3"], ["n4"]), {"n3", "n4"}),
        ({**hostname_terms(["n3", "n4"]), "nodeSelector": {"kubernetes.io/hostname": "n4"}}, {"n4"}),
        ({**hostname_terms(["n3"]), "nodeSelector": {"kubernetes.io/hostname": "n4"}}, set()),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n3"]}
                                    ]
                                },
                                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]},
                            ]
                        }
                    }
                }
            },
            None,
        ),
    ],
)
def test_pinned_nodes(spec: dict[str, Any], nodes: set[str] | None) -> None:
    assert pinned_nodes(pod(**spec)) == (None if nodes is None else frozenset(nodes))


def test_device_plugin_resources_are_detected() -> None:
    p = pod()
    p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1, "cpu": "1"}}
    assert requested_device_resources(p) == ["nvidia.com/gpu"]
    assert requested_device_resources(pod()) == []


def test_a_pod_with_several_gpus_sees_them_all_numbered_from_zero() -> None:
    place = Placement(
        reservation="task-1-abcd",
        gpu_uuid="GPU-1",
        gpu_index=2,
        node="gpu-node-a",
        more=(("GPU-2", 3), ("GPU-3", 0)),
    )
    two = pod(initContainers=[{"name": "init", "image": "x"}])
    patched = apply(two, placement_patch(two, place))
    for container in patched["spec"]["containers"] + patched["spec"]["initContainers"]:
        assert ("NVIDIA_VISIBLE_DEVICES", "GPU-1,GPU-2,GPU-3") in env(container)
        assert ("CUDA_VISIBLE_DEVICES", "0,1,2") in env(container)
    annotations = patched["metadata"]["annotations"]
    assert annotations["vramshare.io/gpu-uuid"] == "GPU-1,GPU-2,GPU-3"
    assert annotations["vramshare.io/gpu-index"] == "2,3,0"
    assert placement_of(patched) == place  # a reinvocation reads back the same set
    broken = copy.deepcopy(patched)
    broken["metadata"]["annotations"]["vramshare.io/gpu-index"] = "2,3"
    assert placement_of(broken) is None


def carrying(**annotations: str) -> dict[str, Any]:
    p = pod()
    p["metadata"]["annotations"] |= {
        "vramshare.io/reservation": "task-1-abcd",
        "vramshare.io/gpu-uuid": "GPU-1",
        "vramshare.io/gpu-index": "2",
        "vramshare.io/node": "gpu-node-a",
        **annotations,
    }
    return p


def test_a_genuine_looking_placement_is_read_back() -> None:
    assert placement_of(carrying()) == PLACE


@pytest.mark.parametrize(
    "annotations",
    [
        {"vramshare.io/reservation": "../gpureservations?watch=true"},
        {"vramshare.io/reservation": "a/b"},
        {"vramshare.io/reservation": "x" * 300},
        {"vramshare.io/reservation": "Upper"},
        {"vramshare.io/reservation": ""},
        {"vramshare.io/node": "node/../../api"},
        {"vramshare.io/gpu-uuid": "GPU-1?watch=1"},
        {"vramshare.io/gpu-uuid": "../x"},
    ],
)
def test_a_placement_whose_names_cannot_be_ours_is_not_read(annotations: dict[str, str]) -> None:
    """Such a pod is decided afresh: nothing it carries is looked up (it used to become an API path)."""
    assert placement_of(carrying(**annotations)) is None


def test_a_queue_entry_name_that_cannot_be_ours_is_not_read() -> None:
    p = pod()
    p["metadata"]["annotations"]["vramshare.io/reservation"] = "../gpureservations?watch=true"
    assert queued_entry_of(p) is None
    p["metadata"]["annotations"]["vramshare.io/reservation"] = "task-1-queued"
    assert queued_entry_of(p) == "task-1-queued"


def test_a_node_name_pin_in_match_fields_confines_the_pod() -> None:
    """vramshare's own pin (a reinvocation sees it) and a user's, read the same way."""
    terms = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n7"]}]}
                ]
            }
        }
    }
    assert pinned_nodes(pod(affinity=terms)) == {"n7"}
    pinned = apply(pod(), placement_patch(pod(), PLACE))
    assert pinned_nodes(pinned) == {"gpu-node-a"}
    again = apply(pinned, placement_patch(pinned, PLACE))  # a reinvocation: not repeated
    (term,) = again["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-a"]}]


def test_a_users_copy_of_the_queue_gate_is_removed_on_direct_admission() -> None:
    gated = pod(schedulingGates=[{"name": "vramshare.io/gpu-memory"}, {"name": "team.example/review"}])
    placed = apply(gated, placement_patch(gated, PLACE))
    assert placed["spec"]["schedulingGates"] == [{"name": "team.example/review"}]
    assert "schedulingGates" not in apply(pod(), placement_patch(pod(), PLACE))["spec"]
