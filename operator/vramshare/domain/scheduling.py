"""Which nodes the scheduler could bind a pod to: its node constraints against the Node objects.

vramshare pins a pod to the node of the GPU it books. A GPU on a node the pod can never be scheduled
onto (cordoned, NotReady, a taint the pod does not tolerate, a label its nodeSelector or required node
affinity rules out) would leave the pod Pending forever while its booking holds the memory, so such
GPUs are passed over, each with the reason. The rules follow kube-scheduler's filters:

- `spec.nodeName`: that node only;
- `nodeSelector`: every label equal;
- required node affinity: the terms are ORed, the requirements in a term ANDed; an empty term matches
  nothing; `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt` on labels, `In`/`NotIn` on
  `metadata.name` in `matchFields`;
- taints with effect NoSchedule or NoExecute must be tolerated (PreferNoSchedule is only a preference);
- a cordoned node (`spec.unschedulable`) or one whose Ready condition is not True is passed over unless
  the pod tolerates `node.kubernetes.io/unschedulable` / `node.kubernetes.io/not-ready`, as the taints
  the node controller puts on such nodes would require.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


@dataclass(frozen=True, slots=True, kw_only=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""
    """Empty: every effect."""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass(frozen=True, slots=True, kw_only=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key, "")
        match self.operator:
            case "In":
                return present and value in self.values
            case "NotIn":
                return not present or value not in self.values
            case "Exists":
                return present
            case "DoesNotExist":
                return not present
            case "Gt" | "Lt":
                try:
                    have, bound = int(value), int(self.values[0])
                except (ValueError, IndexError):
                    return False
                return present and (have > bound if self.operator == "Gt" else have < bound)
            case _:
                return False

    def __str__(self) -> str:
        values = f" ({', '.join(self.values)})" if self.values else ""
        return f"{self.key} {self.operator}{values}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Term:
    """One nodeSelectorTerm: all of its requirements must hold."""

    expressions: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()
    """On `metadata.name` (the only field node affinity supports)."""

    def matches(self, node: NodeView) -> bool:
        if not self.expressions and not self.fields:
            return False  # an empty term matches no node
        return all(r.matches(node.labels) for r in self.expressions) and all(
            r.matches({"metadata.name": node.name}) for r in self.fields
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeView:
    """What the scheduler's filters read of a Node."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False
    ready: bool = True
    runtime_handlers: tuple[str, ...] | None = None
    """The container runtime's handlers its kubelet reports (status.runtimeHandlers; "" is the
    default); None where it reports none (kubelets before 1.30). Read by the delivery preflight."""
    extended: Mapping[str, str] = field(default_factory=dict)
    """Its allocatable extended resources (names with a domain), as quantities: the controller keeps
    vramshare's GPU-memory resource there."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRules:
    """A pod's node constraints."""

    node_name: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    terms: tuple[Term, ...] | None = None
    """The required node affinity's terms; None when the pod has none."""
    tolerations: tuple[Toleration, ...] = ()

    def tolerates(self, taint: Taint) -> bool:
        return any(t.tolerates(taint) for t in self.tolerations)


def why_not(node: NodeView, rules: NodeRules) -> str | None:
    """Why the scheduler could never bind a pod with `rules` to `node`; None when it could."""
    if rules.node_name and rules.node_name != node.name:
        return f"the pod is bound to node {rules.node_name} (spec.nodeName)"
    for key, value in sorted(rules.node_selector.items()):
        if node.labels.get(key) != value:
            have = node.labels.get(key)
            return f"nodeSelector {key}={value} does not match ({'no such label' if have is None else have})"
    if rules.terms is not None and not any(term.matches(node) for term in rules.terms):
        failed = next(
            (str(r) for term in rules.terms for r in term.expressions if not r.matches(node.labels)), ""
        )
        return "required node affinity does not match" + (f" ({failed})" if failed else "")
    if node.unschedulable and not rules.tolerates(Taint(key=UNSCHEDULABLE_TAINT)):
        return "cordoned (spec.unschedulable)"
    if not node.ready and not rules.tolerates(Taint(key=NOT_READY_TAINT)):
        return "NotReady"
    for taint in node.taints:
        if taint.effect in ("NoSchedule", "NoExecute") and not rules.tolerates(taint):
            if taint.key in (UNSCHEDULABLE_TAINT, NOT_READY_TAINT) and (node.unschedulable or not node.ready):
                continue  # said above
            return f"taint {taint} not tolerated"
    return None


def schedulable_nodes(
    nodes: Iterable[NodeView], rules: NodeRules, *, gpu_nodes: Iterable[str]
) -> tuple[frozenset[str], dict[str, str]]:
    """(the GPU nodes the pod could be bound to, why each other GPU node could not). A GPU node
    without a Node object cannot take any pod."""
    known = {n.name: n for n in nodes}
    allowed: set[str] = set()
    reasons: dict[str, str] = {}
    for name in set(gpu_nodes):
        node = known.get(name)
        why = "no such Node object" if node is None else why_not(node, rules)
        if why is None:
            allowed.add(name)
        else:
            reasons[name] = why
    return frozenset(allowed), reasons
