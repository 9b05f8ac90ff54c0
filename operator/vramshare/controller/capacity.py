"""GPU memory as node capacity: each GPU node advertises vramshare's memory resource (see
`vramshare_webhook.memory_resource`), the documented way to advertise an extended resource (a PATCH of the
Node's status). The scheduler's node fit, ResourceQuota and Kueue then all count GPU memory.

The kubelet keeps an extended resource it does not manage and copies capacity to allocatable; a kubelet
that starts on a fresh node may zero it, and the next poll writes it again. Nodes without kubelets
(kwok) get allocatable written too.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from vramshare.controller.state import ClusterState
from vramshare.domain import Gpu
from vramshare.domain.tenancy import advertised_mib
from vramshare.kube.client import ApiError, KubeClient

log = structlog.get_logger("vramshare.controller")


class NodeCapacity:
    def __init__(self, *, kube: KubeClient, state: ClusterState, resource: str) -> None:
        self.kube = kube
        self.state = state
        self.resource = resource
        """Empty: nothing is advertised (the webhook requests nothing either)."""
        self._refused: set[str] = set()
        """Nodes whose write was refused (logged once each)."""
        self._written: dict[str, tuple[str | None, str | None]] = {}
        """Node -> (the value written, the value the cache showed then), until the cache shows ours:
        a poll before the watch brings the write back does not write it again."""

    async def advertise(self, gpus: Iterable[Gpu]) -> None:
        """Write each GPU node's capacity where it differs; take it off nodes that have no GPU left."""
        if not self.resource:
            return
        wanted: dict[str, int | None] = dict(advertised_mib(gpus))
        for node in self.state.nodes.items.values():
            if node.name not in wanted and self.resource in node.extended:
                wanted[node.name] = None
        for node_name, mib in sorted(wanted.items(), key=lambda t: t[0]):
            view = self.state.nodes.items.get(f"/{node_name}")
            if view is None:  # a GPU whose node is gone: nothing to write to
                continue
            have = view.extended.get(self.resource)
            value = None if mib is None else str(mib)
            if have == value:
                self._written.pop(node_name, None)
                continue
            if self._written.get(node_name) == (value, have):
                continue  # written; the watch has not brought it back yet
            patch = {"status": {"capacity": {self.resource: value}, "allocatable": {self.resource: value}}}
            try:
                await self.kube.merge_patch(f"/api/v1/nodes/{node_name}/status", patch)
            except ApiError as exc:
                if node_name not in self._refused:
                    self._refused.add(node_name)
                    log.warning(
                        "could not advertise GPU memory on the node; pods vramshare places there stay "
                        "Pending until it is (RBAC: patch nodes/status)",
                        node=node_name,
                        resource=self.resource,
                        error=str(exc),
                    )
                continue
            self._refused.discard(node_name)
            self._written[node_name] = (value, have)
            log.info("advertised GPU memory", node=node_name, resource=self.resource, mib=mib)
