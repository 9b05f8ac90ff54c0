"""Queue mode on the real stack: API server, scheduler, kwok pods, fake exporter, Prometheus, the webhook
over TLS and two controller replicas, with the admission parts users run next to it: a labelling
webhook and a sidecar injector after vramshare (so the API server reinvokes it) and a ResourceQuota
that rejects a pod vramshare has queued. A pod that does not fit waits behind a scheduling gate and is
placed when memory frees; in refuse mode a refused large task gets a hold for its next try. Its own
control plane, since it fills every GPU."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from vramshare.kube.pods import QUEUE_GATE
from vramshare.kube.resources import (
    ANNOTATION_GPU_UUID,
    ANNOTATION_RESERVATION,
    LABEL_COMMITTED,
    LABEL_GPU,
    LABEL_HELD_FOR,
    device_name,
)
from vramshare_e2e.admission_parts import SIDECAR, start_mutating_webhook
from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, LocalCluster
from vramshare_e2e.components import start_controller, start_webhook, webhook_configuration
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

NS = "queued"
QUOTA_NS = "queued-quota"
MARGIN = 512
CONTROLLER_ENV = {
    "VRAMSHARE_POLL_INTERVAL_S": "1",
    "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
    "VRAMSHARE_RESERVATION_TTL_S": "6",
    "VRAMSHARE_SETTLE_S": "2",
    "VRAMSHARE_SAFETY_MARGIN_MIB": str(MARGIN),
    "VRAMSHARE_LEASE_DURATION_S": "4",
    "VRAMSHARE_LEASE_RENEW_DEADLINE_S": "2.5",
    "VRAMSHARE_LEASE_RETRY_PERIOD_S": "0.5",
    "VRAMSHARE_QUEUE_INTERVAL_S": "1",
    "VRAMSHARE_HOLD_LIMIT_S": "12",
}


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        port = start_webhook(local, name="webhook", env={"VRAMSHARE_SETTLE_S": "2"})[1]
        local.apply_objects([webhook_configuration(local, ports={"q": port})])
        start_mutating_webhook(local, mode="label")
        start_mutating_webhook(local, mode="sidecar")
        for ns in (NS, QUOTA_NS):
            # Queue mode by namespace label; the webhook shard and the other webhooks by the harness's.
            local.create_namespace(
                ns,
                {
                    "vramshare-e2e/shard": "q",
                    "vramshare.io/queue": "true",
                    "e2e.vramshare.io/label": "on",
                    "e2e.vramshare.io/sidecar": "on",
                },
            )
        local.apply_objects(
            [
                {
                    "apiVersion": "v1",
                    "kind": "ResourceQuota",
                    "metadata": {"name": "no-pods", "namespace": QUOTA_NS},
                    "spec": {"hard": {"pods": "0"}},
                }
            ]
        )
        start_controller(local, name="controller-1", env=CONTROLLER_ENV)
        start_controller(local, name="controller-2", env=CONTROLLER_ENV)
        yield local


@pytest.fixture(scope="module")
def core(stack: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(stack.kubeconfig)))


def capacity(stack: LocalCluster) -> dict[str, int]:
    """What each GPU can book when empty: total - driver reserved - margin."""
    return {g.uuid: g.total_mib - g.driver_reserved_mib - MARGIN for _, g in stack.settings.fleet.all_gpus()}


def gpu_pod(
    name: str,
    mib: int,
    *,
    run: str | None = None,
    queue: str | None = None,
    labels: dict[str, str] | None = None,
) -> client.V1Pod:
    annotations = {"gpu-mem-mb": str(mib)}
    if run:
        annotations[RUN_DURATION_ANNOTATION] = run
    if queue is not None:
        annotations["gpu-queue"] = queue
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations, labels=labels),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="base", image="example.invalid/task")], restart_policy="Never"
        ),
    )


def reservations(stack: LocalCluster, namespace: str = NS) -> dict[str, dict[str, Any]]:
    items = json.loads(stack.kubectl("get", "gpureservations", "-n", namespace, "-o", "json"))["items"]
    return {r["metadata"]["name"]: r for r in items}


def published(stack: LocalCluster, figure: str) -> dict[str, int | None]:
    """A figure of each GpuDevice's status (headroomMiB, usedMiB) as the controller last published it."""
    items = json.loads(stack.kubectl("get", "gpudevices", "-o", "json"))["items"]
    return {d["metadata"]["name"]: d.get("status", {}).get(figure) for d in items}


def headrooms(stack: LocalCluster) -> dict[str, int | None]:
    return published(stack, "headroomMiB")


def phase(r: dict[str, Any]) -> str | None:
    return r.get("status", {}).get("phase")


def gates(core: client.CoreV1Api, name: str) -> list[str]:
    pod = core.read_namespaced_pod(name, NS)
    return [g.name for g in pod.spec.scheduling_gates or []]


def fill_every_gpu(stack: LocalCluster, *, used: bool) -> None:
    """Make every GPU look full to DCGM (an outside process), or empty again."""
    for _, gpu in stack.settings.fleet.all_gpus():
        stack.exporter.set_used(gpu.uuid, gpu.total_mib - gpu.driver_reserved_mib - 100 if used else 0)


def test_a_queued_pod_waits_gated_and_is_placed_within_seconds_of_memory_freeing(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    # Fill every GPU with bookings that end in a few seconds (largest first: each lands on its size).
    for i, room in enumerate(sorted(capacity(stack).values(), reverse=True)):
        core.create_namespaced_pod(NS, gpu_pod(f"blocker-{i}", room, run="8s"))
    waiter = core.create_namespaced_pod(NS, gpu_pod("waiter", 20_000))
    entry = waiter.metadata.annotations[ANNOTATION_RESERVATION]
    assert QUEUE_GATE in gates(core, "waiter")
    assert ANNOTATION_GPU_UUID not in waiter.metadata.annotations
    # Every container, the injected sidecar too (vramshare was reinvoked after the injector), reads
    # the GPU from the annotation the controller writes when it places the pod.
    assert [c.name for c in waiter.spec.containers] == ["base", SIDECAR]
    for container in waiter.spec.containers:
        env = {e.name: e for e in container.env}
        assert env["NVIDIA_VISIBLE_DEVICES"].value_from.field_ref.field_path == (
            f"metadata.annotations['{ANNOTATION_GPU_UUID}']"
        )
        assert env["CUDA_VISIBLE_DEVICES"].value == "0"
    assert waiter.metadata.labels["e2e.vramshare.io/injected"] == "yes"
    # One entry, though the webhook was called twice (reinvoked); the head's hold, which the queue
    # makes at once for it, is not a booking of the pod's own.
    entries = [
        r for r in reservations(stack).values() if LABEL_HELD_FOR not in r["metadata"].get("labels", {})
    ]
    assert [r["spec"]["podName"] for r in entries].count("waiter") == 1
    queued = eventually(
        lambda: (r := reservations(stack).get(entry)) and r.get("status", {}).get("queuePosition") == 1 and r,
        what="the entry Queued at position 1",
    )
    assert phase(queued) == "Queued"
    assert "gpuUUID" not in queued["spec"]
    assert any(
        e.reason == "QueuedForGpu"
        for e in core.list_namespaced_event(NS).items
        if e.involved_object.name == "waiter"
    )
    # The blockers finish; the waiter is placed on an A100 (the only GPUs big enough) within seconds.
    blockers = [n for n, r in reservations(stack).items() if r["spec"]["podName"].startswith("blocker-")]
    eventually(
        lambda: any(phase(reservations(stack)[n]) == "Released" for n in blockers),
        what="a blocker released",
        timeout_s=30,
    )
    freed = time.monotonic()
    placed = eventually(
        lambda: not gates(core, "waiter") and core.read_namespaced_pod("waiter", NS), what="the gate lifted"
    )
    delay = time.monotonic() - freed
    print(f"\nqueued pod placed {delay:.1f} s after the first blocker was released")
    assert delay < 15
    uuid = placed.metadata.annotations[ANNOTATION_GPU_UUID]
    node = next(n for n, g in stack.settings.fleet.all_gpus() if g.uuid == uuid)
    assert capacity(stack)[uuid] >= 20_000
    # The budget that depends on the GPU, for the variables the pod reads from it: 20000 of 40960 MiB.
    assert placed.metadata.annotations["vramshare.io/gpu-memory-fraction"] == "0.48"
    env = {e.name: e for e in placed.spec.containers[0].env}
    assert env["VRAMSHARE_GPU_MEMORY_MIB"].value == "20000"
    terms = placed.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    assert terms.node_selector_terms[0].match_fields[0].values == [node.name]
    bound = eventually(
        lambda: (r := reservations(stack)[entry]) and phase(r) == "Bound" and r, what="Bound", timeout_s=20
    )
    assert bound["spec"]["gpuUUID"] == uuid
    assert "queuePosition" not in bound["status"]
    eventually(lambda: core.read_namespaced_pod("waiter", NS).spec.node_name == node.name, what="scheduled")
    core.delete_namespaced_pod("waiter", NS)


def test_a_request_no_gpu_could_ever_take_is_refused_and_the_annotation_opts_out(
    core: client.CoreV1Api,
) -> None:
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod(NS, gpu_pod("too-big", 60_000))
    assert refused.value.status == 403
    with pytest.raises(client.ApiException) as bad:
        core.create_namespaced_pod(NS, gpu_pod("bad-queue", 1000, queue="maybe"))
    assert bad.value.status == 400
    assert 'annotation \\"gpu-queue\\" is \\"maybe\\"' in bad.value.body


def test_deleting_a_queued_pod_takes_it_out_of_the_queue(stack: LocalCluster, core: client.CoreV1Api) -> None:
    fill_every_gpu(stack, used=True)
    try:
        eventually(lambda: refused_now(core), what="GPUs seen full by the webhook", timeout_s=30)
        # The controller's published view too: it places from the queue by it.
        eventually(
            lambda: all(h is not None and h < 4096 for h in headrooms(stack).values()),
            what="GPUs seen full by the controller",
            detail=lambda: headrooms(stack),
        )
        first = core.create_namespaced_pod(NS, gpu_pod("q-first", 4096))
        second = core.create_namespaced_pod(NS, gpu_pod("q-second", 4096))
        names = [p.metadata.annotations[ANNOTATION_RESERVATION] for p in (first, second)]

        def entries() -> list[tuple[str | None, int | None, str | None]]:
            found = reservations(stack)
            return [
                (phase(r), r.get("status", {}).get("queuePosition"), r.get("status", {}).get("message"))
                for r in (found.get(n, {}) for n in names)
            ]

        eventually(
            lambda: [position for _, position, _ in entries()] == [1, 2],
            what="positions 1 and 2",
            detail=entries,
        )
        core.delete_namespaced_pod("q-first", NS)
        eventually(
            lambda: names[0] not in reservations(stack) or phase(reservations(stack)[names[0]]) == "Released",
            what="the deleted pod's entry leaving the queue",
        )
        eventually(
            lambda: reservations(stack)[names[1]].get("status", {}).get("queuePosition") == 1,
            what="the second moving up",
        )
    finally:
        fill_every_gpu(stack, used=False)
    eventually(
        lambda: not gates(core, "q-second"), what="the second placed once the GPUs are free", timeout_s=30
    )
    core.delete_namespaced_pod("q-second", NS)


def fits_now(core: client.CoreV1Api, mib: int) -> bool:
    """A dry-run creation of a pod asking `mib` in refuse mode is admitted (the webhook sees room)."""
    try:
        core.create_namespaced_pod(NS, gpu_pod("probe", mib, queue="false"), dry_run="All")
    except client.ApiException as exc:
        if exc.status == 403:
            return False
        raise
    return True


def refused_now(core: client.CoreV1Api) -> bool:
    """A dry-run creation in refuse mode says no GPU fits (the webhook sees the GPUs full)."""
    return not fits_now(core, 2048)


def test_fifty_queued_pods_over_a_controller_failover_are_placed_once_without_overbooking(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    caps = capacity(stack)
    fill_every_gpu(stack, used=True)
    eventually(lambda: refused_now(core), what="GPUs seen full", timeout_s=30)
    pods = [f"many-{i:02d}" for i in range(50)]
    for name in pods:
        core.create_namespaced_pod(NS, gpu_pod(name, 4096, run="3s"))
    eventually(
        lambda: (
            sum(
                phase(r) == "Queued" and r.get("status", {}).get("podUID") is not None
                for r in reservations(stack).values()
                if r["spec"]["podName"].startswith("many-")
            )
            == 50
        ),
        what="50 entries queued with their pods",
    )
    worst: Counter[str] = Counter()
    worst_holders: dict[str, list[str]] = {}  # who held each GPU at its peak, for the message below
    problems: list[str] = []
    stop = threading.Event()
    restarting = threading.Event()
    checks = [0]

    def watch_bookings() -> None:
        while not stop.is_set():
            if restarting.is_set():  # the API server is away: nothing to read
                time.sleep(0.2)
                continue
            try:
                booked: Counter[str] = Counter()
                holders: dict[str, list[str]] = {}
                listed = reservations(stack).values()
                for r in listed:
                    # A booking counts on the GPU its spec names while it is open. A placement the
                    # next leader took back loses its GPU from the spec before its recorded phase
                    # (Reserved, or Bound if its pod was seen) is written back to Queued.
                    gpu = r["spec"].get("gpuUUID")
                    # The head's hold is not memory anyone uses: it claims, for the head, memory that
                    # is still in use on a GPU the head does not fit yet (vramshare.domain.queue), so
                    # it may take the GPU's bookings past its size until that memory frees.
                    if r["metadata"].get("labels", {}).get(LABEL_HELD_FOR):
                        continue
                    if gpu and phase(r) in (None, "Queued", "Reserved", "Bound", "Lost"):
                        booked[gpu] += r["spec"]["memoryMiB"]
                        labels = r["metadata"].get("labels", {})
                        holders.setdefault(gpu, []).append(
                            f"{r['metadata']['name']}:{phase(r)}:{labels.get('vramshare.io/committed')}"
                            f":{labels.get('vramshare.io/active')}:{r['metadata']['resourceVersion']}"
                        )
                for uuid, mib in booked.items():
                    if mib > worst[uuid]:
                        worst[uuid] = mib
                        worst_holders[uuid] = holders[uuid]
                checks[0] += 1
            except Exception as exc:  # reported below: a monitor that dies must fail the test
                if restarting.is_set():
                    continue
                problems.append(repr(exc))
                return
            time.sleep(0.2)

    monitor = threading.Thread(target=watch_bookings, daemon=True)
    monitor.start()
    fill_every_gpu(stack, used=False)
    leader = json.loads(stack.kubectl("get", "lease", "vramshare-controller", "-n", "default", "-o", "json"))
    holder = leader["spec"]["holderIdentity"]
    eventually(
        lambda: sum(not gates(core, n) for n in pods[:20]) >= 5, what="the first placements", timeout_s=60
    )
    stack.stop_component(holder, kill=True)  # the leader dies mid-way ...
    # ... and the API server restarts: every watch (the webhook's, the other controller's) resumes from
    # a resourceVersion older than the new watch cache, gets 410 Gone and relists, mid-placement.
    restarting.set()
    stack.stop_component("kube-apiserver")
    stack.start_component("kube-apiserver")
    restarting.clear()
    try:
        eventually(
            lambda: all(core.read_namespaced_pod(n, NS).status.phase == "Succeeded" for n in pods),
            what="all 50 pods placed and finished",
            timeout_s=180,
            interval_s=1,
        )
    finally:
        stop.set()
        monitor.join(timeout=5)
        stack.start_component(holder)
    assert not problems, problems
    # The restart made the webhook's watches relist (410 Gone); the controllers' may resume instead.
    relists = {
        component: (stack.logs_dir / f"{component}.log").read_text().count("watch history expired")
        for component in ("webhook", "controller-1", "controller-2")
    }
    print(f"\nrelists after 410 Gone: {relists}")
    assert relists["webhook"] > 0

    def entries() -> list[dict[str, Any]]:
        """The pods' own entries; the head's holds name the head's pod too, and end as Expired."""
        return [
            r
            for r in reservations(stack).values()
            if r["spec"]["podName"].startswith("many-")
            and LABEL_HELD_FOR not in r["metadata"].get("labels", {})
        ]

    # Each booking is released once the controller sees its pod finished (a moment after the last one).
    eventually(
        lambda: all(phase(r) == "Released" for r in entries()),
        what="every booking released",
        timeout_s=20,
        detail=lambda: {
            r["metadata"]["name"]: (phase(r), r.get("status", {}).get("reason"), r["spec"].get("gpuUUID"))
            for r in entries()
            if phase(r) != "Released"
        },
    )
    listed = entries()
    assert sorted(r["spec"]["podName"] for r in listed) == pods  # one entry per pod, none lost or duplicated
    final = {r["spec"]["podName"]: r for r in listed}
    for name in pods:
        pod = core.read_namespaced_pod(name, NS)
        r = final[name]
        assert pod.metadata.annotations[ANNOTATION_GPU_UUID] == r["spec"]["gpuUUID"], name  # placed once
        assert r["status"]["podUID"] == pod.metadata.uid
        assert phase(r) == "Released", name
    for uuid, mib in worst.items():
        assert mib <= caps[uuid], f"{uuid} booked {mib} MiB of {caps[uuid]}: {worst_holders[uuid]}"
    print(
        f"\npeak bookings per GPU: {dict(worst)} (capacity {caps}), over {checks[0]} checks through a "
        "leader failover and an API server restart (a relist after 410 in every watch)"
    )


def test_a_placement_nobody_committed_goes_back_to_the_queue_and_the_gate_stays(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    """What a leader leaves behind when it stops between writing a placement and moving the GPU's
    token (killed, or its commit lost and could not be withdrawn): the placement was never checked
    against the ledger, so the leader that finds it must not lift the pod's gate on it."""
    fill_every_gpu(stack, used=True)
    eventually(lambda: refused_now(core), what="GPUs seen full", timeout_s=30)
    pod = core.create_namespaced_pod(NS, gpu_pod("half-placed", 4096, run="3s"))
    entry = pod.metadata.annotations[ANNOTATION_RESERVATION]
    eventually(
        lambda: (r := reservations(stack).get(entry)) and phase(r) == "Queued" and r["status"].get("podUID"),
        what="the entry Queued with its pod",
    )
    node, gpu = stack.settings.fleet.all_gpus()[0]
    placement = {
        "metadata": {"labels": {LABEL_GPU: device_name(gpu.uuid), LABEL_COMMITTED: "false"}},
        "spec": {"gpuUUID": gpu.uuid, "nodeName": node.name, "gpuIndex": gpu.index},
    }
    stack.kubectl("patch", "gpures", entry, "-n", NS, "--type=merge", "-p", json.dumps(placement))
    # As the reconciler records it once it sees the placed entry's (gated) pod.
    bound = json.dumps({"status": {"phase": "Bound"}})
    stack.kubectl("patch", "gpures", entry, "-n", NS, "--subresource=status", "--type=merge", "-p", bound)
    eventually(
        lambda: (r := reservations(stack)[entry]) and "gpuUUID" not in r["spec"] and phase(r) == "Queued",
        what="the uncommitted placement taken back, and the entry Queued again",
        timeout_s=15,
    )
    assert QUEUE_GATE in gates(core, "half-placed")
    # Once memory frees, it is placed through the commit like any other entry, and only then released.
    fill_every_gpu(stack, used=False)
    placed = eventually(
        lambda: not gates(core, "half-placed") and core.read_namespaced_pod("half-placed", NS),
        what="the gate lifted",
        timeout_s=30,
    )
    booked = reservations(stack)[entry]
    assert booked["spec"]["gpuUUID"] == placed.metadata.annotations[ANNOTATION_GPU_UUID]
    assert booked["metadata"]["labels"][LABEL_COMMITTED] == "true"
    core.delete_namespaced_pod("half-placed", NS)


def test_a_queued_pod_that_a_quota_rejects_leaves_an_entry_that_expires(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    fill_every_gpu(stack, used=True)
    try:
        eventually(lambda: refused_now(core), what="GPUs seen full", timeout_s=30)
        with pytest.raises(client.ApiException) as rejected:
            core.create_namespaced_pod(QUOTA_NS, gpu_pod("over-quota", 4096))
        assert rejected.value.status == 403
        assert "exceeded quota" in rejected.value.body
        (entry,) = reservations(stack, QUOTA_NS).values()  # vramshare queued it before the quota said no
        expired = eventually(
            lambda: (
                (r := reservations(stack, QUOTA_NS)[entry["metadata"]["name"]])
                and phase(r) == "Expired"
                and r
            ),
            what="the orphaned entry Expired",
            timeout_s=30,
        )
        assert expired["status"]["reason"] == "PodNeverCreated"
        assert "gpuUUID" not in expired["spec"]  # never placed: no memory was booked for it
    finally:
        fill_every_gpu(stack, used=False)


def airflow_task(task: str, try_number: int) -> dict[str, str]:
    """The labels the KubernetesPodOperator puts on each try's pod."""
    return {"dag_id": "train", "task_id": task, "run_id": "manual-1", "try_number": str(try_number)}


def holds(stack: LocalCluster) -> list[dict[str, Any]]:
    """Refuse mode's holds (not the queue head's)."""
    return [
        r
        for r in reservations(stack).values()
        if "vramshare.io/held-for" in r["metadata"]["labels"]
        and "vramshare.io/queued" not in r["metadata"]["labels"]
        and phase(r) in (None, "Reserved", "Held")  # Reserved: the CRD's default, nothing written yet
    ]


def test_refuse_mode_holds_memory_for_a_refused_large_task_until_its_next_try(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    caps = capacity(stack)
    fill_every_gpu(stack, used=True)
    try:
        eventually(lambda: refused_now(core), what="GPUs seen full", timeout_s=30)
        with pytest.raises(client.ApiException) as first:
            core.create_namespaced_pod(
                NS, gpu_pod("big-try1", 20_000, queue="false", labels=airflow_task("big", 1))
            )
        assert first.value.status == 403
        assert holds(stack) == []  # asked once: it may never come back, so nothing is held yet
        with pytest.raises(client.ApiException) as refused:  # the executor's retry of the same try
            core.create_namespaced_pod(
                NS, gpu_pod("big-try1", 20_000, queue="false", labels=airflow_task("big", 1))
            )
        assert refused.value.status == 403
        assert "now keeps the memory that frees on it for this task" in refused.value.body
        (hold,) = holds(stack)
        held_gpu = hold["spec"]["gpuUUID"]
        assert caps[held_gpu] >= 20_000  # an A100: the only GPUs the task could ever use
        eventually(lambda: phase(reservations(stack)[hold["metadata"]["name"]]) == "Held", what="Held shown")
    finally:
        fill_every_gpu(stack, used=False)
    # The exporter frees the GPUs one by one, so a scrape can see some free and others full: wait until
    # the other A100 is seen free (30000 MiB fits there, never on the held one), and the held one too
    # (its device says so; without that wait its retry below was once refused as still full).
    eventually(lambda: fits_now(core, 30_000), what="the other A100 seen free", timeout_s=30)
    eventually(
        lambda: published(stack, "usedMiB")[device_name(held_gpu)] == 0,
        what="the held A100 seen free",
        timeout_s=30,
    )
    # Another large task may not take the held memory: it goes to the other A100 ...
    other = core.create_namespaced_pod(NS, gpu_pod("other-big", 30_000, queue="false", run="60s"))
    assert other.metadata.annotations[ANNOTATION_GPU_UUID] != held_gpu
    # ... and a second one is refused, although the held GPU is empty to DCGM.
    with pytest.raises(client.ApiException) as kept_off:
        core.create_namespaced_pod(NS, gpu_pod("third-big", 30_000, queue="false"))
    assert kept_off.value.status == 403
    # The big task's next try (a new pod of the same task) is admitted onto the held GPU; the hold goes.
    retry = core.create_namespaced_pod(
        NS, gpu_pod("big-try2", 20_000, queue="false", labels=airflow_task("big", 2))
    )
    assert retry.metadata.annotations[ANNOTATION_GPU_UUID] == held_gpu
    eventually(lambda: holds(stack) == [], what="the hold withdrawn", timeout_s=10)
    for name in ("other-big", "big-try2"):
        core.delete_namespaced_pod(name, NS)


def test_a_hold_whose_task_never_comes_back_lapses(stack: LocalCluster, core: client.CoreV1Api) -> None:
    fill_every_gpu(stack, used=True)
    try:
        eventually(lambda: refused_now(core), what="GPUs seen full", timeout_s=30)
        for _ in range(2):  # seen retrying once, then never again
            with pytest.raises(client.ApiException):
                core.create_namespaced_pod(
                    NS, gpu_pod("gone-try1", 20_000, queue="false", labels=airflow_task("gone", 1))
                )
        (hold,) = holds(stack)
    finally:
        fill_every_gpu(stack, used=False)
    name = hold["metadata"]["name"]
    started = time.monotonic()
    lapsed = eventually(
        lambda: (r := reservations(stack)[name]) and phase(r) == "Expired" and r,
        what="the hold lapsed",
        timeout_s=60,
    )
    print(f"\nhold lapsed {time.monotonic() - started:.0f} s after it was seen (limit 12 s)")
    assert lapsed["status"]["reason"] == "HoldLapsed"


def queue_holds(stack: LocalCluster) -> list[dict[str, Any]]:
    """The queue head's hold, as the controller keeps it in the ledger."""
    return [
        r
        for r in reservations(stack).values()
        if r["metadata"]["labels"].get("vramshare.io/queued") == "true"
        and "vramshare.io/held-for" in r["metadata"]["labels"]
        and r["metadata"]["labels"].get("vramshare.io/active") != "false"
    ]


def test_a_heads_hold_goes_with_its_head_when_nothing_else_waits(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    """Issue #42, 8: the head deleted and nothing else queued, its hold is withdrawn at once, not kept
    until it lapses (12 s here, 900 s by default) while it counts for nobody."""
    caps = capacity(stack)
    for i, room in enumerate(sorted(caps.values(), reverse=True)):
        core.create_namespaced_pod(NS, gpu_pod(f"fill-{i}", room, run="300s"))
    core.create_namespaced_pod(NS, gpu_pod("lonely-head", 30_000))
    assert QUEUE_GATE in gates(core, "lonely-head")
    eventually(lambda: queue_holds(stack), what="the head's hold in the ledger", timeout_s=20)
    core.delete_namespaced_pod("lonely-head", NS)
    started = time.monotonic()
    eventually(lambda: queue_holds(stack) == [], what="the hold withdrawn with its head", timeout_s=6)
    print(f"\nhold withdrawn {time.monotonic() - started:.1f} s after its head was deleted (lapse: 12 s)")
    core.delete_collection_namespaced_pod(NS)
    eventually(lambda: not core.list_namespaced_pod(NS).items, what="pods gone", timeout_s=30)


def test_the_heads_hold_is_a_booking_so_a_stream_of_new_pods_cannot_take_its_memory(
    stack: LocalCluster, core: client.CoreV1Api
) -> None:
    caps = capacity(stack)
    for i, room in enumerate(sorted(caps.values(), reverse=True)):
        core.create_namespaced_pod(NS, gpu_pod(f"full-{i}", room, run="300s"))
    core.create_namespaced_pod(NS, gpu_pod("head", 30_000))
    assert QUEUE_GATE in gates(core, "head")
    (hold,) = eventually(lambda: queue_holds(stack), what="the head's hold in the ledger", timeout_s=20)
    held_gpu = hold["spec"]["gpuUUID"]
    assert caps[held_gpu] >= 30_000
    assert hold["spec"]["memoryMiB"] == 30_000
    # A stream of small pods admitted directly (refuse mode), from before the held GPU frees up; then
    # its pod ends. Without the hold in the ledger the stream would take that GPU (the only one with
    # room) and the head would wait for good.
    made: list[tuple[str, str]] = []
    stop = threading.Event()

    def stream() -> None:
        i = 0
        while not stop.wait(0.5):
            i += 1
            try:
                pod = core.create_namespaced_pod(NS, gpu_pod(f"small-{i}", 3000, queue="false", run="40s"))
            except client.ApiException:
                continue
            made.append((pod.metadata.name, pod.metadata.annotations[ANNOTATION_GPU_UUID]))

    streaming = threading.Thread(target=stream, daemon=True)
    streaming.start()
    time.sleep(2)
    (blocker,) = [
        r["spec"]["podName"]
        for r in reservations(stack).values()
        if r["spec"]["podName"].startswith("full-") and r["spec"].get("gpuUUID") == held_gpu
    ]
    core.delete_namespaced_pod(blocker, NS)
    started = time.monotonic()
    try:
        placed = eventually(
            lambda: not gates(core, "head") and core.read_namespaced_pod("head", NS),
            what="the head placed despite the stream",
            timeout_s=25,
        )
        waited = time.monotonic() - started
        # The head is placed within moments of its GPU freeing; the stream goes on, for the GPU's room
        # beyond the head's to be taken too.
        eventually(
            lambda: any(uuid == held_gpu for _, uuid in made),
            what="a small pod on the held GPU",
            timeout_s=15,
        )
    finally:
        stop.set()
        streaming.join()
    on_held = [name for name, uuid in made if uuid == held_gpu]
    print(
        f"\nhead placed {waited:.1f} s after its held GPU freed; {len(made)} small pods of the stream in "
        f"({len(on_held)} on the held GPU, within its room beyond the head's 30000 MiB); hold limit 12 s"
    )
    assert placed.metadata.annotations[ANNOTATION_GPU_UUID] == held_gpu
    assert on_held  # the stream did use the held GPU's room beyond the head's ...
    assert len(on_held) * 3000 <= caps[held_gpu] - 30_000  # ... and no more
    eventually(
        lambda: queue_holds(stack) == [], what="the hold withdrawn once the head is placed", timeout_s=15
    )
    core.delete_collection_namespaced_pod(NS)
    eventually(lambda: not core.list_namespaced_pod(NS).items, what="pods gone", timeout_s=30)
