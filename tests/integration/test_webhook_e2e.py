"""The webhook end to end: the real API server calls two real webhook processes over TLS."""

from __future__ import annotations

import concurrent.futures
import json
import re
import ssl
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from vramshare.kube.resources import ANNOTATION_GPU_UUID, ANNOTATION_NODE, ANNOTATION_RESERVATION
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import as_the_api_server, seed_inventory, start_webhook, webhook_configuration

pytestmark = pytest.mark.cluster
MARGIN = 512


@pytest.fixture(scope="module")
def webhooks(cluster: LocalCluster) -> Iterator[dict[str, int]]:
    env = {
        "VRAMSHARE_SAFETY_MARGIN_MIB": str(MARGIN),
        "VRAMSHARE_LOG_LEVEL": "warning",
        "VRAMSHARE_MAX_PENDING_PER_NAMESPACE": "100",
    }
    ports = {shard: start_webhook(cluster, name=f"webhook-{shard}", env=env)[1] for shard in ("a", "b")}
    seed_inventory(cluster)
    cluster.apply_objects([webhook_configuration(cluster, ports=ports)])
    yield ports
    cluster.kubectl("delete", "mutatingwebhookconfiguration", "vramshare-e2e")
    for shard in ports:
        cluster.stop_component(f"webhook-{shard}")


@pytest.fixture
def namespace_labels() -> dict[str, str]:
    return {"vramshare-e2e/shard": "a"}


@pytest.fixture
def gpu_namespace(namespace: str, webhooks: dict[str, int]) -> str:
    """A fresh namespace that webhook a serves, with the webhooks running."""
    return namespace


def gpu_pod(name: str, mib: str | None, **spec: object) -> client.V1Pod:
    annotations = {"gpu-mem-mb": mib} if mib is not None else {}
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(name="base", image="example.invalid/task:1", env=spec.pop("env", None))
            ],
            restart_policy="Never",
            **spec,
        ),
    )


def env_of(pod: client.V1Pod) -> dict[str, list[str]]:
    values: dict[str, list[str]] = defaultdict(list)
    for e in pod.spec.containers[0].env or []:
        values[e.name].append(e.value)
    return values


def refusal(core: client.CoreV1Api, namespace: str, pod: client.V1Pod) -> ApiException:
    """The API server's refusal of `pod`. Where it was created instead, fail saying how it came out: no
    vramshare annotation means no webhook saw it, one means a webhook admitted it."""
    try:
        created = core.create_namespaced_pod(namespace, pod)
    except ApiException as exc:
        return exc
    pytest.fail(
        f"pod {namespace}/{created.metadata.name} was created, not refused: annotations "
        f"{created.metadata.annotations}, env {dict(env_of(created))}"
    )


def reservations(cluster: LocalCluster, namespace: str | None = None) -> list[dict]:
    scope = ["-n", namespace] if namespace else ["-A"]
    return json.loads(cluster.kubectl("get", "gpureservations", *scope, "-o", "json"))["items"]


def test_annotated_pod_is_patched_reserved_and_scheduled_on_the_gpu_node(
    cluster: LocalCluster, core: client.CoreV1Api, gpu_namespace: str
) -> None:
    created = core.create_namespaced_pod(gpu_namespace, gpu_pod("train", "20000"))
    uuid = created.metadata.annotations[ANNOTATION_GPU_UUID]
    node = created.metadata.annotations[ANNOTATION_NODE]
    # spread: only the A100s (40 GiB) have 20000 MiB of headroom
    assert node == "gpu-node-a"
    assert env_of(created) == {
        "NVIDIA_VISIBLE_DEVICES": [uuid],
        "CUDA_VISIBLE_DEVICES": ["0"],
        # The budget inside the pod: 20000 of the A100's 40960 MiB.
        "TF_FORCE_GPU_ALLOW_GROWTH": ["true"],
        "VRAMSHARE_GPU_MEMORY_MIB": ["20000"],
        "VRAMSHARE_GPU_MEMORY_FRACTION": ["0.48"],
        "XLA_PYTHON_CLIENT_MEM_FRACTION": ["0.48"],
    }
    (res,) = reservations(cluster, gpu_namespace)
    assert res["metadata"]["name"] == created.metadata.annotations[ANNOTATION_RESERVATION]
    assert res["spec"]["gpuUUID"] == uuid
    assert res["spec"]["memoryMiB"] == 20000
    deadline = time.monotonic() + 30
    while (pod := core.read_namespaced_pod("train", gpu_namespace)).spec.node_name is None:
        assert time.monotonic() < deadline, "pod was not scheduled"
        time.sleep(0.2)
    assert pod.spec.node_name == node


def test_oversized_pod_is_refused_with_an_explaining_message(
    cluster: LocalCluster, core: client.CoreV1Api, gpu_namespace: str
) -> None:
    refused = refusal(core, gpu_namespace, gpu_pod("huge", "100000"))
    assert refused.status == 403
    message = json.loads(refused.body)["message"]
    assert message.startswith('admission webhook "a.gpu-mem.vramshare.io" denied the request: no GPU has')
    assert f"no GPU has 100000 MiB of headroom for pod {gpu_namespace}/huge" in message
    assert "the most any GPU can give is" in message
    assert "Airflow retries the task" in message
    assert reservations(cluster, gpu_namespace) == []


def test_invalid_annotation_is_refused_with_400(core: client.CoreV1Api, gpu_namespace: str) -> None:
    refused = refusal(core, gpu_namespace, gpu_pod("bad", "1.5"))
    assert refused.status == 400
    assert "annotation \"gpu-mem-mb\" has value '1.5'" in json.loads(refused.body)["message"]


def test_pod_without_annotation_sees_no_gpu(core: client.CoreV1Api, gpu_namespace: str) -> None:
    created = core.create_namespaced_pod(
        gpu_namespace,
        gpu_pod("cpu-only", None, env=[client.V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value="all")]),
    )
    assert env_of(created) == {"NVIDIA_VISIBLE_DEVICES": ["void"]}


def test_spoofed_variables_and_annotations_are_overwritten(
    cluster: LocalCluster, core: client.CoreV1Api, gpu_namespace: str
) -> None:
    spoof = gpu_pod(
        "spoof",
        "1000",
        env=[
            client.V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value="all"),
            client.V1EnvVar(name="CUDA_VISIBLE_DEVICES", value="0,1,2"),
            client.V1EnvVar(name="KEEP", value="me"),
        ],
    )
    spoof.metadata.annotations.update(
        {ANNOTATION_GPU_UUID: "GPU-mine", ANNOTATION_RESERVATION: "stolen", "vramshare.io/other": "x"}
    )
    created = core.create_namespaced_pod(gpu_namespace, spoof)
    uuid = created.metadata.annotations[ANNOTATION_GPU_UUID]
    assert uuid != "GPU-mine"
    assert "vramshare.io/other" not in created.metadata.annotations
    env = env_of(created)
    assert env["KEEP"] == ["me"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == [uuid]
    assert env["CUDA_VISIBLE_DEVICES"] == ["0"]
    assert env["VRAMSHARE_GPU_MEMORY_MIB"] == ["1000"]
    (res,) = reservations(cluster, gpu_namespace)
    assert res["metadata"]["name"] == created.metadata.annotations[ANNOTATION_RESERVATION] != "stolen"
    # And it is logged, at warning level: what the pod tried to set, and who created it.
    lines = [
        json.loads(line)
        for line in cluster.component("webhook-a").log_path.read_text().splitlines()
        if line.startswith("{") and "only vramshare sets" in line
    ]
    (logged,) = [line for line in lines if line["pod"].endswith("/spoof")]
    assert logged["level"] == "warning"
    assert sorted(logged["overwritten"]) == [
        "annotation vramshare.io/gpu-uuid",
        "annotation vramshare.io/other",
        "annotation vramshare.io/reservation",
        "containers[0].env CUDA_VISIBLE_DEVICES",
        "containers[0].env NVIDIA_VISIBLE_DEVICES",
    ]


def test_dry_run_create_is_patched_but_reserves_nothing(
    cluster: LocalCluster, core: client.CoreV1Api, gpu_namespace: str
) -> None:
    answer = core.create_namespaced_pod(gpu_namespace, gpu_pod("dry", "1000"), dry_run="All")
    assert answer.metadata.annotations[ANNOTATION_GPU_UUID].startswith("GPU-")
    assert reservations(cluster, gpu_namespace) == []


def test_pod_pinned_to_a_node_gets_a_gpu_on_that_node(
    cluster: LocalCluster, core: client.CoreV1Api, gpu_namespace: str
) -> None:
    created = core.create_namespaced_pod(
        gpu_namespace, gpu_pod("pinned", "2000", node_selector={"kubernetes.io/hostname": "gpu-node-b"})
    )
    assert created.metadata.annotations[ANNOTATION_NODE] == "gpu-node-b"
    node_b = {g.uuid for n in cluster.settings.fleet.nodes if n.name == "gpu-node-b" for g in n.gpus}
    assert created.metadata.annotations[ANNOTATION_GPU_UUID] in node_b
    refused = refusal(
        core,
        gpu_namespace,
        gpu_pod("pinned-big", "20000", node_selector={"kubernetes.io/hostname": "gpu-node-b"}),
    )
    message = json.loads(refused.body)["message"]
    assert "no GPU on node gpu-node-b has 20000 MiB" in message
    # Judged against the Node objects: the other node is named with the reason.
    assert (
        "node gpu-node-a: nodeSelector kubernetes.io/hostname=gpu-node-b does not match (gpu-node-a)"
        in message
    )


def histogram(url: str, cafile: str) -> dict[str, float]:
    with urllib.request.urlopen(url, context=ssl.create_default_context(cafile=cafile), timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(vramshare_webhook_\w+?)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return float("inf")


def test_concurrent_creations_over_two_replicas_never_overbook(
    cluster: LocalCluster, core: client.CoreV1Api, webhooks: dict[str, int]
) -> None:
    """120 pods of 3000 MiB at once, half through each replica, onto a fleet that fits fewer."""
    for shard in ("a", "b"):
        name = f"burst-{shard}"
        core.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"vramshare-e2e/shard": shard}))
        )
    before = {
        s: histogram(f"https://127.0.0.1:{p}/metrics", str(cluster.ca.cert_path)) for s, p in webhooks.items()
    }

    def create(i: int) -> tuple[str, str | None]:
        ns = f"burst-{'ab'[i % 2]}"
        try:
            pod = core.create_namespaced_pod(ns, gpu_pod(f"p{i}", "3000"))
        except ApiException as exc:
            if exc.status != 403:
                raise
            return ns, None
        return ns, pod.metadata.annotations[ANNOTATION_RESERVATION]

    with concurrent.futures.ThreadPoolExecutor(max_workers=40) as pool:
        results = list(pool.map(create, range(120)))
    admitted = [(ns, r) for ns, r in results if r is not None]
    items = reservations(cluster)
    burst = [r for r in items if r["metadata"]["namespace"].startswith("burst-")]
    # Exactly one reservation per admitted pod, none for refused ones.
    assert sorted((r["metadata"]["namespace"], r["metadata"]["name"]) for r in burst) == sorted(admitted)
    # No GPU holds more than its capacity minus the margin.
    booked: dict[str, int] = defaultdict(int)
    fleet = cluster.exporter.fleet()
    capacity = {g.uuid: g.free_mib - MARGIN for _, g in fleet.all_gpus()}
    # Bookings on the fleet's GPUs (queue entries book nothing; other tests may book made-up GPUs).
    placed = [r for r in items if r["spec"].get("gpuUUID") in capacity]
    for r in placed:
        booked[r["spec"]["gpuUUID"]] += r["spec"]["memoryMiB"]
    for uuid, mib in booked.items():
        assert mib <= capacity[uuid], f"{uuid}: {mib} MiB booked, capacity {capacity[uuid]}"
    # The fleet was oversubscribed, and filled to what it can hold: every refusal was for lack of room.
    other: dict[str, int] = defaultdict(int)
    for r in placed:
        if not r["metadata"]["namespace"].startswith("burst-"):
            other[r["spec"]["gpuUUID"]] += r["spec"]["memoryMiB"]
    possible = sum((capacity[u] - other[u]) // 3000 for u in capacity)
    assert len(admitted) == possible < 120

    after = {
        s: histogram(f"https://127.0.0.1:{p}/metrics", str(cluster.ca.cert_path)) for s, p in webhooks.items()
    }
    conflicts = sum(
        after[s].get("vramshare_webhook_commit_conflicts_total", 0)
        - before[s].get("vramshare_webhook_commit_conflicts_total", 0)
        for s in webhooks
    )
    per_replica = {
        s: after[s].get('vramshare_webhook_decisions_total{outcome="admitted",reason="fits"}', 0)
        - before[s].get('vramshare_webhook_decisions_total{outcome="admitted",reason="fits"}', 0)
        for s in webhooks
    }
    assert sum(per_replica.values()) == len(admitted), per_replica
    # Each replica answered every one of its 60 requests, admitted or refused for lack of room (one
    # replica may win the whole burst: its queued decisions go out as group commits).
    answered = {
        s: sum(
            after[s].get(f'vramshare_webhook_decisions_total{{outcome="{o}",reason="{r}"}}', 0)
            - before[s].get(f'vramshare_webhook_decisions_total{{outcome="{o}",reason="{r}"}}', 0)
            for o, r in (("admitted", "fits"), ("refused", "no-gpu-fits"))
        )
        for s in webhooks
    }
    assert answered == {"a": 60, "b": 60}, answered
    contention_key = 'vramshare_webhook_decisions_total{outcome="refused",reason="contention"}'
    assert sum(after[s].get(contention_key, 0) for s in webhooks) == 0
    buckets = defaultdict(float)
    for s in webhooks:
        for key, value in after[s].items():
            m = re.match(r'vramshare_webhook_decision_seconds_bucket\{le="([^"]+)"\}', key)
            if m:
                buckets[float(m.group(1))] += value - before[s].get(key, 0)
    ordered = sorted(buckets.items())
    print(
        f"\nadmitted {len(admitted)}/120 (per replica {per_replica}), conflicts retried {conflicts:.0f}, "
        f"decision latency p50 <= {quantile(ordered, 0.5)} s, p99 <= {quantile(ordered, 0.99)} s"
    )


def review_of(i: int, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": f"forged-{i}",
            "operation": "CREATE",
            "kind": {"kind": "Pod"},
            "namespace": namespace,
            "object": {
                "metadata": {"name": f"ghost-{i}", "annotations": {"gpu-mem-mb": "10"}},
                "spec": {"containers": [{"name": "base"}]},
            },
        },
    }


def test_reviews_the_api_server_did_not_send_are_refused_and_book_nothing(
    cluster: LocalCluster, webhooks: dict[str, int], gpu_namespace: str
) -> None:
    """Issue #42, 2: a review from a caller without the API server's client certificate (none, or one
    the cluster's CA signed for a user) gets a 403 before it is read, and books nothing."""
    bare = ssl.create_default_context()
    bare.check_hostname = False
    bare.verify_mode = ssl.CERT_NONE
    user = ssl.create_default_context()
    user.check_hostname = False
    user.verify_mode = ssl.CERT_NONE
    mallory = cluster.mint_client_cert("mallory")
    user.load_cert_chain(str(mallory.cert_path), str(mallory.key_path))
    before = len(reservations(cluster, gpu_namespace))
    for i, ctx in enumerate((bare, user, bare, user), start=1000):
        req = urllib.request.Request(
            f"https://127.0.0.1:{webhooks['a']}/mutate",
            data=json.dumps(review_of(i, gpu_namespace)).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, context=ctx, timeout=10)
        assert refused.value.code == 403
        said = refused.value.read().decode()
        assert ("not one vramshare accepts" if ctx is user else "only from the API server") in said, said
    assert len(reservations(cluster, gpu_namespace)) == before


def test_reviews_from_the_api_servers_seat_book_at_most_the_pending_limit(
    cluster: LocalCluster, webhooks: dict[str, int], gpu_namespace: str
) -> None:
    """Reviews with the API server's certificate whose pods never appear (a pod the API server then
    refuses, or whoever holds that certificate): their bookings have no pod, so they expire with the
    TTL; meanwhile at most `max_pending_per_namespace` (100 here; 1000 by default) stand per
    namespace."""
    ctx = as_the_api_server(cluster)
    allowed = 0
    for i in range(110):
        review = review_of(i, gpu_namespace)
        req = urllib.request.Request(
            f"https://127.0.0.1:{webhooks['a']}/mutate",
            data=json.dumps(review).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            answer = json.loads(resp.read())["response"]
        allowed += answer["allowed"]
        if not answer["allowed"]:
            assert (
                "already has 100 GPU bookings whose pods have not appeared yet" in answer["status"]["message"]
            )
    assert allowed == 100
    assert len(reservations(cluster, gpu_namespace)) == 100


def test_hostile_reservation_annotations_are_answered_at_once_and_decided_afresh(
    cluster: LocalCluster, core: client.CoreV1Api, gpu_namespace: str
) -> None:
    """GPU pods carrying copied placement annotations whose reservation is a path, a query or too long:
    such a value used to be put into an API path (a watch that hung until the 8 s deadline)."""
    hostile = ["../gpureservations?watch=true", "x" * 300, "a/b/../../../api/v1/pods"]
    for i, value in enumerate(hostile):
        pod = gpu_pod(f"copied-{i}", "1000")
        pod.metadata.annotations.update(
            {
                ANNOTATION_RESERVATION: value,
                ANNOTATION_GPU_UUID: "GPU-851864af-bc71-537c-9b9c-423dac264350",
                "vramshare.io/gpu-index": "0",
                ANNOTATION_NODE: "gpu-node-a",
            }
        )
        started = time.monotonic()
        created = core.create_namespaced_pod(gpu_namespace, pod)
        took = time.monotonic() - started
        print(f"\n{value[:30]!r}: answered in {took * 1000:.0f} ms")
        assert took < 1.0
        booked = {r["metadata"]["name"]: r for r in reservations(cluster, gpu_namespace)}
        name = created.metadata.annotations[ANNOTATION_RESERVATION]
        assert name in booked
        assert name != value
        assert booked[name]["spec"]["memoryMiB"] == 1000
    assert len(reservations(cluster, gpu_namespace)) == len(hostile)  # one fresh booking each
