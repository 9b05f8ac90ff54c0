"""`helm install` into a real API server, then vramshare run as the chart's ServiceAccounts: enough
rights for its end-to-end flow (sufficiency), and refused what it does not need (minimality)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vramshare_e2e.bookings import shown_phase_of
from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, LocalCluster
from vramshare_e2e.components import start_controller, start_webhook
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[2] / "charts" / "vramshare"
NS = "vramshare"
WEBHOOK_SA = "t-vramshare-webhook"
CONTROLLER_SA = "t-vramshare-controller"


def helm(stack: LocalCluster, *args: str) -> str:
    result = subprocess.run(
        [str(stack.bin_dir / "helm"), "--kubeconfig", str(stack.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        helm(
            local,
            "install",
            "t",
            str(CHART),
            "-n",
            NS,
            "--create-namespace",
            "--wait=false",
            "--set",
            "networkPolicy.enabled=true",
            "--set",
            "grafanaDashboard.enabled=true",
        )
        yield local


def test_install_created_every_object(stack: LocalCluster) -> None:
    status = json.loads(helm(stack, "status", "t", "-n", NS, "-o", "json"))
    assert status["info"]["status"] == "deployed"
    for kind, name in [
        ("deployment", "t-vramshare-webhook"),
        ("deployment", "t-vramshare-controller"),
        ("service", "t-vramshare-webhook"),
        ("poddisruptionbudget", "t-vramshare-webhook"),
        ("networkpolicy", "t-vramshare-webhook"),
        ("configmap", "t-vramshare-dashboard"),
    ]:
        stack.kubectl("get", kind, name, "-n", NS)
    stack.kubectl("get", "mutatingwebhookconfiguration", "t-vramshare")
    stack.kubectl("get", "validatingadmissionpolicy", "t-vramshare-pinning")
    established = stack.kubectl(
        "get",
        "crd",
        "gpureservations.vramshare.io",
        "-o",
        "jsonpath={.status.conditions[?(@.type=='Established')].status}",
    )
    assert established == "True"


def can(stack: LocalCluster, sa: str, *args: str) -> bool:
    out = stack.kubectl("auth", "can-i", *args, f"--as=system:serviceaccount:{NS}:{sa}", check=False).strip()
    return out == "yes"


@pytest.mark.parametrize(
    ("sa", "action"),
    [
        (WEBHOOK_SA, ["get", "secrets", "-n", "default"]),
        (WEBHOOK_SA, ["list", "secrets", "-n", NS]),
        (WEBHOOK_SA, ["get", "secrets/other", "-n", NS]),
        (WEBHOOK_SA, ["delete", "pods", "-n", "default"]),
        (WEBHOOK_SA, ["patch", "mutatingwebhookconfigurations/someone-elses"]),
        (WEBHOOK_SA, ["update", "gpureservations/status", "-n", "default"]),
        (WEBHOOK_SA, ["delete", "gpudevices"]),
        (WEBHOOK_SA, ["update", "leases/t-vramshare-controller", "-n", NS]),  # it only reads the heartbeat
        (WEBHOOK_SA, ["watch", "leases/kube-scheduler", "-n", NS]),
        (CONTROLLER_SA, ["get", "secrets", "-n", NS]),
        (CONTROLLER_SA, ["delete", "pods", "-n", "default"]),
        (CONTROLLER_SA, ["create", "pods", "-n", "default"]),
        (CONTROLLER_SA, ["update", "leases/kube-scheduler", "-n", NS]),
        (CONTROLLER_SA, ["patch", "nodes"]),  # only their status (the memory resource's capacity)
        (CONTROLLER_SA, ["patch", "mutatingwebhookconfigurations/t-vramshare"]),
    ],
)
def test_identities_are_refused_what_they_do_not_need(
    stack: LocalCluster, sa: str, action: list[str]
) -> None:
    assert not can(stack, sa, *action)


def test_identities_have_what_they_need(stack: LocalCluster) -> None:
    assert can(stack, WEBHOOK_SA, "create", "gpureservations", "-n", "jobs")
    assert can(stack, WEBHOOK_SA, "get", "secrets/t-vramshare-webhook-tls", "-n", NS)
    assert can(stack, CONTROLLER_SA, "watch", "pods", "--all-namespaces")
    assert can(stack, CONTROLLER_SA, "patch", "pods", "-n", "jobs")  # queue mode places gated pods
    assert can(stack, WEBHOOK_SA, "watch", "namespaces")  # queue mode chosen by namespace label
    assert can(stack, CONTROLLER_SA, "update", "leases/t-vramshare-controller", "-n", NS)
    # The inventory heartbeat on the controller's Lease dates unchanged GPUs for the webhook.
    assert can(stack, WEBHOOK_SA, "watch", "leases/t-vramshare-controller", "-n", NS)
    assert can(stack, CONTROLLER_SA, "create", "gpureservations", "-n", "jobs")  # the queue head's hold
    assert can(stack, CONTROLLER_SA, "patch", "nodes", "--subresource=status")  # GPU memory as node capacity
    assert can(stack, CONTROLLER_SA, "watch", "namespaces")  # queue weights
    assert can(stack, WEBHOOK_SA, "watch", "pods", "--all-namespaces")  # pending ends when the pod exists
    assert can(stack, WEBHOOK_SA, "watch", "resourcequotas", "--all-namespaces")  # GPU-memory quotas


def test_vramshare_runs_as_the_chart_identities(stack: LocalCluster) -> None:
    """The full flow with the webhook and controller authenticated as the chart's ServiceAccounts."""
    port = free_port()
    # The chart's webhook configuration points at its Service; here the replica runs on loopback.
    stack.kubectl(
        "patch",
        "mutatingwebhookconfiguration",
        "t-vramshare",
        "--type=json",
        "-p",
        json.dumps(
            [
                {
                    "op": "replace",
                    "path": f"/webhooks/{i}/clientConfig",
                    "value": {"url": f"https://127.0.0.1:{port}/mutate"},
                }
                for i in range(2)
            ]
        ),
    )
    start_webhook(
        stack,
        name="webhook",
        port=port,
        kubeconfig=stack.service_account_kubeconfig(NS, WEBHOOK_SA),
        env={
            "VRAMSHARE_NAMESPACE": NS,
            "VRAMSHARE_TLS_MODE": "self-managed",
            "VRAMSHARE_TLS_NAMES": "127.0.0.1",
            "VRAMSHARE_TLS_SECRET": "t-vramshare-webhook-tls",
            "VRAMSHARE_WEBHOOK_CONFIGURATION": "t-vramshare",
            "VRAMSHARE_CONTROLLER_LEASE": f"{NS}/t-vramshare-controller",
            "VRAMSHARE_SETTLE_S": "2",
            "VRAMSHARE_REPLICA_LEASE_S": "0",  # the chart's default: its Role grants no Lease writes
            # The chart's default: the replicas up from its Service's EndpointSlices (read rights
            # only; the log is checked below for anything forbidden).
            "VRAMSHARE_REPLICA_SERVICE": "t-vramshare-webhook",
        },
    )
    start_controller(
        stack,
        name="controller",
        kubeconfig=stack.service_account_kubeconfig(NS, CONTROLLER_SA),
        env={
            "VRAMSHARE_NAMESPACE": NS,
            "VRAMSHARE_LEASE_NAME": "t-vramshare-controller",
            "VRAMSHARE_POLL_INTERVAL_S": "1",
            "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
            "VRAMSHARE_SETTLE_S": "2",
        },
    )
    eventually(
        lambda: len(json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]) == 5,
        what="GpuDevices written by the controller",
    )
    # Labelled at creation: a label added afterwards reaches the API server's namespace cache (which the
    # webhook's namespaceSelector is matched against) a moment later, and the pod below could miss it.
    stack.apply_objects(
        [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": "jobs", "labels": {"vramshare.io/managed": "true"}},
            }
        ]
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "task",
            "namespace": "jobs",
            "annotations": {"gpu-mem-mb": "3000", RUN_DURATION_ANNOTATION: "3s"},
        },
        "spec": {"restartPolicy": "Never", "containers": [{"name": "base", "image": "example.invalid/x"}]},
    }
    created = json.loads(stack.kubectl("create", "-f", "-", "-o", "json", stdin=json.dumps(pod)))
    name = created["metadata"]["annotations"]["vramshare.io/reservation"]

    def phase() -> Any:
        res = json.loads(stack.kubectl("get", "gpureservation", name, "-n", "jobs", "-o", "json"))
        return res.get("status", {}).get("phase")

    eventually(
        lambda: shown_phase_of(stack.kubectl, "jobs", name) in ("Bound", "Released"),
        what="Bound (its pod runs)",
    )
    eventually(lambda: phase() == "Released", what="Released")
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "cpu", "namespace": "jobs"},
        "spec": {"containers": [{"name": "base", "image": "example.invalid/x"}]},
    }
    hidden = json.loads(stack.kubectl("create", "-f", "-", "-o", "json", stdin=json.dumps(plain)))
    assert hidden["spec"]["containers"][0]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    # Hidden by the API server itself, which serves MutatingAdmissionPolicy (1.36+): inProcess auto.
    assert stack.kubectl(
        "get", "mutatingadmissionpolicybinding", "t-vramshare-hide-gpus", "-o", "name"
    ).strip()
    # Queue mode: the controller places a gated pod, past the chart's tamper protection.
    for _, gpu in stack.settings.fleet.all_gpus():
        stack.exporter.set_used(gpu.uuid, gpu.total_mib - gpu.driver_reserved_mib - 100)
    waiter = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "waiter",
            "namespace": "jobs",
            "annotations": {"gpu-mem-mb": "3000", "gpu-queue": "true"},
        },
        "spec": {"restartPolicy": "Never", "containers": [{"name": "base", "image": "example.invalid/x"}]},
    }

    def queued() -> bool:
        stack.kubectl("delete", "pod", "waiter", "-n", "jobs", "--ignore-not-found", "--wait=false")
        made = json.loads(stack.kubectl("create", "-f", "-", "-o", "json", stdin=json.dumps(waiter)))
        return bool(made["spec"].get("schedulingGates"))

    eventually(queued, what="a pod queued while every GPU looks full", timeout_s=30, interval_s=1)
    for _, gpu in stack.settings.fleet.all_gpus():
        stack.exporter.set_used(gpu.uuid, 0)

    def placed() -> Any:
        pod = json.loads(stack.kubectl("get", "pod", "waiter", "-n", "jobs", "-o", "json"))
        return not pod["spec"].get("schedulingGates") and pod

    released = eventually(placed, what="the queued pod placed by the controller", timeout_s=30)
    assert released["metadata"]["annotations"]["vramshare.io/gpu-uuid"].startswith("GPU-")
    for component in ("webhook", "controller"):
        log = stack.component(component).log_path.read_text()
        assert "forbidden" not in log.lower(), log[-3000:]
    lease = json.loads(stack.kubectl("get", "lease", "t-vramshare-controller", "-n", NS, "-o", "json"))
    assert "vramshare.io/inventory-heartbeat" in lease["metadata"]["annotations"]


def test_pinning_annotations_cannot_be_changed_after_admission(stack: LocalCluster) -> None:
    """The chart's ValidatingAdmissionPolicy: nobody re-points an admitted pod (runs after the flow above);
    even the controller only adds the placement of a pod still behind its scheduling gate."""
    as_controller = f"--as=system:serviceaccount:{NS}:{CONTROLLER_SA}"
    for pod, added in (
        ("waiter", {"vramshare.io/gpu-uuid": "GPU-other"}),  # placed: no longer behind the gate
        ("task", {"vramshare.io/extra": "x"}),  # admitted, never queued
    ):
        refused = stack.kubectl(
            "patch",
            "pod",
            pod,
            "-n",
            "jobs",
            "--type=merge",
            as_controller,
            "-p",
            json.dumps({"metadata": {"annotations": added}}),
            check=False,
        )
        assert "cannot be added, changed or removed afterwards" in refused, refused
    for patch in (
        {"metadata": {"annotations": {"cdi.k8s.io/later": "nvidia.com/gpu=all"}}},
        {"metadata": {"annotations": {"vramshare.io/gpu-uuid": "GPU-other"}}},
        {"metadata": {"annotations": {"vramshare.io/reservation": None}}},
        {"metadata": {"labels": {"vramshare.io/reservation": "stolen"}}},
    ):
        refused = stack.kubectl(
            "patch", "pod", "task", "-n", "jobs", "--type=merge", "-p", json.dumps(patch), check=False
        )
        assert (
            "cannot be added, changed or removed afterwards" in refused
            or "cannot be added to or changed on a pod after its admission" in refused
        ), refused
    allowed = stack.kubectl(
        "patch",
        "pod",
        "task",
        "-n",
        "jobs",
        "--type=merge",
        "-p",
        json.dumps({"metadata": {"annotations": {"team": "a"}}}),
        check=False,
    )
    assert "patched" in allowed


def test_no_way_around_pinning_and_hiding(stack: LocalCluster) -> None:
    """With the chart's webhook rules and policy (runs after the flow above): kubectl debug containers
    get the pod's GPU or none; a zero device-plugin request is hidden like any pod; a pod vramshare did
    not admit cannot carry its labels."""

    def create(pod: dict[str, Any], namespace: str = "jobs") -> Any:
        body = {"apiVersion": "v1", "kind": "Pod", **pod}
        body["metadata"]["namespace"] = namespace
        body["spec"] = {
            "containers": [{"name": "base", "image": "example.invalid/x"}],
            **body.get("spec", {}),
        }
        return json.loads(stack.kubectl("create", "-f", "-", "-o", "json", stdin=json.dumps(body)))

    gpu_pod = create({"metadata": {"name": "debugged", "annotations": {"gpu-mem-mb": "1000"}}})
    uuid = gpu_pod["metadata"]["annotations"]["vramshare.io/gpu-uuid"]
    create({"metadata": {"name": "plain-debugged"}})
    for name, visible in (("debugged", uuid), ("plain-debugged", "void")):
        stack.kubectl(
            "debug", f"pod/{name}", "-n", "jobs", "--image=example.invalid/busybox", "--container=dbg"
        )
        pod = json.loads(stack.kubectl("get", "pod", name, "-n", "jobs", "-o", "json"))
        (debug,) = pod["spec"]["ephemeralContainers"]
        env = {e["name"]: e["value"] for e in debug["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == visible
    zero = create(
        {
            "metadata": {"name": "zero-gpus"},
            "spec": {
                "containers": [
                    {
                        "name": "base",
                        "image": "example.invalid/cuda",
                        "resources": {"limits": {"nvidia.com/gpu": "0"}},
                    }
                ]
            },
        }
    )
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in zero["spec"]["containers"][0]["env"]
    forged = {
        "metadata": {"name": "forged", "labels": {"vramshare.io/reservation": "debugged-x", "team": "a"}}
    }
    stripped = create(json.loads(json.dumps(forged)))  # managed: the keys are removed
    assert stripped["metadata"]["labels"] == {"team": "a"}
    refused = stack.kubectl(
        "create",
        "-f",
        "-",
        stdin=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                **forged,
                "spec": {"containers": [{"name": "b", "image": "x"}]},
            }
        ),
        check=False,
    )
    assert "only vramshare sets vramshare.io/* annotations and labels" in refused, refused
    # GPU memory as a resource, requested by a pod vramshare did not admit: refused in any namespace
    # (the webhook answers 400 in the ones it manages; the policy everywhere else).
    squatter = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "squatter"},
        "spec": {
            "containers": [
                {"name": "b", "image": "x", "resources": {"limits": {"vramshare.io/gpu-mem-mib": "80000"}}}
            ]
        },
    }
    for namespace, said in (
        ("default", "only vramshare requests the resource vramshare.io/gpu-mem-mib"),  # the policy
        ("jobs", "request resource vramshare.io/gpu-mem-mib: only vramshare sets it"),  # the webhook
    ):
        body = json.loads(json.dumps(squatter))
        body["metadata"]["namespace"] = namespace
        refused = stack.kubectl("create", "-f", "-", stdin=json.dumps(body), check=False)
        assert said in refused, (namespace, refused)


def test_subresources_and_gates_are_no_way_around_the_ledger(stack: LocalCluster, tmp_path: Path) -> None:
    """Issue #42, holes 1, 3 and 5, done as a tenant does them (runs after the flow above): placement
    marks forged through pods/status and through the ephemeral-containers update, and vramshare's own
    scheduling gate lifted by the pod's owner."""

    def pod(name: str) -> dict[str, Any]:
        return json.loads(stack.kubectl("get", "pod", name, "-n", "jobs", "-o", "json"))

    # pods/status keeps the labels and annotations a client sends: the pinning policy matches it too.
    for name, patch, said in (
        (
            "task",
            {"metadata": {"annotations": {"vramshare.io/gpu-uuid": "all"}}},
            "cannot be added, changed or removed afterwards",
        ),
        (
            "plain-debugged",
            {"metadata": {"annotations": {"nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=all"}}},
            "cannot be added to or changed on a pod after its admission",
        ),
    ):
        out = stack.kubectl(
            "patch", "pod", name, "-n", "jobs", "--subresource=status", "--type=merge",
            "-p", json.dumps(patch), check=False,
        )  # fmt: skip
        assert said in out, (name, out)
    assert pod("task")["metadata"]["annotations"]["vramshare.io/gpu-uuid"] != "all"

    # The ephemeral-containers update, with the placement marks forged in the object sent: the debug
    # container gets the stored pod's own GPUs (or none), never what the client wrote.
    # Fresh pods: a forged update to a pod that has debug containers already would also change theirs,
    # which the API server refuses by itself.
    for name, marks in (("fresh-plain", {}), ("fresh-gpu", {"gpu-mem-mb": "1000"})):
        fresh = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "jobs", "annotations": marks},
            "spec": {"containers": [{"name": "base", "image": "example.invalid/x"}]},
        }
        stack.kubectl("create", "-f", "-", stdin=json.dumps(fresh))
    placed_uuid = pod("fresh-gpu")["metadata"]["annotations"]["vramshare.io/gpu-uuid"]
    for name, expected in (("fresh-plain", "void"), ("fresh-gpu", placed_uuid)):

        def forge(name: str = name) -> str | bool:
            """The update as the attacker sends it; read again and resent while kwok's status writes
            move the pod (409 Conflict)."""
            body = pod(name)
            body["metadata"].setdefault("annotations", {})["vramshare.io/gpu-uuid"] = "all"
            body["metadata"].setdefault("labels", {})["vramshare.io/reservation"] = pod("debugged")[
                "metadata"
            ]["labels"]["vramshare.io/reservation"]
            body["spec"]["ephemeralContainers"] = [
                *body["spec"].get("ephemeralContainers", []),
                {"name": "grab", "image": "example.invalid/busybox"},
            ]
            sent = tmp_path / f"{name}.json"
            sent.write_text(json.dumps(body))
            path = f"/api/v1/namespaces/jobs/pods/{name}/ephemeralcontainers"
            out = stack.kubectl("replace", "--raw", path, "-f", str(sent), check=False)
            assert "Conflict" in out or '"kind":"Pod"' in out, out
            return "Conflict" not in out and out

        eventually(forge, what=f"the forged ephemeral-containers update of {name} sent", timeout_s=30)
        after = pod(name)
        (grab,) = [c for c in after["spec"]["ephemeralContainers"] if c["name"] == "grab"]
        env = {e["name"]: e.get("value") for e in grab.get("env", [])}
        assert env.get("NVIDIA_VISIBLE_DEVICES") == expected, (name, grab)
        assert after["metadata"].get("annotations", {}).get("vramshare.io/gpu-uuid") != "all"

    # vramshare's scheduling gate is lifted by its controller only.
    gated = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated-by-vramshare", "namespace": "jobs"},
        "spec": {
            "schedulingGates": [{"name": "vramshare.io/gpu-memory"}],
            "containers": [{"name": "base", "image": "example.invalid/x"}],
        },
    }
    stack.kubectl("create", "-f", "-", stdin=json.dumps(gated))
    lift = ["patch", "pod", "gated-by-vramshare", "-n", "jobs", "--type=json", "-p",
            json.dumps([{"op": "remove", "path": "/spec/schedulingGates"}])]  # fmt: skip
    refused = stack.kubectl(*lift, check=False)
    assert "scheduling gate vramshare.io/gpu-memory is lifted only by vramshare's controller" in refused, (
        refused
    )
    assert pod("gated-by-vramshare")["spec"]["schedulingGates"] == [{"name": "vramshare.io/gpu-memory"}]
    lifted = stack.kubectl(*lift, f"--as=system:serviceaccount:{NS}:{CONTROLLER_SA}", check=False)
    assert "patched" in lifted, lifted

    # With the webhook down, a debug container that brings no NVIDIA_VISIBLE_DEVICES is refused.
    stack.stop_component("webhook")
    try:
        out = stack.kubectl(
            "debug", "pod/plain-debugged", "-n", "jobs", "--image=example.invalid/busybox",
            "--container=while-down", check=False,
        )  # fmt: skip
    finally:
        stack.start_component("webhook")
    assert "a debug container sees the pod's own GPUs" in out, out
    assert all(c["name"] != "while-down" for c in pod("plain-debugged")["spec"]["ephemeralContainers"])


def test_with_the_webhook_down_hiding_fails_closed_for_every_gpu_field(stack: LocalCluster) -> None:
    """The hide-gpus webhook fails open (failurePolicy Ignore, so pods are created while it is down);
    the chart's policy refuses the GPU requests it would have removed (runs after the flow above)."""

    def create(name: str, *, annotations: dict[str, str] | None = None, **container: Any) -> str:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "jobs", "annotations": annotations or {}},
            "spec": {
                "volumes": [{"name": "null", "hostPath": {"path": "/dev/null"}}],
                "containers": [{"name": "base", "image": "example.invalid/x", **container}],
            },
        }
        return stack.kubectl("create", "-f", "-", stdin=json.dumps(body), check=False)

    stack.stop_component("webhook")
    try:
        refused = {
            "nri": create("grab-nri", annotations={"nvidia.cdi.k8s.io/container.base": "nvidia.com/gpu=all"}),
            "cdi": create("grab-cdi", annotations={"cdi.k8s.io/x": "nvidia.com/gpu=0"}),
            "mount": create(
                "grab-mount",
                volumeMounts=[{"name": "null", "mountPath": "/var/run//nvidia-container-devices/all"}],
            ),
            "forged": create(
                "grab-forged",
                annotations={
                    "nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=GPU-x",
                    "vramshare.io/gpu-uuid": "GPU-x",
                },
            ),
        }
        for what, out in refused.items():
            # The forged placement is refused by the pinning policy too (a vramshare.io/* key): either.
            assert "ValidatingAdmissionPolicy 't-vramshare-hiding'" in out or (
                what == "forged" and "ValidatingAdmissionPolicy 't-vramshare-pinning'" in out
            ), (what, out)
        assert "CDI requests for NVIDIA devices" in refused["nri"]
        assert "device-list mounts" in refused["mount"]
        # The API server (1.37 here) hides plain pods itself (the chart's MutatingAdmissionPolicy): a
        # pod's own variable, and one with none (which a CUDA image would default to all), get void
        # with the webhook down too.
        for name, env in (
            ("grab-env", [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
            ("plain-while-down", []),
        ):
            assert "created" in create(name, env=env)
            made = json.loads(stack.kubectl("get", "pod", name, "-n", "jobs", "-o", "json"))
            assert made["spec"]["containers"][0]["env"] == [
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
            ]
        # A pod of the device plugin is not vramshare's.
        assert "created" in create(
            "device-plugin",
            resources={"limits": {"nvidia.com/gpu": "1"}},
            env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
        )
    finally:
        stack.start_component("webhook")
    # Webhook up: the same requests are removed rather than refused.
    out = create("grab-env-up", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    assert "created" in out, out


def test_hiding_fails_closed_for_zero_requests_other_resources_and_a_missing_variable(
    stack: LocalCluster, tmp_path: Path
) -> None:
    """Issue #42, 4 (runs after the tests above): while the webhook is down, a pod that asks for
    nvidia.com/gpu "0" or for another extended resource is hidden like any pod; and where the API
    server has no in-process hiding (before Kubernetes 1.36: here its binding is removed for the test), a
    pod whose container sets no NVIDIA_VISIBLE_DEVICES (a CUDA image's own ENV says all) is refused."""

    def create(name: str, **container: Any) -> str:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "jobs"},
            "spec": {"containers": [{"name": "base", "image": "example.invalid/cuda", **container}]},
        }
        return stack.kubectl("create", "-f", "-", stdin=json.dumps(body), check=False)

    def env_of(name: str) -> list[dict[str, Any]]:
        made = json.loads(stack.kubectl("get", "pod", name, "-n", "jobs", "-o", "json"))
        return made["spec"]["containers"][0].get("env", [])  # type: ignore[no-any-return]

    binding = json.loads(
        stack.kubectl("get", "mutatingadmissionpolicybinding", "t-vramshare-hide-gpus", "-o", "json")
    )
    stack.stop_component("webhook")
    try:
        image_says_all = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
        for name, resources in (
            ("zero-gpus-down", {"limits": {"nvidia.com/gpu": "0"}}),
            ("other-resource-down", {"limits": {"example.com/fpga": "0"}}),
        ):
            out = create(name, resources=resources, env=image_says_all)
            assert "created" in out, (name, out)
            assert env_of(name) == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}], name
        stack.kubectl("delete", "mutatingadmissionpolicybinding", "t-vramshare-hide-gpus")
        tries = iter(range(1000))
        refused = eventually(
            lambda: (out := create(f"bare-{next(tries)}")) and "sets NVIDIA_VISIBLE_DEVICES" in out and out,
            what="a pod without the variable refused once the in-process hiding is gone",
            timeout_s=20,
        )
        assert "ValidatingAdmissionPolicy 't-vramshare-hiding'" in refused, refused
        assert "created" in create("says-void", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}])
        # The device plugin's pods are not vramshare's.
        assert "created" in create(
            "plugin-pod", resources={"limits": {"nvidia.com/gpu": "1"}}, env=image_says_all
        )
    finally:
        stack.start_component("webhook")
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            binding["metadata"].pop(key, None)
        kept = tmp_path / "binding.json"
        kept.write_text(json.dumps(binding))
        stack.kubectl("create", "-f", str(kept))


def test_privileged_containers_and_device_host_paths_are_refused_before_anything_is_booked(
    stack: LocalCluster,
) -> None:
    """Issue #42, 9 (runs after the tests above): a privileged container, or a hostPath of the node's
    devices, sees every GPU of the node whatever NVIDIA_VISIBLE_DEVICES says. In a managed namespace the
    chart's hiding policy refuses such pods (debug containers too), and the webhook refuses such a GPU
    pod before it books anything, naming the field."""

    def create(name: str, *, annotations: dict[str, str] | None = None, **spec: Any) -> str:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "jobs", "annotations": annotations or {}},
            "spec": {"containers": [{"name": "base", "image": "example.invalid/x"}], **spec},
        }
        return stack.kubectl("create", "-f", "-", stdin=json.dumps(body), check=False)

    privileged = [{"name": "base", "image": "example.invalid/x", "securityContext": {"privileged": True}}]
    out = create("privileged-plain", containers=privileged)
    assert "a privileged container sees every GPU of the node" in out, out
    assert "ValidatingAdmissionPolicy 't-vramshare-hiding'" in out, out
    for path in ("/dev", "//dev/nvidia0", "/run/nvidia/driver", "/"):
        out = create("host-devices", volumes=[{"name": "d", "hostPath": {"path": path}}])
        assert "a hostPath volume of the node's devices" in out, (path, out)
    assert "created" in create("host-null", volumes=[{"name": "d", "hostPath": {"path": "/dev/null"}}])
    assert "created" in create("host-data", volumes=[{"name": "d", "hostPath": {"path": "/data"}}])

    out = create("privileged-gpu", annotations={"gpu-mem-mb": "1000"}, containers=privileged)
    assert 'admission webhook "gpu-mem.vramshare.io" denied the request' in out, out
    assert "containers[0] (base) securityContext.privileged: true" in out, out
    booked = json.loads(stack.kubectl("get", "gpureservations", "-n", "jobs", "-o", "json"))["items"]
    assert [r for r in booked if r["spec"]["podName"] == "privileged-gpu"] == []

    out = stack.kubectl(
        "debug", "pod/host-data", "-n", "jobs", "--image=example.invalid/busybox", "--profile=sysadmin",
        check=False,
    )  # fmt: skip
    assert "a privileged container sees every GPU of the node" in out, out


CERT_MANAGER = "github.com/cert-manager/cert-manager@v1.21.2"


def cert_manager_crds() -> list[Path]:
    """cert-manager's own CRDs, from its Go module (fetched once into the module cache). Its
    controllers live in cmd/ modules that are not published to the module proxy, so only the API
    (the CRDs and their schemas) can be had here."""
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    out = subprocess.run(
        ["go", "mod", "download", "-json", CERT_MANAGER],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    crds = Path(json.loads(out)["Dir"]) / "deploy" / "crds"
    return sorted(crds.glob("cert-manager.io_*.yaml"))


def test_the_cert_manager_mode_installs_against_cert_managers_own_crds(stack: LocalCluster) -> None:
    """The cert-manager mode's CA chain, installed by helm into a real API server that validates it
    against cert-manager's real CRD schemas (a second release, removed at the end)."""
    for crd in cert_manager_crds():
        stack.kubectl("apply", "--server-side", "-f", str(crd))
    names = ["certificates.cert-manager.io", "issuers.cert-manager.io"]
    stack.kubectl("wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in names])
    try:
        helm(
            stack,
            "install",
            "cm",
            str(CHART),
            "-n",
            "cm",
            "--create-namespace",
            "--wait=false",
            "--set",
            "webhook.tls.mode=cert-manager",
            # Nothing serves this release's webhook: it must not stand in the way of the module's pods.
            "--set",
            "webhook.failurePolicy=Ignore",
            "--set",
            "webhook.namespaceSelector.matchLabels.cert-manager-test=only",
            "--set",
            "webhook.hideGpus.enabled=false",
            "--set",
            "tamperProtection.enabled=false",
        )
        objects = json.loads(stack.kubectl("get", "certificates,issuers", "-n", "cm", "-o", "json"))["items"]
        by_name = {(o["kind"], o["metadata"]["name"]): o["spec"] for o in objects}
        assert set(by_name) == {
            ("Issuer", "cm-vramshare-webhook-selfsigned"),
            ("Certificate", "cm-vramshare-webhook-ca"),
            ("Issuer", "cm-vramshare-webhook"),
            ("Certificate", "cm-vramshare-webhook"),
        }
        ca = by_name[("Certificate", "cm-vramshare-webhook-ca")]
        assert ca["isCA"] is True
        assert ca["issuerRef"] == {"kind": "Issuer", "name": "cm-vramshare-webhook-selfsigned"}
        assert by_name[("Issuer", "cm-vramshare-webhook")]["ca"] == {"secretName": "cm-vramshare-webhook-ca"}
        serving = by_name[("Certificate", "cm-vramshare-webhook")]
        assert serving["issuerRef"] == {"kind": "Issuer", "name": "cm-vramshare-webhook"}
        assert "cm-vramshare-webhook.cm.svc" in serving["dnsNames"]
        configuration = json.loads(
            stack.kubectl("get", "mutatingwebhookconfiguration", "cm-vramshare", "-o", "json")
        )
        assert (
            configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
            == "cm/cm-vramshare-webhook"
        )
    finally:
        helm(stack, "uninstall", "cm", "-n", "cm")


def test_moving_to_templated_crds_upgrades_them_and_uninstall_keeps_them(stack: LocalCluster) -> None:
    """The last test here: it uninstalls. Helm applies crds/ only at install; moving an installed release
    to `crds.templated` means letting Helm adopt the CRDs (the README's steps), then upgrades carry them."""
    for crd in ("gpudevices.vramshare.io", "gpureservations.vramshare.io"):
        stack.kubectl("label", "crd", crd, "app.kubernetes.io/managed-by=Helm", "--overwrite")
        stack.kubectl(
            "annotate",
            "crd",
            crd,
            "meta.helm.sh/release-name=t",
            f"meta.helm.sh/release-namespace={NS}",
            "--overwrite",
        )
    # The flow above pointed the webhook configuration at a loopback replica by hand: let Helm make it anew.
    stack.kubectl("delete", "mutatingwebhookconfiguration", "t-vramshare")
    helm(
        stack,
        "upgrade",
        "t",
        str(CHART),
        "-n",
        NS,
        "--reuse-values",
        "--set",
        "crds.templated=true",
        "--wait=false",
    )
    kept = json.loads(stack.kubectl("get", "crd", "gpureservations.vramshare.io", "-o", "json"))
    assert kept["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    def bookings() -> list[str]:
        # Pods' bookings; grants (vramshare.io/granted-to) are given back as their webhook stops.
        return stack.kubectl(
            "get", "gpureservations", "-A", "-l", "!vramshare.io/granted-to", "-o", "name"
        ).split()

    bookings_before = bookings()
    helm(stack, "uninstall", "t", "-n", NS)
    stack.kubectl("get", "crd", "gpureservations.vramshare.io")  # still there
    assert bookings() == bookings_before
