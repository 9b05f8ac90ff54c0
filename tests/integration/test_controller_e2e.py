"""The controller against the real stack (`controller_stack`): devices following DCGM, a booking's
lifecycle and its events, outages of Prometheus and the exporter, a killed controller, two
controllers, GPUs removed and replaced, and a bad setting."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from tests.integration.controller_stack import (
    CONTROLLER_ENV,
    controller_stack,
    devices,
    events_for,
    gpu_pod,
    phase_of,
    reservation,
)
from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_RESERVATION, device_name
from vramshare_e2e.bookings import shown_phase_of, shown_phases
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import (
    bare_booking,
    metric,
    start_controller,
)
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with controller_stack() as local:
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


def test_devices_appear_and_follow_used_memory(stack: LocalCluster) -> None:
    fleet = stack.settings.fleet
    started = time.monotonic()
    found = eventually(
        lambda: (d := devices(stack)) and len(d) == len(fleet.all_gpus()) and d, what="GpuDevices"
    )
    print(f"\n{len(found)} GpuDevices after {time.monotonic() - started:.1f} s")
    node, gpu = fleet.all_gpus()[0]
    dev = found[gpu.uuid]
    assert dev["metadata"]["name"] == device_name(gpu.uuid)
    assert (dev["spec"]["nodeName"], dev["spec"]["index"], dev["spec"]["model"]) == (
        node.name,
        gpu.index,
        gpu.model,
    )
    assert dev["status"]["totalMiB"] == gpu.total_mib
    assert dev["status"]["state"] == "Ready"
    # API conventions: the status and each condition say which generation they describe.
    generation = dev["metadata"]["generation"]
    assert dev["status"]["observedGeneration"] == generation
    assert {c["observedGeneration"] for c in dev["status"]["conditions"]} == {generation}
    assert all(c["reason"] and c["lastTransitionTime"] for c in dev["status"]["conditions"])
    port = stack.component("controller-1").env["VRAMSHARE_METRICS_PORT"]  # type: ignore[index]
    # The metrics are exported at the end of the poll that wrote the devices.
    eventually(
        lambda: (
            metric(int(port), f'vramshare_gpu_total_mib{{node="{node.name}",uuid="{gpu.uuid}"}}')
            == gpu.total_mib
        ),
        what="the total metric",
        timeout_s=10,
    )
    assert (
        metric(int(port), f'vramshare_gpu_state{{node="{node.name}",state="Ready",uuid="{gpu.uuid}"}}') == 1.0
    )
    stack.exporter.set_used(gpu.uuid, 7_000)
    eventually(
        lambda: devices(stack)[gpu.uuid]["status"]["usedMiB"] == 7_000, what="usedMiB to follow", timeout_s=10
    )
    stack.exporter.set_used(gpu.uuid, 0)
    eventually(
        lambda: devices(stack)[gpu.uuid]["status"]["usedMiB"] == 0, what="usedMiB back to 0", timeout_s=10
    )


def test_reservation_goes_reserved_bound_released_with_events(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    pod = core.create_namespaced_pod("jobs", gpu_pod("short-task", 4096, run="4s"))
    name = pod.metadata.annotations[ANNOTATION_RESERVATION]
    # Bound as `vramshare status` shows it (its pod exists) while the object says Reserved, the CRD's
    # default: nothing writes the booking when its pod appears or starts (issue #45).
    eventually(lambda: shown_phase_of(stack.kubectl, "jobs", name) == "Bound", what="shown Bound")
    running = reservation(stack, name)
    assert running["status"] == {"phase": "Reserved"}
    assert not [f for f in running["metadata"].get("managedFields") or [] if f.get("subresource") == "status"]
    # No ownerReference (issue #31); the controller deletes the booking once its pod is gone (next test).
    assert not running["metadata"].get("ownerReferences")
    assert running["metadata"]["finalizers"] == ["vramshare.io/pod-terminated"]  # set at creation
    eventually(lambda: phase_of(stack, name) == "Released", what="Released")
    released = reservation(stack, name)
    assert released["status"]["reason"] == "PodFinished"
    # Its end is written with what the controller kept in memory: the pod it was bound to, its start.
    assert released["status"]["podUID"] == pod.metadata.uid
    assert released["status"]["podRunningSince"]
    assert released["status"]["observedGeneration"] == released["metadata"]["generation"]
    # Ended: labelled inactive, so the webhook's LIST of the live ledger skips it.
    eventually(
        lambda: reservation(stack, name)["metadata"]["labels"].get("vramshare.io/active") == "false",
        what="the inactive label",
        timeout_s=10,
    )
    messages = [e.message for e in events_for(core, "jobs", "short-task")]
    uuid = pod.metadata.annotations[ANNOTATION_GPU_UUID]
    # Binding posts no event (issue #45: one write per pod); the pod's annotations say where it is booked.
    assert not any(m.startswith("Reserved ") for m in messages), messages
    assert any(m.startswith(f"Released 4096 MiB on {uuid}") for m in messages), messages
    # Released memory no longer counts against the GPU.
    eventually(lambda: devices(stack)[uuid]["status"]["reservedMiB"] == 0, what="reservedMiB 0", timeout_s=10)


def test_deleting_the_pod_deletes_its_reservation(stack: LocalCluster, core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod("jobs", gpu_pod("deleted-task", 1000))
    name = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: shown_phase_of(stack.kubectl, "jobs", name) == "Bound", what="Bound")
    core.delete_namespaced_pod("deleted-task", "jobs")
    eventually(
        lambda: "NotFound" in stack.kubectl("get", "gpureservation", name, "-n", "jobs", check=False),
        what="the controller deleting the reservation",
    )


def test_a_pod_deleted_at_once_releases_its_booking_at_once(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    """A pod deleted right after its creation did exist, so its booking is released and deleted at
    once, not expired as a pod that never came (TTL 6 s here, then kept an hour)."""
    pod = core.create_namespaced_pod("jobs", gpu_pod("gone-at-once", 1000))
    core.delete_namespaced_pod("gone-at-once", "jobs", grace_period_seconds=0)
    name = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(
        lambda: "NotFound" in stack.kubectl("get", "gpureservation", name, "-n", "jobs", check=False),
        what="the controller deleting the booking",
        timeout_s=15,
    )
    never = [
        e
        for e in core.list_namespaced_event("jobs").items
        if e.reason == "PodNeverCreated" and e.involved_object.name == name
    ]
    assert never == []


def test_a_running_pods_booking_counts_from_its_start_with_nothing_written(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    """Issue #45: nothing writes a booking when its pod starts, yet its memory must count once: as
    not yet seen until `settle_s` (2 s here) after the start, then as the used memory DCGM shows. The
    webhook reads the start from its pod watch, the controller from its own. Node a's two A100s (40448
    MiB each for applications, margin 512): one filled by a booking, the other running a 30 000 MiB pod
    whose memory shows as used. 9936 MiB then fit beside it only if that pod's booking is not counted
    twice (as booked and not seen yet, and as used)."""
    a100s = [g.uuid for n, g in stack.settings.fleet.all_gpus() if n.name == "gpu-node-a"]
    filler = eventually(
        lambda: _try_create(core, gpu_pod("fills-one", 39_936, node="gpu-node-a")),
        what="a whole A100 booked (the bookings of earlier tests ended)",
        timeout_s=20,
    )
    runner = core.create_namespaced_pod("jobs", gpu_pod("uses-30000", 30_000, node="gpu-node-a"))
    uuid = runner.metadata.annotations[ANNOTATION_GPU_UUID]
    assert {filler.metadata.annotations[ANNOTATION_GPU_UUID], uuid} == set(a100s)
    booking = runner.metadata.annotations[ANNOTATION_RESERVATION]
    try:
        eventually(lambda: shown_phase_of(stack.kubectl, "jobs", booking) == "Bound", what="running")
        stack.exporter.set_used(uuid, 30_000)
        # The webhook decides on the same GpuDevice: once it shows the pod's memory used, the pod's
        # booking may no longer also count as not seen yet (it started more than 2 s before).
        eventually(lambda: devices(stack)[uuid]["status"]["usedMiB"] == 30_000, what="the memory used")
        beside = eventually(
            lambda: _try_create(core, gpu_pod("fits-beside", 9_936, node="gpu-node-a")),
            what="9936 MiB admitted beside the settled pod",
            timeout_s=20,
        )
        assert beside.metadata.annotations[ANNOTATION_GPU_UUID] == uuid
        # The controller's figures agree: the pod's memory counted once, as used.
        eventually(
            lambda: devices(stack)[uuid]["status"]["headroomMiB"] == 0,
            what="the controller's headroom: 40448 - 30000 used - 9936 booked - 512",
            timeout_s=20,
        )
        assert reservation(stack, booking)["status"] == {"phase": "Reserved"}  # nothing written
    finally:
        stack.exporter.set_used(uuid, 0)
        for name in ("fills-one", "uses-30000", "fits-beside"):
            core.delete_namespaced_pod(name, "jobs", grace_period_seconds=0)


def _try_create(core: client.CoreV1Api, pod: client.V1Pod) -> client.V1Pod | None:
    """The pod created, or None where vramshare refused it (403: no room yet)."""
    try:
        return core.create_namespaced_pod("jobs", pod)
    except client.ApiException as refused:
        if refused.status != 403:
            raise
        return None


def test_orphan_reservation_expires_after_the_ttl(stack: LocalCluster) -> None:
    _, gpu = stack.settings.fleet.all_gpus()[1]
    orphan = bare_booking(
        name="orphan",
        namespace="jobs",
        pod="never-created",
        node="gpu-node-a",
        uuid=gpu.uuid,
        index=gpu.index,
        mib=2048,
    )
    stack.kubectl("create", "-f", "-", stdin=json.dumps(orphan))
    eventually(lambda: phase_of(stack, "orphan") == "Reserved", what="Reserved shown", timeout_s=10)
    started = time.monotonic()
    eventually(lambda: phase_of(stack, "orphan") == "Expired", what="Expired", timeout_s=20)
    assert time.monotonic() - started >= 3  # not before its 6 s TTL (a few s already passed)
    assert reservation(stack, "orphan")["status"]["reason"] == "PodNeverCreated"


def test_overuse_raises_a_condition_and_one_event_and_clears(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    pod = core.create_namespaced_pod("jobs", gpu_pod("greedy", 2000, node="gpu-node-b"))
    uuid = pod.metadata.annotations[ANNOTATION_GPU_UUID]
    name = device_name(uuid)

    def overused() -> str | None:
        conditions = devices(stack)[uuid]["status"].get("conditions", [])
        return next((c["status"] for c in conditions if c["type"] == "MemoryOverused"), None)

    stack.exporter.set_used(uuid, 5_000)  # 2000 reserved + 512 margin < 5000
    eventually(lambda: overused() == "True", what="MemoryOverused", timeout_s=10)
    time.sleep(3)  # several more polls: still one event
    warnings = [
        e
        for e in core.list_namespaced_event("default").items
        if e.involved_object.name == name and e.reason == "MemoryOverused"
    ]
    assert len(warnings) == 1
    assert "jobs/greedy" in warnings[0].message
    assert "uses 5000 MiB, 2488 MiB more than its pods' reservations (2000 MiB)" in warnings[0].message
    stack.exporter.set_used(uuid, 1_500)
    eventually(lambda: overused() == "False", what="MemoryOverused cleared", timeout_s=10)
    core.delete_namespaced_pod("greedy", "jobs")


def live_bookings(stack: LocalCluster, core: client.CoreV1Api, name: str) -> dict[str, Any]:
    """A running pod's booking, so an outage test has a live ledger to keep unchanged."""
    pod = core.create_namespaced_pod("jobs", gpu_pod(name, 2000))
    res = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: shown_phase_of(stack.kubectl, "jobs", res) == "Bound", what="Bound")
    return ledger_of(stack)


def ledger_of(stack: LocalCluster) -> dict[str, Any]:
    """The bookings of running pods (shown Bound, or Lost), with what makes them count."""
    shown = shown_phases(stack.kubectl, "jobs")
    return {
        r["metadata"]["name"]: (r["spec"], shown[r["metadata"]["name"]], r["status"].get("podUID"))
        for r in json.loads(stack.kubectl("get", "gpures", "-n", "jobs", "-o", "json"))["items"]
        if shown.get(r["metadata"]["name"]) in ("Bound", "Lost")
    }


def test_prometheus_outage_marks_stale_and_recovers(stack: LocalCluster, core: client.CoreV1Api) -> None:
    before = live_bookings(stack, core, "during-prometheus-outage")
    assert any(phase == "Bound" for _, phase, _ in before.values())
    stack.stop_component("prometheus")
    try:
        eventually(
            lambda: {d["status"]["state"] for d in devices(stack).values()} == {"Stale"},
            what="Stale",
            timeout_s=20,
        )
    finally:
        stack.start_component("prometheus")
    eventually(
        lambda: {d["status"]["state"] for d in devices(stack).values()} == {"Ready"},
        what="Ready again",
        timeout_s=30,
    )
    log = stack.component("controller-1").log_path.read_text()
    assert log.count("Prometheus unreachable") == 1  # logged once per outage
    assert "Prometheus reachable again" in log
    assert ledger_of(stack) == before  # no booking ended or moved: the pods still run
    core.delete_namespaced_pod("during-prometheus-outage", "jobs")


def test_exporter_outage_marks_stale_never_missing(stack: LocalCluster, core: client.CoreV1Api) -> None:
    before = live_bookings(stack, core, "during-exporter-outage")
    stack.stop_component("fake-dcgm-exporter")
    try:
        eventually(
            lambda: {d["status"]["state"] for d in devices(stack).values()} == {"Stale"},
            what="Stale",
            timeout_s=20,
        )
        time.sleep(5)  # longer than the missing grace
        assert {d["status"]["state"] for d in devices(stack).values()} == {"Stale"}
        assert ledger_of(stack) == before  # a silent exporter is an outage: nothing Lost
    finally:
        stack.start_component("fake-dcgm-exporter")
    eventually(
        lambda: {d["status"]["state"] for d in devices(stack).values()} == {"Ready"},
        what="Ready again",
        timeout_s=30,
    )
    assert ledger_of(stack) == before
    core.delete_namespaced_pod("during-exporter-outage", "jobs")


def test_killed_controller_loses_no_reservation(stack: LocalCluster, core: client.CoreV1Api) -> None:
    pod = core.create_namespaced_pod("jobs", gpu_pod("survivor", 1500))
    name = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: shown_phase_of(stack.kubectl, "jobs", name) == "Bound", what="Bound")
    before = shown_phases(stack.kubectl, "jobs")
    written = {
        r["metadata"]["name"]: r["status"]
        for r in json.loads(stack.kubectl("get", "gpures", "-n", "jobs", "-o", "json"))["items"]
    }
    stack.stop_component("controller-1", kill=True)
    stack.start_component("controller-1")
    time.sleep(4)  # several polls and sweeps by the new process
    assert shown_phases(stack.kubectl, "jobs") == before
    # The new process bound the running pods' bookings again in memory, from the pods: nothing written.
    assert {
        r["metadata"]["name"]: r["status"]
        for r in json.loads(stack.kubectl("get", "gpures", "-n", "jobs", "-o", "json"))["items"]
    } == written


def test_with_two_controllers_only_one_acts_and_the_other_takes_over(stack: LocalCluster) -> None:
    first = stack.component("controller-1")
    _, second_port = start_controller(stack, name="controller-2", env=CONTROLLER_ENV)
    try:
        lease = json.loads(
            stack.kubectl("get", "lease", "vramshare-controller", "-n", "default", "-o", "json")
        )
        assert lease["spec"]["holderIdentity"] == "controller-1"
        time.sleep(3)
        assert metric(second_port, "vramshare_controller_leader") == 0.0
        assert "standing by" in stack.component("controller-2").log_path.read_text()
        assert "GPU state changed" not in stack.component("controller-2").log_path.read_text()
        # A rolling update: SIGTERM. The leader stops its loops, exits, and releases the Lease, so
        # the stand-by takes over within a retry period instead of a whole lease duration.
        started = time.monotonic()
        first.stop()
        stopping_s = time.monotonic() - started
        assert first.log_path.read_text().count("released the lease") == 1
        started = time.monotonic()
        eventually(
            lambda: metric(second_port, "vramshare_controller_leader") == 1.0, what="handover", timeout_s=15
        )
        handover_s = time.monotonic() - started
        print(f"\nSIGTERM: the leader exited in {stopping_s:.1f} s")
        assert handover_s < 4.0, f"took {handover_s:.1f} s: the Lease (4 s) was not released"
        assert lease_holder(stack) == "controller-2"
        # A crash: SIGKILL, nothing released. The stand-by takes over once it has seen the Lease
        # unchanged for its duration by its own clock.
        stack.start_component("controller-1")
        eventually(lambda: "standing by" in first.log_path.read_text(), what="controller-1 standing by")
        second = stack.component("controller-2")
        second.stop(kill=True)
        started = time.monotonic()
        eventually(lambda: lease_holder(stack) == "controller-1", what="failover", timeout_s=15)
        failover_s = time.monotonic() - started
        print(
            f"\nhandover on SIGTERM {handover_s:.1f} s, failover after SIGKILL {failover_s:.1f} s (lease 4 s)"
        )
    finally:
        for name in ("controller-1", "controller-2"):
            if stack.component(name).process is None:
                stack.start_component(name)
        stack.component("controller-2").stop()  # controller-1 leads, for the tests after this one
        eventually(lambda: lease_holder(stack) == "controller-1", what="controller-1 leading", timeout_s=15)


def lease_holder(stack: LocalCluster) -> str:
    lease = json.loads(stack.kubectl("get", "lease", "vramshare-controller", "-n", "default", "-o", "json"))
    return str(lease["spec"].get("holderIdentity") or "")


def test_removed_gpu_goes_missing_and_its_reservations_lost(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    pod = core.create_namespaced_pod("jobs", gpu_pod("on-doomed-gpu", 1000, node="gpu-node-b"))
    uuid = pod.metadata.annotations[ANNOTATION_GPU_UUID]
    name = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: shown_phase_of(stack.kubectl, "jobs", name) == "Bound", what="Bound")
    stack.exporter.remove_gpu(uuid)
    eventually(lambda: devices(stack)[uuid]["status"]["state"] == "Missing", what="Missing", timeout_s=20)
    eventually(lambda: phase_of(stack, name) == "Lost", what="Lost", timeout_s=10)
    warnings = [e for e in events_for(core, "jobs", "on-doomed-gpu") if e.reason == "GpuLost"]
    assert len(warnings) == 1
    assert warnings[0].type == "Warning"


def test_replaced_uuid_shows_as_a_new_device(stack: LocalCluster) -> None:
    # A card with nothing booked on it (the pods of earlier tests still run on some), so that once
    # Missing it is forgotten too.
    node, gpu = next(
        (n, g)
        for n, g in stack.exporter.fleet().all_gpus()
        if n.name == "gpu-node-a" and devices(stack)[g.uuid]["status"]["reservedMiB"] == 0
    )
    stack.exporter.replace_uuid(gpu.uuid, "GPU-11111111-2222-3333-4444-555555555555")
    eventually(
        lambda: "GPU-11111111-2222-3333-4444-555555555555" in devices(stack),
        what="the new device",
        timeout_s=10,
    )
    eventually(
        lambda: devices(stack)[gpu.uuid]["status"]["state"] == "Missing",
        what="old device Missing",
        timeout_s=20,
    )
    new = devices(stack)["GPU-11111111-2222-3333-4444-555555555555"]
    assert (new["spec"]["nodeName"], new["spec"]["index"], new["status"]["state"]) == (
        node.name,
        gpu.index,
        "Ready",
    )
    print("\n" + stack.kubectl("get", "gpudevices,gpureservations", "-A"))
    # Gone for good and nothing booked on it: after forget_missing_after_s its GpuDevice is deleted.
    eventually(lambda: gpu.uuid not in devices(stack), what="old device forgotten", timeout_s=30)
    events = json.loads(stack.kubectl("get", "events", "-n", "default", "-o", "json"))["items"]
    (removed,) = [e for e in events if e["reason"] == "GpuDeviceRemoved" and gpu.uuid in e["message"]]
    assert removed["involvedObject"]["kind"] == "GpuDevice"


def test_invalid_setting_stops_the_controller_with_a_clear_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vramshare.controller"],
        capture_output=True,
        text=True,
        env={"VRAMSHARE_POLL_INTERVAL_S": "soon", "PATH": "/usr/bin"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "VRAMSHARE_POLL_INTERVAL_S='soon' is not valid: expected a number" in result.stderr
