"""AdmissionReview decoding guards and answers."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import hostile_reviews
from vramshare_webhook import review as rv


def body(**request: object) -> bytes:
    base = {"uid": "u1", "operation": "CREATE", "kind": {"kind": "Pod"}, "namespace": "ns", "object": {}}
    return json.dumps(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {**base, **request}}
    ).encode()


def test_decodes_a_review() -> None:
    req = rv.decode(
        body(dryRun=True, userInfo={"username": "alice"}), content_type="application/json; charset=utf-8"
    )
    assert (req.uid, req.operation, req.kind, req.namespace, req.dry_run, req.username) == (
        "u1",
        "CREATE",
        "Pod",
        "ns",
        True,
        "alice",
    )


@pytest.mark.parametrize(
    ("payload", "content_type", "problem"),
    [
        (b"", "application/json", "empty body"),
        (b"{}", "text/plain", "content type must be application/json"),
        (b"{nope", "application/json", "not valid JSON"),
        (b"[]", "application/json", "not an AdmissionReview"),
        (
            b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1beta1","request":{}}',
            "application/json",
            "apiVersion must be admission.k8s.io/v1",
        ),
        (
            b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1"}',
            "application/json",
            "has no request",
        ),
        (body(uid=""), "application/json", "has no uid"),
        (body(operation="PATCH"), "application/json", "unknown operation"),
        (b"x" * (rv.MAX_BODY_BYTES + 1), "application/json", "exceeds"),
    ],
)
def test_guards(payload: bytes, content_type: str, problem: str) -> None:
    with pytest.raises(rv.BadRequestError, match=problem):
        rv.decode(payload, content_type=content_type)


def test_answers_echo_the_uid_and_encode_the_patch() -> None:
    review = rv.patched("u1", [{"op": "add", "path": "/x", "value": 1}])
    assert review["response"]["uid"] == "u1"
    assert review["response"]["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(review["response"]["patch"])) == [
        {"op": "add", "path": "/x", "value": 1}
    ]
    denial = rv.denied("u2", "no", code=429, reason="TooManyRequests", retry_after_s=30)
    assert denial["response"] == {
        "uid": "u2",
        "allowed": False,
        "status": {
            "code": 429,
            "message": "no",
            "reason": "TooManyRequests",
            "details": {"retryAfterSeconds": 30},
        },
    }
    assert rv.errored("u3", "boom")["response"]["status"]["code"] == 500


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@pytest.mark.slow
@given(value=hostile_reviews.json_values)
def test_nesting_depth_counts_arrays_and_objects_not_brackets_in_strings(value: object) -> None:
    assert rv.nesting_depth(json.dumps(value).encode()) == _depth(value)
    assert rv.nesting_depth(json.dumps({"s": '[[{\\"', "v": value}).encode()) == 1 + _depth(value)


@pytest.mark.slow
@given(value=hostile_reviews.json_values, limit=st.integers(min_value=0, max_value=12))
def test_nests_deeper_than_agrees_with_the_depth(value: object, limit: int) -> None:
    body = json.dumps({"s": "[{" * limit, "v": value}).encode()
    assert rv.nests_deeper_than(body, limit) == (rv.nesting_depth(body) > limit)
