"""Bookings that outlive their reservation's deletion (issue #30, 5), on the controller's stack: a
deleted namespace or a foreground deletion keeps a booking counted until its pods are gone."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from tests.integration.controller_stack import (
    controller_stack,
    devices,
    events_for,
    gpu_pod,
    reservation,
)
from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_RESERVATION
from vramshare_e2e.bookings import shown_phase_of
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with controller_stack() as local:
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


TERMINATING = "e2e.vramshare.io/terminating"
"""A finalizer of the test's own on a pod: it keeps the pod deleted but present, Running, as a pod in
its graceful termination is (kwok removes a deleted pod only once it has no finalizers)."""


def terminating_pod(name: str, mib: int) -> client.V1Pod:
    pod = gpu_pod(name, mib)
    pod.metadata.finalizers = [TERMINATING]
    return pod


def counted(stack: LocalCluster, pod: client.V1Pod) -> None:
    """Until the controller's published view of the pod's GPU counts its booking (a poll away)."""
    uuid, mib = pod.metadata.annotations[ANNOTATION_GPU_UUID], int(pod.metadata.annotations["gpu-mem-mb"])
    eventually(lambda: devices(stack)[uuid]["status"]["reservedMiB"] >= mib, what="the booking counted")


def keeps_counting(
    stack: LocalCluster,
    core: client.CoreV1Api,
    *,
    namespace: str,
    pod: client.V1Pod,
    event: bool = True,
    deleted: bool = True,
) -> str:
    """Wait until the pod is terminating and (`deleted`) its booking's deletion requested, then check
    for 4 s (four lifecycle sweeps) that the booking stays, not ended, counted in its GPU's reserved
    memory, and (`event`) that an event says why; returns its name. A namespace being deleted takes no
    new events."""
    name = pod.metadata.annotations[ANNOTATION_RESERVATION]
    uuid = pod.metadata.annotations[ANNOTATION_GPU_UUID]
    mib = int(pod.metadata.annotations["gpu-mem-mb"])
    eventually(
        lambda: core.read_namespaced_pod(pod.metadata.name, namespace).metadata.deletion_timestamp,
        what="the pod terminating",
    )
    if deleted:
        eventually(
            lambda: reservation(stack, name, namespace)["metadata"].get("deletionTimestamp"),
            what="the booking's deletion requested",
        )
    until = time.monotonic() + 4
    while time.monotonic() < until:
        res = reservation(stack, name, namespace)  # still there: a NotFound fails the test
        assert res["status"]["phase"] == "Reserved", res["status"]  # as admitted: nothing ended it
        assert devices(stack)[uuid]["status"]["reservedMiB"] >= mib
        time.sleep(0.5)
    if not event:
        return name
    messages = [e.message for e in events_for(core, namespace, name) if e.reason == "ReleaseWaitsForPod"]
    assert messages, "no ReleaseWaitsForPod event"
    assert f"stay booked until pod {pod.metadata.name} has terminated" in messages[0], messages
    return name


def gone_after_the_pod(
    stack: LocalCluster, core: client.CoreV1Api, *, namespace: str, pod: str, res: str
) -> float:
    """Let the pod finish terminating; returns how long its booking then took to go."""
    core.patch_namespaced_pod(pod, namespace, {"metadata": {"finalizers": None}})
    started = time.monotonic()
    eventually(
        lambda: "NotFound" in stack.kubectl("get", "gpureservation", res, "-n", namespace, check=False),
        what="the booking gone with its pod",
        timeout_s=15,
    )
    return time.monotonic() - started


def test_a_deleted_namespace_keeps_its_bookings_until_its_pods_are_gone(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    """Before Kubernetes 1.33 (KEP-5080, ordered namespace deletion: beta and on by default in 1.33,
    GA in 1.34) the namespace controller deleted every resource of a namespace at once, pods and
    GpuReservations together, while the pods could still be terminating with their GPU memory in use.
    This control plane (1.37) deletes the pods first and the rest once they are gone, so the test does
    by hand what the older namespace controller did: delete the namespace's GpuReservations as well.
    Before: the booking was gone at once."""
    ns = "doomed"
    stack.create_namespace(ns, {"vramshare-e2e/shard": "ctl"})
    pod = core.create_namespaced_pod(ns, terminating_pod("still-running", 3000))
    res = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: shown_phase_of(stack.kubectl, ns, res) == "Bound", what="Bound")
    counted(stack, pod)
    core.delete_namespace(ns)
    # 1.37's namespace controller leaves the booking alone while the pod is there (ordered deletion)...
    eventually(
        lambda: core.read_namespaced_pod("still-running", ns).metadata.deletion_timestamp,
        what="the pod terminating",
    )
    time.sleep(2)
    assert not reservation(stack, res, ns)["metadata"].get("deletionTimestamp")
    # ...an older one deleted it with everything else at once.
    stack.kubectl("delete", "gpureservations", "--all", "-n", ns, "--wait=false")
    keeps_counting(stack, core, namespace=ns, pod=pod, event=False)
    took = gone_after_the_pod(stack, core, namespace=ns, pod="still-running", res=res)
    eventually(
        lambda: "NotFound" in stack.kubectl("get", "namespace", ns, check=False),
        what="the namespace gone",
        timeout_s=30,
    )
    print(f"\nnamespace deletion: the booking counted while its pod terminated, gone {took:.2f} s after it")


def test_foreground_deletion_of_a_pod_keeps_its_booking_until_the_pod_is_gone(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    """Foreground deletion deletes the pod's dependents first, while the pod terminates: once the
    booking through its ownerReference (before issue #30 it was gone at once). Since issue #31
    vramshare writes no ownerReference, so the booking is not a dependent: it is not deleted at all
    while its pod terminates, and the controller deletes it once the pod is gone. A booking of an
    older vramshare, which has one, is deleted and kept by its finalizer (the namespace test above)."""
    pod = core.create_namespaced_pod("jobs", terminating_pod("foreground", 3000))
    res = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(lambda: shown_phase_of(stack.kubectl, "jobs", res) == "Bound", what="Bound")
    counted(stack, pod)
    core.delete_namespaced_pod("foreground", "jobs", propagation_policy="Foreground")
    keeps_counting(stack, core, namespace="jobs", pod=pod, event=False, deleted=False)
    assert not reservation(stack, res)["metadata"].get("deletionTimestamp")
    took = gone_after_the_pod(stack, core, namespace="jobs", pod="foreground", res=res)
    print(f"\nforeground deletion: the booking counted while its pod terminated, gone {took:.2f} s after it")
