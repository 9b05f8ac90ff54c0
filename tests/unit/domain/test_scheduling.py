"""A pod's node constraints against Node objects, as kube-scheduler's filters judge them."""

from __future__ import annotations

import pytest

from tests.unit.domain.builders import NOW, gpu
from vramshare.domain import AllocationRequest, Refusal, choose, refusal_message
from vramshare.domain.scheduling import (
    NodeRules,
    NodeView,
    Requirement,
    Taint,
    Term,
    Toleration,
    schedulable_nodes,
    why_not,
)

T4 = NodeView(
    name="node-b",
    labels={
        "kubernetes.io/hostname": "node-b",
        "nvidia.com/gpu.product": "Tesla-T4",
        "nvidia.com/gpu.count": "3",
    },
)


def term(*requirements: Requirement) -> Term:
    return Term(expressions=requirements)


@pytest.mark.parametrize(
    ("node", "rules", "why"),
    [
        (T4, NodeRules(), None),
        (T4, NodeRules(node_name="node-a"), "the pod is bound to node node-a (spec.nodeName)"),
        (T4, NodeRules(node_selector={"nvidia.com/gpu.product": "Tesla-T4"}), None),
        (
            T4,
            NodeRules(node_selector={"nvidia.com/gpu.product": "A100"}),
            "nodeSelector nvidia.com/gpu.product=A100 does not match (Tesla-T4)",
        ),
        (
            T4,
            NodeRules(
                terms=(
                    term(Requirement(key="nvidia.com/gpu.product", operator="NotIn", values=("Tesla-T4",))),
                )
            ),
            "required node affinity does not match (nvidia.com/gpu.product NotIn (Tesla-T4))",
        ),
        (T4, NodeRules(terms=(term(Requirement(key="zone", operator="DoesNotExist")),)), None),
        (
            T4,
            NodeRules(terms=(term(Requirement(key="zone", operator="Exists")),)),
            "required node affinity does not match (zone Exists)",
        ),
        (
            T4,
            NodeRules(terms=(term(Requirement(key="nvidia.com/gpu.count", operator="Gt", values=("2",))),)),
            None,
        ),
        (
            T4,
            NodeRules(terms=(term(Requirement(key="nvidia.com/gpu.count", operator="Lt", values=("3",))),)),
            "required node affinity does not match (nvidia.com/gpu.count Lt (3))",
        ),
        # Terms are ORed; an empty term matches nothing.
        (
            T4,
            NodeRules(
                terms=(
                    term(Requirement(key="zone", operator="Exists")),
                    term(Requirement(key="type", operator="DoesNotExist")),
                )
            ),
            None,
        ),
        (T4, NodeRules(terms=(Term(),)), "required node affinity does not match"),
        (
            T4,
            NodeRules(
                terms=(Term(fields=(Requirement(key="metadata.name", operator="In", values=("node-b",)),)),)
            ),
            None,
        ),
        (
            T4,
            NodeRules(
                terms=(
                    Term(fields=(Requirement(key="metadata.name", operator="NotIn", values=("node-b",)),)),
                )
            ),
            "required node affinity does not match",
        ),
        (NodeView(name="node-b", unschedulable=True), NodeRules(), "cordoned (spec.unschedulable)"),
        (
            NodeView(name="node-b", unschedulable=True),
            NodeRules(tolerations=(Toleration(key="node.kubernetes.io/unschedulable", operator="Exists"),)),
            None,
        ),
        (NodeView(name="node-b", ready=False), NodeRules(), "NotReady"),
        (
            NodeView(name="node-b", ready=False, taints=(Taint(key="node.kubernetes.io/not-ready"),)),
            NodeRules(),
            "NotReady",
        ),
        (
            NodeView(name="node-b", taints=(Taint(key="gpu", value="training", effect="NoSchedule"),)),
            NodeRules(),
            "taint gpu=training:NoSchedule not tolerated",
        ),
        (
            NodeView(name="node-b", taints=(Taint(key="gpu", value="training", effect="NoSchedule"),)),
            NodeRules(tolerations=(Toleration(key="gpu", value="training"),)),
            None,
        ),
        (
            NodeView(name="node-b", taints=(Taint(key="gpu", value="training", effect="NoSchedule"),)),
            NodeRules(tolerations=(Toleration(key="gpu", value="inference"),)),
            "taint gpu=training:NoSchedule not tolerated",
        ),
        (
            NodeView(name="node-b", taints=(Taint(key="gpu", effect="NoExecute"),)),
            NodeRules(tolerations=(Toleration(key="gpu", operator="Exists", effect="NoSchedule"),)),
            "taint gpu:NoExecute not tolerated",
        ),
        (NodeView(name="node-b", taints=(Taint(key="gpu", effect="PreferNoSchedule"),)), NodeRules(), None),
        (
            NodeView(name="node-b", taints=(Taint(key="anything", effect="NoSchedule"),)),
            NodeRules(tolerations=(Toleration(operator="Exists"),)),
            None,
        ),
    ],
)
def test_why_not(node: NodeView, rules: NodeRules, why: str | None) -> None:
    assert why_not(node, rules) == why


def test_gpu_nodes_without_a_node_object_take_no_pod() -> None:
    allowed, reasons = schedulable_nodes([T4], NodeRules(), gpu_nodes=["node-a", "node-b"])
    assert allowed == {"node-b"}
    assert reasons == {"node-a": "no such Node object"}


def test_the_refusal_names_per_node_why_and_counts_the_rest_by_reason() -> None:
    gpus = [gpu(f"GPU-a{i}", node="node-a", index=i) for i in range(12)] + [
        gpu("GPU-b", node="node-b", used=16_000)
    ]
    request = AllocationRequest(
        mib=4_000,
        namespace="airflow",
        pod="task",
        nodes=frozenset({"node-b"}),
        node_reasons={"node-a": "cordoned (spec.unschedulable)"},
    )
    refusal = choose(
        request,
        gpus,
        [],
        settings=__import__("vramshare.domain", fromlist=["AllocationSettings"]).AllocationSettings(),
        now=NOW,
    )
    assert isinstance(refusal, Refusal)
    message = refusal_message(refusal, max_sample_age_s=120, retry_hint="")
    assert "GPU-a0 (node-a, index 0): node node-a: cordoned (spec.unschedulable)" in message
    assert "and 5 more cordoned (spec.unschedulable)" in message
    assert len(message) < 2_000
