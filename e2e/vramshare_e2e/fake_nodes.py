"""The fleet's fake nodes, as kwok runs them (a real node's kubelet registers itself), and what the
local Prometheus answers about the fleet's series."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from vramshare_e2e.fleet import Fleet


def fake_node_objects(fleet: Fleet) -> list[dict[str, Any]]:
    """The Node objects of the fleet's fake nodes, for kwok to keep Ready."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": node.node_labels(),
            },
            "spec": {},
            "status": {
                "capacity": {"cpu": "32", "memory": "256Gi", "pods": "250"},
                "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "250"},
            },
        }
        for node in fleet.nodes
        if not node.real  # its kubelet registers it (vramshare_e2e.node)
    ]


def fake_nodes_ready(nodes_json: str, fleet: Fleet) -> bool:
    """Whether every fake node of the fleet is Ready in `kubectl get nodes -o json`'s output."""
    try:
        items = json.loads(nodes_json)["items"]
    except (ValueError, KeyError):
        return False
    ready = {
        n["metadata"]["name"]
        for n in items
        if any(
            c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", [])
        )
    }
    return all(node.name in ready for node in fleet.nodes if not node.real)


def instant_query(prometheus_url: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's result ([] while Prometheus does not answer)."""
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return []
    return list(body.get("data", {}).get("result", []))
