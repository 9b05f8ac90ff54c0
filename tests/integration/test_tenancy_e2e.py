"""Teams sharing one fleet, on the real stack: API server (ResourceQuota, Pod Security), scheduler,
kwok pods, fake exporter, Prometheus, two webhook replicas over TLS behind a Service-like balancer, and
the controller (which advertises each GPU node's memory as capacity).

- Two namespaces with ResourceQuotas on `requests.vramshare.io/gpu-mem-mib` each fill their quota
  exactly under concurrent creates through both replicas, and `kubectl describe quota` shows the use.
- The attacks of issue #29, for 60 s together, beside another namespace's steady workload: a loop of
  creates of a taken name, a loop of pods Pod Security refuses after vramshare admitted them, and a
  stream of large pods that are refused and never retried. The other namespace's admission rate is
  measured without and with them.

Its own control plane, since it fills the fleet."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from vramshare.kube.resources import MEMORY_RESOURCE
from vramshare_e2e.admission_parts import start_endpoints
from vramshare_e2e.cluster import RUN_DURATION_ANNOTATION, LocalCluster
from vramshare_e2e.components import (
    chart_webhook_env,
    metric,
    start_controller,
    start_webhook,
    wait_for_gpu_devices,
    webhook_configuration,
)
from vramshare_e2e.process import eventually
from vramshare_webhook.memory_resource import quantity

pytestmark = pytest.mark.cluster

SHARD = "tenancy"
QUOTAS = {"team-a": 20_000, "team-b": 30_000}
ATTACK_S = 60.0
PENDING_PER_USER = 40_000
ENV = {
    **chart_webhook_env("grant_pods"),  # grants, as the chart turns them on (issue #45)
    "VRAMSHARE_SETTLE_S": "2",
    "VRAMSHARE_SAFETY_MARGIN_MIB": "512",
    "VRAMSHARE_MAX_PENDING_MIB_PER_USER": str(PENDING_PER_USER),
    "VRAMSHARE_MAX_PENDING_MIB_PER_NAMESPACE": "80000",
}
NAMESPACES = (*QUOTAS, "steady", "mallory", "mallory-restricted", "trudy")
NEVER_CREATED_KEPT = 20
CONTROLLER: dict[str, int] = {}
"""The controller's metrics port."""


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with LocalCluster.start() as local:
        ports = [start_webhook(local, name=f"webhook-{i}", env=ENV)[1] for i in range(2)]
        service = start_endpoints(local, backends=ports)
        local.apply_objects([webhook_configuration(local, ports={SHARD: service})])
        for ns in NAMESPACES:
            restricted = (
                {"pod-security.kubernetes.io/enforce": "restricted"} if ns == "mallory-restricted" else {}
            )
            local.create_namespace(ns, {"vramshare-e2e/shard": SHARD, **restricted})
        quotas = [
            {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {"name": "gpu-memory", "namespace": ns},
                "spec": {"hard": {f"requests.{MEMORY_RESOURCE}": str(mib)}},
            }
            for ns, mib in QUOTAS.items()
        ]
        # The attackers are ordinary users who may create pods in their own namespaces.
        bindings = [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": f"{user}-admin", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            }
            for user, ns in (
                *((f"airflow-{ns}", ns) for ns in QUOTAS),
                ("mallory", "mallory"),
                ("mallory", "mallory-restricted"),
                ("trudy", "trudy"),
            )
        ]
        local.apply_objects([*quotas, *bindings])
        CONTROLLER["port"] = start_controller(
            local,
            name="controller",
            env={
                **ENV,
                "VRAMSHARE_POLL_INTERVAL_S": "1",
                "VRAMSHARE_LIFECYCLE_INTERVAL_S": "1",
                "VRAMSHARE_NEVER_CREATED_KEPT_PER_NAMESPACE": str(NEVER_CREATED_KEPT),
            },
        )[1]
        wait_for_gpu_devices(local)
        nodes = {n.name: sum(g.total_mib for g in n.gpus) for n in local.settings.fleet.nodes}
        eventually(
            lambda: advertised(local) == nodes, what="GPU memory advertised on the nodes", timeout_s=60
        )
        yield local


def advertised(stack: LocalCluster) -> dict[str, int]:
    items = json.loads(stack.kubectl("get", "nodes", "-o", "json"))["items"]
    return {
        n["metadata"]["name"]: int(n["status"]["allocatable"][MEMORY_RESOURCE])
        for n in items
        if MEMORY_RESOURCE in (n["status"].get("allocatable") or {})
    }


def api_as(stack: LocalCluster, user: str | None = None) -> client.CoreV1Api:
    api = config.new_client_from_config(config_file=str(stack.kubeconfig))
    if user:
        api.set_default_header("Impersonate-User", user)
    return client.CoreV1Api(api)


def gpu_pod(
    name: str,
    mib: int,
    *,
    run: str | None = None,
    escalating: bool = False,
    labels: dict[str, str] | None = None,
) -> client.V1Pod:
    annotations = {"gpu-mem-mb": str(mib)}
    if run:
        annotations[RUN_DURATION_ANNOTATION] = run
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations, labels=labels),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="base",
                    image="example.invalid/task",
                    security_context=client.V1SecurityContext(allow_privilege_escalation=True)
                    if escalating
                    else None,
                )
            ],
            restart_policy="Never",
        ),
    )


def reservations(stack: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    return json.loads(stack.kubectl("get", "gpureservations", "-n", namespace, "-o", "json"))["items"]  # type: ignore[no-any-return]


def active_mib(items: list[dict[str, Any]]) -> int:
    return sum(
        r["spec"]["memoryMiB"]
        for r in items
        if r["metadata"]["labels"].get("vramshare.io/active") != "false"
        and (r.get("status") or {}).get("phase") not in ("Released", "Expired")
    )


def holds_in(stack: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    """The namespace's holds not ended."""
    return [
        r
        for r in reservations(stack, namespace)
        if "vramshare.io/held-for" in r["metadata"]["labels"]
        and r["metadata"]["labels"].get("vramshare.io/active") != "false"
    ]


def admitted_per_replica(stack: LocalCluster, namespace: str) -> list[int]:
    counts = []
    for i in range(2):
        log = (stack.logs_dir / f"webhook-{i}.log").read_text()
        counts.append(
            sum(
                1
                for line in log.splitlines()
                if '"outcome": "admitted"' in line and f'"pod": "{namespace}/' in line
            )
        )
    return counts


def test_each_namespace_fills_its_quota_and_not_a_mib_more(stack: LocalCluster) -> None:
    # Each team's Airflow creates its pods as its own user.
    clients = {ns: api_as(stack, f"airflow-{ns}") for ns in QUOTAS}
    outcomes: dict[str, list[str]] = {ns: [] for ns in QUOTAS}
    lock = threading.Lock()

    def create(ns: str, i: int) -> None:
        try:
            clients[ns].create_namespaced_pod(ns, gpu_pod(f"fill-{i}", 1000))
            outcome = "created"
        except ApiException as exc:
            outcome = f"{exc.status}: {json.loads(exc.body)['message']}"
        with lock:
            outcomes[ns].append(outcome)

    # 45 creates of 1000 MiB per namespace, all at once: more than either quota allows.
    with ThreadPoolExecutor(max_workers=24) as pool:
        for f in [pool.submit(create, ns, i) for i in range(45) for ns in QUOTAS]:
            f.result()
    for ns, hard in QUOTAS.items():
        created = outcomes[ns].count("created")
        refusals = [o for o in outcomes[ns] if o != "created"]
        print(f"{ns}: {created} created, {len(refusals)} refused, e.g. {refusals[:1]}")
        assert created * 1000 == hard, outcomes[ns]
        assert all(o.startswith("403") and "exceeded quota" in o for o in refusals), refusals
    # Both replicas admitted for the same namespace.
    per_replica = admitted_per_replica(stack, "team-a")
    print(f"team-a admissions per webhook replica: {per_replica}")
    assert all(n > 0 for n in per_replica), per_replica
    # kubectl shows the use as the API server counts it.
    for ns, hard in QUOTAS.items():
        described = stack.kubectl("describe", "quota", "gpu-memory", "-n", ns)
        print(described)
        row = re.search(rf"requests\.{re.escape(MEMORY_RESOURCE)}\s+(\S+)\s+(\S+)", described)
        assert row is not None, described
        assert (quantity(row.group(1)), quantity(row.group(2))) == (hard, hard), described  # e.g. 20k
    # The pods' bookings are what the namespace holds: once bound, exactly the quota.
    for ns, hard in QUOTAS.items():
        eventually(
            lambda ns=ns, hard=hard: active_mib(reservations(stack, ns)) == hard,  # type: ignore[misc]
            what=f"{ns}: the refused pods' bookings ended",
            timeout_s=60,
        )
    for ns in QUOTAS:
        stack.kubectl("delete", "pods", "--all", "-n", ns, "--wait=false")


class Loop:
    """One client creating pods in a loop until stopped, counting outcomes."""

    def __init__(
        self,
        name: str,
        make: Callable[[int], tuple[str, client.V1Pod]],
        *,
        core: client.CoreV1Api,
        pause_s: float,
    ) -> None:
        self.name = name
        self.make = make
        self.core = core
        self.pause_s = pause_s
        self.outcomes: dict[str, int] = {}
        self.messages: dict[str, str] = {}
        """The first message of each status."""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            namespace, pod = self.make(i)
            try:
                self.core.create_namespaced_pod(namespace, pod)
                key = "created"
            except ApiException as exc:
                key = str(exc.status)
                self.messages.setdefault(key, json.loads(exc.body).get("message", ""))
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            self.stop.wait(self.pause_s)

    def admitted_ratio(self) -> float:
        total = sum(self.outcomes.values())
        return self.outcomes.get("created", 0) / total if total else 0.0


def steady(core: client.CoreV1Api, phase: str) -> Loop:
    """Another namespace's workload: a 2000 MiB task every 0.5 s, each running 3 s."""
    return Loop(
        f"steady-{phase}",
        lambda i: ("steady", gpu_pod(f"{phase}-{i}", 2000, run="3s")),
        core=core,
        pause_s=0.5,
    )


def name_refused_as_taken(core: client.CoreV1Api) -> bool:
    try:
        core.create_namespaced_pod("mallory", gpu_pod("squat", 39_000))
    except ApiException as exc:
        return exc.status == 409 and "books nothing for a pod that cannot be created" in str(exc.body)
    return False


def test_attacks_cost_another_namespace_nothing(stack: LocalCluster) -> None:
    core = api_as(stack)
    # Without attackers: the steady namespace's admission rate.
    baseline = steady(core, "baseline")
    baseline.thread.start()
    time.sleep(ATTACK_S)
    baseline.stop.set()
    baseline.thread.join()

    mallory, trudy = api_as(stack, "mallory"), api_as(stack, "trudy")
    mallory.create_namespaced_pod(
        "mallory",
        client.V1Pod(
            metadata=client.V1ObjectMeta(name="squat"),
            spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="example.invalid/x")]),
        ),
    )
    # The webhook learns of the squatted pod from its watch, a moment after the create returns; the
    # attack starts once it answers as it will from then on (a create before that is refused for room or
    # admitted and then refused by the API server, and books nothing either way: asserted below).
    eventually(lambda: name_refused_as_taken(mallory), what="the webhook to see mallory/squat", timeout_s=10)
    attacks = [
        # Re-creating a taken name with a large request.
        Loop("taken-name", lambda i: ("mallory", gpu_pod("squat", 39_000)), core=mallory, pause_s=0.1),
        # Pods Pod Security refuses after vramshare admitted them.
        Loop(
            "pod-security",
            lambda i: ("mallory-restricted", gpu_pod(f"priv-{i}", 12_000, escalating=True)),
            core=mallory,
            pause_s=0.1,
        ),
        # Large tasks refused and never retried (each a new task), hoping for the fleet's hold.
        Loop(
            "never-retried",
            lambda i: (
                "trudy",
                gpu_pod(
                    f"big-{i}", 39_500, run="1s", labels={"dag_id": "d", "task_id": f"t{i}", "run_id": "r"}
                ),
            ),
            core=trudy,
            pause_s=0.1,
        ),
    ]
    attacked = steady(core, "attacked")
    peak = {"mallory": 0, "holds": 0}
    for loop in (*attacks, attacked):
        loop.thread.start()
    started = time.monotonic()
    while time.monotonic() - started < ATTACK_S:
        held = active_mib(reservations(stack, "mallory")) + active_mib(
            reservations(stack, "mallory-restricted")
        )
        holds = len(holds_in(stack, "trudy"))
        peak["mallory"] = max(peak["mallory"], held)
        peak["holds"] = max(peak["holds"], holds)
        time.sleep(0.5)
    for loop in (*attacks, attacked):
        loop.stop.set()
    for loop in (*attacks, attacked):
        loop.thread.join()

    for loop in (baseline, *attacks, attacked):
        print(f"{loop.name}: {loop.outcomes} {loop.messages}")
    creates = sum(attacked.outcomes.values())
    print(
        f"steady namespace admitted {baseline.admitted_ratio():.3f} of its creates without attackers and "
        f"{attacked.admitted_ratio():.3f} with them ({creates} creates in {ATTACK_S:g} s); mallory's "
        f"pods that never appeared held at most {peak['mallory']} MiB at once (bound {PENDING_PER_USER}); "
        f"trudy held at most {peak['holds']} holds"
    )
    taken = attacks[0]
    assert taken.outcomes.get("409", 0) == sum(taken.outcomes.values()) > 100  # every one refused as taken
    assert reservations(stack, "mallory") == []  # and nothing booked for any
    # Pod Security refused them after vramshare booked (until the bound stopped it booking more).
    assert "violates PodSecurity" in attacks[1].messages["403"]
    assert 0 < peak["mallory"] <= PENDING_PER_USER
    assert peak["holds"] == 0  # never retried: no hold
    assert baseline.admitted_ratio() == 1.0, baseline.outcomes
    assert attacked.admitted_ratio() >= baseline.admitted_ratio(), attacked.outcomes


def test_a_loop_of_creates_refused_after_admission_leaves_a_bounded_number_of_records(
    stack: LocalCluster,
) -> None:
    """Issue #42, 7: Pod Security refuses each of a tenant's GPU pods after vramshare admitted it, in a
    loop, half of them queue mode. Each leaves a booking or a queue entry whose pod never appears: both
    count against the namespace's pending bound while they wait, and once expired at most
    `never_created_kept_per_namespace` records stay. The controller's memory is measured meanwhile."""
    mallory = api_as(stack, "mallory")
    port = CONTROLLER["port"]
    rss_before = metric(port, "process_resident_memory_bytes") or 0.0
    refused_after_admission = 0
    started = time.monotonic()
    i = 0
    while time.monotonic() - started < 40:
        i += 1
        pod = gpu_pod(f"loop-{i}", 100, escalating=True)
        if i % 2:
            pod.metadata.annotations["gpu-queue"] = "true"
        try:
            mallory.create_namespaced_pod("mallory-restricted", pod)
        except ApiException as exc:
            refused_after_admission += exc.status == 403 and "violates PodSecurity" in str(exc.body)
    peak = len(reservations(stack, "mallory-restricted"))
    rss_peak = metric(port, "process_resident_memory_bytes") or 0.0

    def settled() -> int | None:
        # Every record expired (TTL 20 s) and trimmed by the 1 s sweeps.
        items = reservations(stack, "mallory-restricted")
        open_ = [r for r in items if (r.get("status") or {}).get("phase") not in ("Expired", "Released")]
        return None if open_ or len(items) > NEVER_CREATED_KEPT else len(items) or -1

    left = eventually(settled, what="the records trimmed to the bound", timeout_s=60)
    trimmed = metric(port, "vramshare_never_created_records_trimmed_total") or 0.0
    rss_after = metric(port, "process_resident_memory_bytes") or 0.0
    print(
        f"\n[perimeter] {i} creates in 40 s, {refused_after_admission} refused by Pod Security after "
        f"admission (each a record: {refused_after_admission} with a retention of 3600 s before); at most "
        f"{peak} records at once, {max(left, 0)} left once expired (bound {NEVER_CREATED_KEPT}), "
        f"{trimmed:.0f} trimmed; controller RSS {rss_before / 2**20:.0f} -> {rss_peak / 2**20:.0f} -> "
        f"{rss_after / 2**20:.0f} MiB"
    )
    assert refused_after_admission > NEVER_CREATED_KEPT * 2
    assert 0 < max(left, 0) <= NEVER_CREATED_KEPT
    assert trimmed >= refused_after_admission - NEVER_CREATED_KEPT - 5  # a few may have been deleted by TTL
