"""The local control plane itself: CRDs, scheduling and kwok pod lifecycle, Prometheus, RBAC, teardown."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from vramshare_e2e import cluster as cluster_module
from vramshare_e2e.cluster import EXIT_CODE_ANNOTATION, RUN_DURATION_ANNOTATION, ClusterSettings, LocalCluster
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster


def pod(name: str, annotations: dict[str, str] | None = None) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations or {}),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/task:1")],
            restart_policy="Never",
        ),
    )


def test_crds_are_established_and_listable(cluster: LocalCluster) -> None:
    for crd in ("gpureservations.vramshare.io", "gpudevices.vramshare.io"):
        status = cluster.kubectl(
            "get", "crd", crd, "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}"
        )
        assert status == "True"
    # Other modules may share this control plane: select nothing, so only listability is checked.
    nothing = "vramshare.io/test-selects-nothing=1"
    out = cluster.kubectl("get", "gpureservations,gpudevices", "-A", "-l", nothing)
    assert out == ""  # no error (kubectl prints "No resources found" on stderr)
    assert cluster.kubectl("get", "gpures,gpudev", "-A", "-l", nothing) == ""


def test_reservation_printer_columns_and_validation(cluster: LocalCluster, namespace: str) -> None:
    reservation = {
        "apiVersion": "vramshare.io/v1alpha1",
        "kind": "GpuReservation",
        "metadata": {"name": "r1", "namespace": namespace},
        "spec": {
            "podName": "task-1",
            "memoryMiB": 4096,
            "nodeName": "gpu-node-a",
            "gpuUUID": "GPU-1234",
            "gpuIndex": 1,
        },
    }
    cluster.kubectl("create", "-f", "-", stdin=json.dumps(reservation))
    table = cluster.kubectl("get", "gpures", "-n", namespace).splitlines()
    assert table[0].split() == ["NAME", "POD", "MIB", "NODE", "GPU", "INDEX", "GPUS", "PHASE", "QUEUE", "AGE"]
    # gpuCount defaults to 1 (the schema's default), so the GPUS column is never empty.
    assert table[1].split()[:7] == ["r1", "task-1", "4096", "gpu-node-a", "GPU-1234", "1", "1"]

    bad = json.loads(json.dumps(reservation))
    bad["metadata"]["name"] = "r2"
    bad["spec"]["memoryMiB"] = 0
    refused = cluster.kubectl("create", "-f", "-", stdin=json.dumps(bad), check=False)
    assert "spec.memoryMiB" in refused
    assert "should be greater than or equal to 1" in refused

    patched = cluster.kubectl(
        "patch",
        "gpures",
        "r1",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"memoryMiB":1}}',
        check=False,
    )
    assert "spec is immutable" in patched


def test_pod_is_scheduled_onto_a_fake_gpu_node_runs_and_completes(
    cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    core.create_namespaced_pod(namespace, pod("done", {RUN_DURATION_ANNOTATION: "2s"}))
    core.create_namespaced_pod(
        namespace, pod("fails", {RUN_DURATION_ANNOTATION: "1s", EXIT_CODE_ANNOTATION: "3"})
    )
    core.create_namespaced_pod(namespace, pod("keeps-running"))
    fleet_nodes = {n.name for n in cluster.settings.fleet.nodes}

    done = eventually(
        lambda: (p := core.read_namespaced_pod("done", namespace)).status.phase == "Succeeded" and p,
        what="the pod to succeed",
    )
    assert done.spec.node_name in fleet_nodes
    (status,) = done.status.container_statuses
    assert status.state.terminated.exit_code == 0
    assert status.state.terminated.reason == "Completed"

    failed = eventually(
        lambda: (p := core.read_namespaced_pod("fails", namespace)).status.phase == "Failed" and p,
        what="the pod to fail",
    )
    assert failed.status.container_statuses[0].state.terminated.exit_code == 3

    running = core.read_namespaced_pod("keeps-running", namespace)
    assert running.status.phase == "Running"
    time.sleep(3)
    assert core.read_namespaced_pod("keeps-running", namespace).status.phase == "Running"


def test_fake_nodes_carry_gpu_labels(cluster: LocalCluster, core: client.CoreV1Api) -> None:
    nodes = {n.metadata.name: n for n in core.list_node().items}
    for fake in cluster.settings.fleet.nodes:
        labels = nodes[fake.name].metadata.labels
        assert labels["kubernetes.io/hostname"] == fake.name
        assert labels["nvidia.com/gpu.count"] == str(len(fake.gpus))
        assert labels["nvidia.com/gpu.present"] == "true"


def test_prometheus_serves_the_fleet_and_follows_changes(cluster: LocalCluster) -> None:
    fleet = cluster.settings.fleet
    series = cluster.prometheus_query("DCGM_FI_DEV_FB_FREE")
    by_uuid = {s["metric"]["UUID"]: s["metric"] for s in series}
    assert set(by_uuid) == {gpu.uuid for _, gpu in fleet.all_gpus()}
    for node, gpu in fleet.all_gpus():
        labels = by_uuid[gpu.uuid]
        assert labels["Hostname"] == node.name
        assert labels["gpu"] == str(gpu.index)
        assert labels["modelName"] == gpu.model
        assert labels["DCGM_FI_DRIVER_VERSION"] == fleet.driver_version
        assert {"pci_bus_id", "device"} <= set(labels)
    for metric in ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED"):
        assert len(cluster.prometheus_query(metric)) == len(by_uuid)

    _, target = fleet.all_gpus()[0]
    started = time.monotonic()
    cluster.exporter.set_used(target.uuid, 12_345)

    def seen() -> bool:
        result = cluster.prometheus_query(f'DCGM_FI_DEV_FB_USED{{UUID="{target.uuid}"}}')
        return bool(result) and result[0]["value"][1] == "12345"

    eventually(seen, what="the new value in Prometheus", timeout_s=10)
    print(f"usage change visible in Prometheus after {time.monotonic() - started:.2f} s")
    cluster.exporter.set_used(target.uuid, 0)


def test_minted_user_without_permissions_is_refused_by_rbac(cluster: LocalCluster, namespace: str) -> None:
    nobody = config.new_client_from_config(
        config_file=str(cluster.mint_kubeconfig("nobody", groups=("nogroup",)))
    )
    with pytest.raises(ApiException) as refused:
        client.CoreV1Api(nobody).list_namespaced_pod(namespace)
    assert refused.value.status == 403
    assert 'User "nobody" cannot list resource "pods"' in json.loads(refused.value.body)["message"]

    # Granting the group a role makes the same identity succeed: authentication works, RBAC decides.
    cluster.kubectl(
        "create", "rolebinding", "viewers", "-n", namespace, "--clusterrole=view", "--group=nogroup"
    )
    eventually(
        lambda: client.CoreV1Api(nobody).list_namespaced_pod(namespace) is not None,
        what="the role binding to take effect",
        timeout_s=10,
    )


def etcd_and_api_server_only() -> ClusterSettings:
    """The smallest control plane (plus the fake exporter): quick to start, for tests of starting."""
    return ClusterSettings(
        with_scheduler=False,
        with_controller_manager=False,
        with_kwok=False,
        with_prometheus=False,
        install_crds=False,
    )


def test_stop_leaves_nothing_running() -> None:
    small = LocalCluster.start(settings=etcd_and_api_server_only())
    pids = small.pids()
    ports = [small.ports["etcd"], small.ports["apiserver"], small.ports["exporter"]]
    workdir = small.workdir
    assert len(pids) == 3
    small.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open"
    assert not workdir.exists()


def test_a_port_taken_before_its_component_binds_it_starts_again_on_new_ports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port is checked free well before its component binds it; another program may take it between
    the two (seen with two clusters starting at once). The start is tried again on new ports."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handed_out = iter([port])  # etcd's client port, the first one a cluster asks for
        real_free_port = cluster_module.free_port
        monkeypatch.setattr(cluster_module, "free_port", lambda: next(handed_out, 0) or real_free_port())
        small = LocalCluster.start(settings=etcd_and_api_server_only())
        try:
            assert port not in small.ports.values()
            assert all(c.running for c in small.components)
            assert small.kubectl("get", "--raw", "/readyz") == "ok"
        finally:
            small.stop()
    err = capsys.readouterr().err
    assert "starting again on new ports" in err
    assert "address already in use" in err
