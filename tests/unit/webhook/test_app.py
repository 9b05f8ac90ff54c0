"""The HTTP surface: guards answer 400, decisions are well-formed reviews, probes and metrics, one log line
per decision. Served for real by aiohttp's test server, with the in-memory ledger behind it."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from tests.unit.webhook.fakes import MemoryLedger, admitter
from vramshare_webhook import review as rv
from vramshare_webhook.app import create_app, create_metrics_app
from vramshare_webhook.callers import caller_problem


def review_body(uid: str = "u1", mib: str = "4096") -> bytes:
    pod = {
        "metadata": {"name": "task", "annotations": {"gpu-mem-mb": mib}},
        "spec": {"containers": [{"name": "base"}]},
    }
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "operation": "CREATE",
                "kind": {"kind": "Pod"},
                "namespace": "airflow",
                "object": pod,
            },
        }
    ).encode()


async def test_guards_answer_400_and_the_server_keeps_serving() -> None:
    ready = {"value": False}
    app = create_app(admitter=admitter(MemoryLedger()), ready=lambda: ready["value"])
    async with TestClient(TestServer(app)) as http:
        json_type = {"Content-Type": "application/json"}
        for body, headers in [
            (b"", json_type),
            (b"{not json", json_type),
            (review_body(), {"Content-Type": "text/plain"}),
            (b"x" * (8 * 1024 * 1024), json_type),
        ]:
            resp = await http.post("/mutate", data=body, headers=headers)
            assert resp.status == 400
            assert "error" in await resp.json()
        resp = await http.post("/mutate", data=review_body(), headers=json_type)
        assert resp.status == 200
        answer = await resp.json()
        assert answer["response"]["uid"] == "u1"
        assert answer["response"]["allowed"] is True
        assert (await http.get("/healthz")).status == 200
        assert (await http.get("/readyz")).status == 503
        ready["value"] = True
        assert (await http.get("/readyz")).status == 200
        metrics = await (await http.get("/metrics")).text()
        assert 'vramshare_webhook_decisions_total{outcome="admitted",reason="fits"} 1.0' in metrics
        assert 'vramshare_webhook_decisions_total{outcome="bad-request",reason="undecodable"} 4.0' in metrics
        assert "vramshare_webhook_decision_seconds_bucket" in metrics


@pytest.mark.slow
async def test_internal_failure_still_answers_a_review_with_the_uid() -> None:
    app = create_app(admitter=admitter(MemoryLedger(fail=ConnectionError("no route"))), ready=lambda: True)
    async with TestClient(TestServer(app)) as http:
        resp = await http.post(
            "/mutate", data=review_body(uid="u42"), headers={"Content-Type": "application/json"}
        )
        assert resp.status == 200
        answer = await resp.json()
    assert answer["response"] == {
        "uid": "u42",
        "allowed": False,
        "status": {"code": 500, "message": "vramshare could not decide: no route", "reason": "InternalError"},
    }


async def test_one_log_line_per_decision_with_its_facts() -> None:
    with capture_logs() as logs:
        await admitter(MemoryLedger()).review(
            rv.decode(review_body(uid="u5"), content_type="application/json")
        )
    decisions = [e for e in logs if e["event"] == "decision"]
    assert len(decisions) == 1
    line = decisions[0]
    assert (line["uid"], line["pod"], line["mib"], line["outcome"], line["reason"]) == (
        "u5",
        "airflow/task",
        4096,
        "admitted",
        "fits",
    )
    assert line["gpu"] == "GPU-a"
    assert line["duration_ms"] >= 0


async def test_deeply_nested_bodies_are_a_400_not_a_500() -> None:
    deep_object = json.loads(review_body())
    nested: dict[str, object] = {}
    deep_object["request"]["object"]["spec"]["extra"] = nested
    for _ in range(150):
        nested["x"] = {}
        nested = nested["x"]  # type: ignore[assignment]
    app = create_app(admitter=admitter(MemoryLedger()), ready=lambda: True)
    async with TestClient(TestServer(app)) as http:
        for body in (b"[" * 1001, b"[" * 100_000, json.dumps(deep_object).encode()):
            resp = await http.post("/mutate", data=body, headers={"Content-Type": "application/json"})
            assert resp.status == 400
            assert (await resp.json())["error"] == "body nests more than 100 levels deep"
        resp = await http.post("/mutate", data=review_body(), headers={"Content-Type": "application/json"})
        assert resp.status == 200


async def test_while_draining_it_is_not_ready_and_closes_each_connection_after_its_answer() -> None:
    draining = {"value": False}
    app = create_app(
        admitter=admitter(MemoryLedger()), ready=lambda: True, draining=lambda: draining["value"]
    )
    async with TestClient(TestServer(app)) as http:
        json_type = {"Content-Type": "application/json"}
        resp = await http.post("/mutate", data=review_body(), headers=json_type)
        assert resp.headers.get("Connection", "").lower() != "close"
        assert (await http.get("/readyz")).status == 200
        draining["value"] = True
        assert (await http.get("/readyz")).status == 503
        resp = await http.post("/mutate", data=review_body(uid="u2"), headers=json_type)
        assert resp.status == 200  # still answering while the endpoints catch up
        assert (await resp.json())["response"]["uid"] == "u2"
        assert resp.headers["Connection"].lower() == "close"


async def test_with_client_authentication_a_caller_without_a_certificate_gets_403_and_books_nothing() -> None:
    """Issue #42, 2: a decision has side effects, so /mutate answers only the API server's certificate;
    the probes and the metrics stay open (the kubelet and Prometheus present none)."""
    ledger = MemoryLedger()
    app = create_app(admitter=admitter(ledger), ready=lambda: True, callers=frozenset({"kube-apiserver"}))
    async with TestClient(TestServer(app)) as http:
        resp = await http.post("/mutate", data=review_body(), headers={"Content-Type": "application/json"})
        assert resp.status == 403
        assert "only from the API server" in (await resp.json())["error"]
        assert ledger.objects == []
        for probe in ("/healthz", "/readyz", "/metrics"):
            assert (await http.get(probe)).status == 200
        metrics = await (await http.get("/metrics")).text()
        assert (
            'vramshare_webhook_decisions_total{outcome="forbidden",reason="unauthenticated-caller"} 1.0'
            in metrics
        )


def test_a_caller_is_known_by_a_verified_certificate_with_an_accepted_name() -> None:
    def cert(cn: str, *dns: str) -> dict[str, object]:
        return {"subject": ((("commonName", cn),),), "subjectAltName": tuple(("DNS", d) for d in dns)}

    assert caller_problem(cert("kube-apiserver"), accepted={"kube-apiserver"}) is None
    assert caller_problem(cert("x", "kube-apiserver"), accepted={"kube-apiserver"}) is None
    assert caller_problem(cert("mallory"), accepted=()) is None  # any the CA signed
    assert "not one vramshare accepts" in str(caller_problem(cert("mallory"), accepted={"kube-apiserver"}))
    for nothing in (None, {}):
        assert "only from the API server" in str(caller_problem(nothing, accepted=()))


async def test_the_metrics_port_serves_metrics_and_nothing_that_books() -> None:
    """Issue #42, 2: with metrics on a port of their own, what may reach that port (Prometheus, under
    the chart's NetworkPolicy) cannot post a review."""
    shared = admitter(MemoryLedger())
    async with TestClient(TestServer(create_app(admitter=shared, ready=lambda: True))) as main:
        await main.post("/mutate", data=review_body(), headers={"Content-Type": "application/json"})
    async with TestClient(TestServer(create_metrics_app(admitter=shared))) as http:
        metrics = await (await http.get("/metrics")).text()
        assert 'vramshare_webhook_decisions_total{outcome="admitted",reason="fits"} 1.0' in metrics
        assert (await http.post("/mutate", data=review_body())).status in (404, 405)
        assert (await http.get("/readyz")).status == 404
