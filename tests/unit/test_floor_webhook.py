"""The pinned floor writes into a pod what vramshare writes (`placement_patch`), under its own label,
so that vramshare's pod watches never take its pods in."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from vramshare.kube.resources import LABEL_RESERVATION
from vramshare_e2e.bench_measure import CPU_OF, FLOOR_WEBHOOKS, PINNED_WEBHOOKS, is_workload
from vramshare_e2e.floor_webhook import PINNED_LABEL, main, pin_patch
from vramshare_webhook.pod import Placement
from vramshare_webhook.pod_patch import placement_patch

POD = {
    "metadata": {"name": "task-1", "labels": {"app": "airflow"}, "annotations": {"gpu-mem-mb": "10"}},
    "spec": {"containers": [{"name": "base", "image": "x", "env": [{"name": "A", "value": "1"}]}]},
}


def applied(pod: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """`ops` (JSON Patch adds, as both patches are made of) applied to a copy of `pod`."""
    out = copy.deepcopy(pod)
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[last] = op["value"]
    return out


def test_the_pinned_floor_patches_as_vramshare_does_but_for_the_label() -> None:
    ours = pin_patch(POD, booking="task-1-00ff00ff", node="gpu-node-a", gpu_uuid="GPU-floor-gpu-node-a")
    theirs = placement_patch(
        POD,
        Placement(
            reservation="task-1-00ff00ff", gpu_uuid="GPU-floor-gpu-node-a", gpu_index=0, node="gpu-node-a"
        ),
    )
    assert [op["path"] for op in ours] == [op["path"] for op in theirs]
    pinned = applied(POD, ours)
    admitted = applied(POD, theirs)
    assert pinned["metadata"]["labels"] == {"app": "airflow", PINNED_LABEL: "task-1-00ff00ff"}
    assert LABEL_RESERVATION in admitted["metadata"]["labels"]
    del admitted["metadata"]["labels"]
    del pinned["metadata"]["labels"]
    assert pinned == admitted  # the environment, the affinity, the annotations: the same
    assert pinned["spec"]["containers"][0]["env"][0] == {"name": "A", "value": "1"}


def test_the_floors_replicas_are_the_components_whose_cpu_the_benchmark_counts() -> None:
    assert FLOOR_WEBHOOKS == ("e2e-one-write-0", "e2e-one-write-1")
    assert PINNED_WEBHOOKS == ("e2e-pinned-0", "e2e-pinned-1")
    assert set(FLOOR_WEBHOOKS + PINNED_WEBHOOKS) <= set(CPU_OF)
    assert all(is_workload(name) for name in FLOOR_WEBHOOKS + PINNED_WEBHOOKS)  # --split-cores


def test_a_pinned_floor_without_nodes_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["pinned", "--kubeconfig=k", "--port=1", "--cert=c", "--key=k"])
    assert "pinned needs --nodes" in capsys.readouterr().err
