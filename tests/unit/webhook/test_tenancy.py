"""Tenancy at admission, against the in-memory ledger: the namespace's GPU-memory quota, the bounds on
pending memory per namespace and per user, the memory resource on admitted pods, and holds as a
tenant's (retrying tasks only, per namespace, exact under concurrent refusals)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from decimal import Decimal
from typing import Any

from tests.unit.domain.builders import gpu
from tests.unit.webhook import fakes
from tests.unit.webhook.fakes import MemoryLedger, airflow, patch_of, request
from vramshare.domain import ReservationPhase
from vramshare.kube.objects import GpuReservation
from vramshare_webhook import review as rv
from vramshare_webhook.admission import Admitter, ClusterView
from vramshare_webhook.memory_resource import memory_resource_patch, quantity, quotas_in

RESOURCE = "vramshare.io/gpu-mem-mib"
NOW = 1_800_000_000.0


def quota(hard: str, *, name: str = "gpu", namespace: str = "airflow", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"hard": {f"requests.{RESOURCE}": hard, "pods": "10"}, **spec},
    }


def admitter(ledger: MemoryLedger, *, quotas: list[dict[str, Any]] = (), **settings: Any) -> Admitter:  # type: ignore[assignment]
    return fakes.admitter(
        ledger,
        cluster=ClusterView(
            resource_quotas=lambda namespace: [q for q in quotas if q["metadata"]["namespace"] == namespace]
        ),
        **settings,
    )


def in_namespace(req: rv.Request, namespace: str, *, user: str = "airflow") -> rv.Request:
    return replace(req, namespace=namespace, username=user)


def bound(ledger: MemoryLedger) -> None:
    """Every booking's pod appeared: the controller bound them."""
    ledger.objects = [
        replace(o, status=replace(o.status, phase=ReservationPhase.BOUND)) if not o.held_for else o
        for o in ledger.objects
    ]


def resource_of(review: rv.Review) -> dict[str, Any]:
    ops = [op for op in patch_of(review) if op["path"] == "/spec/containers/0/resources"]
    assert len(ops) == 1, patch_of(review)
    return ops[0]["value"]  # type: ignore[no-any-return]


# -- the memory resource on admitted pods ----------------------------------------------------------


async def test_an_admitted_pod_requests_its_memory_as_the_resource_in_its_first_container() -> None:
    review = await admitter(MemoryLedger()).review(request("4096"))
    assert review["response"]["allowed"]
    assert resource_of(review) == {"requests": {RESOURCE: "4096"}, "limits": {RESOURCE: "4096"}}


async def test_a_pod_with_two_gpus_requests_both_gpus_memory() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384), gpu("GPU-b", index=1, total=16_384))
    review = await admitter(ledger).review(request("4096", annotations={"gpu-count": "2"}))
    assert review["response"]["allowed"]
    assert resource_of(review)["requests"] == {RESOURCE: "8192"}


def test_a_users_own_value_is_replaced_and_other_containers_lose_theirs() -> None:
    pod = {
        "spec": {
            "initContainers": [{"name": "init", "resources": {"limits": {RESOURCE: "1"}}}],
            "containers": [
                {"name": "base", "resources": {"requests": {"cpu": "1", RESOURCE: "1"}}},
                {
                    "name": "side",
                    "resources": {"requests": {RESOURCE: "99999"}, "limits": {RESOURCE: "99999"}},
                },
            ],
        }
    }
    ops = {op["path"]: op["value"] for op in memory_resource_patch(pod, resource=RESOURCE, mib=4096)}
    assert ops == {
        "/spec/initContainers/0/resources": {"limits": {}},
        "/spec/containers/0/resources": {
            "requests": {"cpu": "1", RESOURCE: "4096"},
            "limits": {RESOURCE: "4096"},
        },
        "/spec/containers/1/resources": {"requests": {}, "limits": {}},
    }


async def test_a_pod_without_the_annotation_may_not_request_the_resource() -> None:
    req = request(None)
    req.object["spec"]["containers"][0]["resources"] = {"limits": {RESOURCE: "80000"}}
    review = await admitter(MemoryLedger()).review(req)
    status = review["response"]["status"]
    assert status["code"] == 400
    assert f"containers[0] request resource {RESOURCE}: only vramshare sets it" in status["message"]
    assert '"gpu-mem-mb"' in status["message"]


async def test_no_resource_when_turned_off() -> None:
    review = await admitter(MemoryLedger(), memory_resource="").review(request("4096"))
    assert review["response"]["allowed"]
    assert not [op for op in patch_of(review) if op["path"].endswith("/resources")]


# -- the namespace's quota -------------------------------------------------------------------------


async def test_a_namespace_fills_its_quota_and_not_a_mib_more() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=40_000), gpu("GPU-b", index=1, total=40_000))
    webhook = admitter(ledger, quotas=[quota("10k")])
    for uid in ("u1", "u2"):
        assert (await webhook.review(request("4000", uid=uid)))["response"]["allowed"]
    bound(ledger)
    assert (await webhook.review(request("2000", uid="u3")))["response"]["allowed"]  # exactly 10000
    over = await webhook.review(request("1", uid="u4"))
    status = over["response"]["status"]
    assert status["code"] == 403
    assert status["message"].startswith(
        'GPU memory exceeded quota: ResourceQuota "gpu" of namespace airflow allows '
        f"requests.{RESOURCE}=10000 (MiB); the namespace holds 10000 MiB (bound 8000, pending 2000, "
        "held 0, queued 0), and this pod asks 1 MiB."
    )
    assert len(ledger.objects) == 3  # nothing booked for the refused one
    # Another namespace has room on the same GPUs.
    other = await webhook.review(in_namespace(request("8000", uid="u5"), "research"))
    assert other["response"]["allowed"]


async def test_a_queued_pod_counts_against_the_quota_as_kubernetes_counts_gated_pods() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=8_192),)
    webhook = admitter(ledger, quotas=[quota("16384")], queue_by_default=True)
    assert (await webhook.review(request("8192")))["response"]["allowed"]
    queued = await webhook.review(request("8192", uid="u2"))
    assert queued["response"]["allowed"]  # waits behind the gate, and asks for its memory already
    assert resource_of(queued)["requests"] == {RESOURCE: "8192"}
    over = await webhook.review(request("1024", uid="u3"))
    assert "exceeded quota" in over["response"]["status"]["message"]
    assert "queued 8192" in over["response"]["status"]["message"]


async def test_the_smallest_quota_binds_and_scoped_quotas_are_left_to_the_api_server() -> None:
    quotas = [
        quota("20000", name="big"),
        quota("5000", name="small"),
        quota("1", name="scoped", scopes=["Terminating"]),
    ]
    webhook = admitter(MemoryLedger(), quotas=quotas)
    assert (await webhook.review(request("5000")))["response"]["allowed"]
    over = await webhook.review(request("1", uid="u2"))
    assert 'ResourceQuota "small"' in over["response"]["status"]["message"]


async def test_a_tasks_own_hold_is_credited_against_its_quota() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=10_000),)
    webhook = admitter(ledger, quotas=[quota("12000")])
    for uid in ("u1", "u2"):  # refused twice: seen retrying, it gets a hold of 12000 (its quota)
        await webhook.review(request("12000", uid=uid, labels=airflow("big")))
    (hold,) = ledger.objects
    assert hold.phase is ReservationPhase.HELD
    ledger.gpus = (gpu("GPU-a", total=16_384, used=0),)
    retry = await webhook.review(request("12000", uid="u3", labels=airflow("big", 2)))
    assert retry["response"]["allowed"]  # the hold is its own: not counted twice


def test_quotas_are_read_in_kubernetes_quantities() -> None:
    assert [quantity(v) for v in ("40000", "40k", "1e3", "2Ki", "1.5k", 7, "x", "")] == [
        Decimal(40000),
        Decimal(40000),
        Decimal(1000),
        Decimal(2048),
        Decimal(1500),
        Decimal(7),
        None,
        None,
    ]
    (read,) = quotas_in(
        [{**quota("40k"), "status": {"used": {f"requests.{RESOURCE}": "12k"}}}, quota("bad")],
        resource=RESOURCE,
    )
    assert (read.name, read.hard_mib, read.used_mib) == ("gpu", 40_000, 12_000)


# -- pending memory, per namespace and per user ----------------------------------------------------


async def test_pending_memory_is_bounded_per_namespace() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=40_000),)
    webhook = admitter(ledger, max_pending_mib_per_namespace=10_000, max_pending_mib_per_user=0)
    for i in range(2):
        assert (await webhook.review(request("5000", uid=f"u{i}")))["response"]["allowed"]
    over = await webhook.review(request("1", uid="u3"))
    status = over["response"]["status"]
    assert status["code"] == 403
    assert status["message"].startswith(
        "namespace airflow already has 10000 MiB of GPU bookings whose pods have not appeared yet; with "
        "this pod's 1 MiB that is over the bound of 10000 MiB "
        "(webhook.settings.max_pending_mib_per_namespace)"
    )
    bound(ledger)  # their pods appeared
    assert (await webhook.review(request("5000", uid="u4")))["response"]["allowed"]


async def test_pending_memory_is_bounded_per_user_across_namespaces() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=40_000),)
    webhook = admitter(ledger, max_pending_mib_per_user=8_000)
    assert (await webhook.review(in_namespace(request("6000"), "a", user="mallory")))["response"]["allowed"]
    over = await webhook.review(in_namespace(request("6000", uid="u2"), "b", user="mallory"))
    assert "user mallory already has 6000 MiB" in over["response"]["status"]["message"]
    other = await webhook.review(in_namespace(request("6000", uid="u3"), "b", user="airflow"))
    assert other["response"]["allowed"]


async def test_a_service_accounts_pending_bound_is_kept_per_namespace() -> None:
    """Issue #42, 6: Kubernetes' own controllers create every team's Deployment and Job pods under one
    ServiceAccount; one team's pods that have not appeared must not refuse another team's."""
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=40_000),)
    webhook = admitter(ledger, max_pending_mib_per_user=8_000, max_pending_mib_per_namespace=0)
    controller = "system:serviceaccount:kube-system:replicaset-controller"
    first = await webhook.review(in_namespace(request("6000"), "team-a", user=controller))
    assert first["response"]["allowed"]
    over = await webhook.review(in_namespace(request("6000", uid="u2"), "team-a", user=controller))
    assert (
        f"user {controller} in namespace team-a already has 6000 MiB" in over["response"]["status"]["message"]
    )
    other_team = await webhook.review(in_namespace(request("6000", uid="u3"), "team-b", user=controller))
    assert other_team["response"]["allowed"]


async def test_one_pod_larger_than_the_bound_is_let_through_when_nothing_is_pending() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=40_000),)
    webhook = admitter(ledger, max_pending_mib_per_namespace=10_000, max_pending_mib_per_user=10_000)
    assert (await webhook.review(request("30000")))["response"]["allowed"]
    over = await webhook.review(request("1000", uid="u2"))
    assert over["response"]["status"]["code"] == 403


# -- holds as a tenant's ---------------------------------------------------------------------------


async def refused_twice(
    webhook: Admitter, task: str, *, namespace: str = "airflow", mib: str = "12000"
) -> None:
    for attempt in ("a", "b"):
        review = await webhook.review(
            in_namespace(request(mib, uid=f"{task}-{attempt}", labels=airflow(task)), namespace)
        )
        assert review["response"]["status"]["code"] == 403


def holds(ledger: MemoryLedger) -> list[GpuReservation]:
    return [o for o in ledger.objects if o.held_for]


async def test_a_namespace_has_at_most_its_share_of_holds() -> None:
    ledger = MemoryLedger()
    ledger.gpus = tuple(gpu(f"GPU-{i}", index=i, total=16_384, used=10_000) for i in range(3))
    webhook = admitter(ledger, max_holds=3, max_holds_per_namespace=1)
    await refused_twice(webhook, "one")
    await refused_twice(webhook, "two")  # the same namespace: its one hold is taken
    await refused_twice(webhook, "three", namespace="research")
    assert sorted((h.namespace, h.spec.pod_name) for h in holds(ledger)) == [
        ("airflow", "train.one.manual-1"),
        ("research", "train.three.manual-1"),
    ]


async def test_no_hold_that_would_take_the_namespace_over_its_quota() -> None:
    ledger = MemoryLedger()
    ledger.gpus = (gpu("GPU-a", total=16_384, used=10_000), gpu("GPU-b", index=1, total=16_384))
    webhook = admitter(ledger, quotas=[quota("15000")])
    assert (await webhook.review(request("4000", uid="small")))["response"]["allowed"]
    bound(ledger)
    ledger.gpus = (gpu("GPU-a", total=16_384, used=10_000), gpu("GPU-b", index=1, total=16_384, used=10_000))
    await refused_twice(webhook, "big", mib="11000")  # 4000 + 11000 fits the quota: a hold
    assert len(holds(ledger)) == 1
    ledger.objects = [o for o in ledger.objects if not o.held_for]
    assert (await webhook.review(request("1000", uid="small-2")))["response"]["allowed"]
    bound(ledger)
    await refused_twice(webhook, "big2", mib="11000")  # 5000 + 11000 would not
    assert holds(ledger) == []


async def test_concurrent_refusals_never_leave_more_holds_than_allowed() -> None:
    class Interleaving(MemoryLedger):
        async def commit(
            self, *, reservation: GpuReservation, token: str, live: bool = False
        ) -> GpuReservation:
            # Every refusal decides on a view without the others' holds (replicas racing), and every
            # hold is made before any refusal counts again.
            await asyncio.sleep(0.01)
            created = await super().commit(reservation=reservation, token=token, live=live)
            await asyncio.sleep(0.01)
            return created

    ledger = Interleaving()
    ledger.gpus = tuple(gpu(f"GPU-{i}", index=i, total=16_384, used=10_000) for i in range(4))
    webhook = admitter(ledger, max_holds=1, max_holds_per_namespace=4)
    tasks = [f"t{i}" for i in range(4)]
    for t in tasks:  # each seen once already
        await webhook.review(request("12000", uid=f"{t}-a", labels=airflow(t)))
    assert holds(ledger) == []
    await asyncio.gather(*(webhook.review(request("12000", uid=f"{t}-b", labels=airflow(t))) for t in tasks))
    assert len(holds(ledger)) <= 1
    assert ledger.withdrawn  # the check after the commit took back the ones too many


# -- pods another admission system holds (Kueue) ----------------------------------------------------


def kueue_pod(**annotations: str) -> rv.Request:
    req = request("4096", annotations=annotations)
    req.object["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    return req


async def test_a_pod_kueue_holds_books_nothing_and_waits_behind_vramshares_gate_too() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger).review(kueue_pod())
    assert review["response"]["allowed"]
    (entry,) = ledger.objects
    assert entry.phase is ReservationPhase.QUEUED  # an entry without a GPU: nothing booked
    assert not entry.spec.gpu_uuid
    gates = next(op["value"] for op in patch_of(review) if op["path"] == "/spec/schedulingGates")
    assert gates == [{"name": "kueue.x-k8s.io/admission"}, {"name": "vramshare.io/gpu-memory"}]
    (warning,) = review["response"]["warnings"]
    assert "is held by scheduling gate kueue.x-k8s.io/admission" in warning
    assert resource_of(review)["requests"] == {RESOURCE: "4096"}  # Kueue's quota counts it


async def test_kueues_label_alone_is_enough_since_its_webhook_may_gate_the_pod_after_vramshare() -> None:
    ledger = MemoryLedger()
    review = await admitter(ledger).review(request("4096", labels={"kueue.x-k8s.io/queue-name": "gpu"}))
    assert "label kueue.x-k8s.io/queue-name" in review["response"]["warnings"][0]
    assert [o.phase for o in ledger.objects] == [ReservationPhase.QUEUED]


async def test_without_the_setting_or_with_several_gpus_a_held_pod_is_booked_at_admission() -> None:
    ledger = MemoryLedger()
    await admitter(ledger, wait_for_other_gates=False).review(kueue_pod())
    ledger.gpus = (gpu("GPU-a", total=16_384), gpu("GPU-b", index=1, total=16_384))
    await admitter(ledger).review(kueue_pod(**{"gpu-count": "2"}))
    assert [o.phase for o in ledger.objects] == [ReservationPhase.RESERVED] * 3
