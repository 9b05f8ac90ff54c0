"""GPUs hidden in the API server (issue #31): the chart's MutatingAdmissionPolicy gives plain pods that
ask for no GPU NVIDIA_VISIBLE_DEVICES=void without a webhook round trip, and leaves every other such
pod to the webhook. Each pod below is created (server-side dry run: every admission step runs, nothing
is stored) in a namespace hidden by the webhook alone and in one hidden in process; the two must come
out the same, and the webhook must have seen only the pods that are not plain."""

from __future__ import annotations

import copy
import json
import re
import ssl
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from vramshare_e2e.admission_parts import start_mutating_webhook
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import hide_gpus_policy, start_webhook, webhook_configuration
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

WEBHOOK_ONLY, IN_PROCESS = "hide-webhook", "hide-in-process"


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LocalCluster, int]]:
    with LocalCluster.start() as local:
        ports = {
            shard: start_webhook(local, name=f"webhook-{shard}", env={"VRAMSHARE_LOG_LEVEL": "warning"})[1]
            for shard in ("wh", "ip")
        }
        by_webhook = webhook_configuration(local, ports={"wh": ports["wh"]}, as_the_chart=True)
        in_process = webhook_configuration(
            local, ports={"ip": ports["ip"]}, as_the_chart=True, hide_in_process=True
        )
        in_process["metadata"]["name"] = "vramshare-e2e-in-process"
        local.apply_objects(
            [
                by_webhook,
                in_process,
                *hide_gpus_policy(namespace_selector={"matchLabels": {"vramshare-e2e/shard": "ip"}}),
            ]
        )
        # A sidecar injector after vramshare: the policy is reinvoked for the container it adds.
        start_mutating_webhook(local, mode="sidecar")
        for namespace, shard in ((WEBHOOK_ONLY, "wh"), (IN_PROCESS, "ip")):
            local.create_namespace(
                namespace, {"vramshare-e2e/shard": shard, "e2e.vramshare.io/sidecar": "on"}
            )

        # The API server takes up a new admission policy a moment after it is created: until then a plain
        # pod reaches the webhook (the first case of a CI run once did, twice with the sidecar's
        # reinvocation). The cases start once a plain pod no longer does.
        def policy_in_effect() -> bool:
            before = hidden_by_webhook(ports["ip"])
            dry_run(local, IN_PROCESS, "probe", {"spec": {"containers": [container("c")]}})
            return hidden_by_webhook(ports["ip"]) == before

        eventually(policy_in_effect, what="the in-process hiding policy in effect", timeout_s=30)
        yield local, ports["ip"]


def container(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "example.invalid/x", **extra}


CASES: dict[str, dict[str, Any]] = {
    "plain": {"spec": {"containers": [container("a"), container("b")]}},
    "plain with init containers": {
        "spec": {"initContainers": [container("setup")], "containers": [container("main")]}
    },
    "plain with env and mounts": {
        "spec": {
            "containers": [
                container(
                    "a",
                    env=[{"name": "CUDA_HOME", "value": "/usr/local/cuda"}],
                    volumeMounts=[{"name": "data", "mountPath": "/data"}],
                )
            ],
            "volumes": [{"name": "data", "emptyDir": {}}],
        }
    },
    "plain, with its own NVIDIA_VISIBLE_DEVICES": {
        "spec": {"containers": [container("a", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])]}
    },
    "NVIDIA_VISIBLE_DEVICES from a ConfigMap": {
        "spec": {
            "containers": [
                container(
                    "a",
                    env=[
                        {
                            "name": "NVIDIA_VISIBLE_DEVICES",
                            "valueFrom": {
                                "configMapKeyRef": {"name": "gpus", "key": "all", "optional": True}
                            },
                        }
                    ],
                )
            ]
        }
    },
    "a device-plugin GPU (not vramshare's: left as it is)": {
        "spec": {
            "containers": [
                container(
                    "a",
                    resources={"limits": {"nvidia.com/gpu": "1"}},
                    env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                )
            ]
        }
    },
    # Issue #42, 4: asking the device plugin for nothing, or for another device, asks for no GPU.
    "plain, with nvidia.com/gpu 0 (it asks the device plugin for nothing)": {
        "spec": {
            "containers": [
                container(
                    "a",
                    resources={"limits": {"nvidia.com/gpu": "0"}},
                    env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                )
            ]
        }
    },
    "plain, with another extended resource": {
        "spec": {"containers": [container("a", resources={"limits": {"example.com/fpga": "1"}})]}
    },
    "a vramshare.io label": {
        "metadata": {"labels": {"vramshare.io/reservation": "someone-elses"}},
        "spec": {"containers": [container("a")]},
    },
    "a CDI request": {
        "metadata": {"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}},
        "spec": {"containers": [container("a")]},
    },
    "a device-list mount": {
        "spec": {
            "containers": [
                container(
                    "a", volumeMounts=[{"name": "d", "mountPath": "/var/run/nvidia-container-devices/all"}]
                )
            ],
            "volumes": [{"name": "d", "emptyDir": {}}],
        }
    },
}


def dry_run(local: LocalCluster, namespace: str, name: str, case: dict[str, Any]) -> dict[str, Any]:
    pod = copy.deepcopy(case)
    pod.update({"apiVersion": "v1", "kind": "Pod"})
    pod.setdefault("metadata", {})["name"] = name
    out = local.kubectl(
        "create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(pod)
    )
    return dict(json.loads(out))


def outcome(pod: dict[str, Any]) -> dict[str, Any]:
    """What hiding decides: every container's env and mounts, the labels and annotations."""
    spec, meta = pod["spec"], pod["metadata"]
    return {
        "containers": {
            c["name"]: (c.get("env"), [m["mountPath"] for m in c.get("volumeMounts") or []])
            for c in [*spec.get("initContainers", []), *spec["containers"]]
        },
        "labels": {k: v for k, v in (meta.get("labels") or {}).items() if not k.startswith("e2e.")},
        "annotations": {k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith("e2e.")},
    }


def hidden_by_webhook(port: int) -> float:
    """Pods the webhook answered as hidden (its /metrics, on its TLS port)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=ctx) as resp:
        text = resp.read().decode()
    found = re.findall(r'^vramshare_webhook_decisions_total\{outcome="hidden",[^}]*\} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


@pytest.mark.parametrize("case", list(CASES))
def test_in_process_hiding_decides_as_the_webhook_does(stack: tuple[LocalCluster, int], case: str) -> None:
    local, in_process_port = stack
    name = re.sub(r"[^a-z0-9]+", "-", case.lower()).strip("-")
    seen_before = hidden_by_webhook(in_process_port)
    by_webhook = dry_run(local, WEBHOOK_ONLY, name, CASES[case])
    in_process = dry_run(local, IN_PROCESS, name, CASES[case])
    assert outcome(in_process) == outcome(by_webhook)
    envs = [env for env, _ in outcome(in_process)["containers"].values()]
    void = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
    device_plugin = case.startswith("a device-plugin")
    assert all((void in (env or [])) is not device_plugin for env in envs), envs
    plain = case.startswith("plain")
    # Plain pods never reach the webhook in the in-process namespace; the others are its business.
    assert (hidden_by_webhook(in_process_port) - seen_before == 0) is (plain or device_plugin), case
