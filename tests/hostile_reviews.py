"""Hostile AdmissionReviews for fuzzing the webhook: well-formed reviews with wrong values, wrong types
at any depth, deep nesting and huge arrays. Shared by the in-process fuzzer (unit tests, 10000 cases)
and the one that drives a real webhook replica over TLS (reliability tests).

Strategies only, no I/O: `reviews` draws a body (mostly a review that reaches the decision, sometimes
anything JSON), `check_answer` states what every answer must be: a review echoing the UID, or a 400
with an error, never a 500.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from hypothesis import strategies as st

NAMESPACE = "load-r1"
"""The namespace most fuzzed pods claim: one the reliability stack has."""
DEPTHS = (99, 100, 101, 150, 1_001, 5_000)
"""Around the webhook's limit of 100 levels, and far past Python's recursion limit."""

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def mostly(valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Nine in ten draws from `valid`, so most cases reach the decision, not just the guards."""
    return st.sampled_from([True] * 9 + [False]).flatmap(lambda ok: valid if ok else invalid)


annotation_values = st.sampled_from(
    ["4096", "", "0", "-1", "1.5", "1e3", "abc", "9" * 30, " 12 ", "\u0664"]
) | st.text(max_size=12)
env_entries = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "X"]),
            "value": st.text(max_size=8),
        }
    ),
    max_size=3,
)
containers = st.lists(
    st.fixed_dictionaries(
        {"name": st.text(min_size=1, max_size=8), "env": mostly(env_entries, json_values)},
        optional={"resources": json_values},
    ),
    max_size=3,
)
pods = (
    st.fixed_dictionaries(
        {
            "metadata": st.fixed_dictionaries(
                {},
                optional={
                    "name": st.text(max_size=20),
                    "generateName": st.text(max_size=20),
                    "annotations": mostly(
                        st.dictionaries(
                            st.sampled_from(
                                ["gpu-mem-mb", "vramshare.io/gpu-uuid", "vramshare.io/x", "other"]
                            ),
                            annotation_values,
                            max_size=3,
                        ),
                        json_values,
                    ),
                    "labels": mostly(
                        st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2), json_values
                    ),
                },
            ),
            "spec": st.fixed_dictionaries(
                {},
                optional={
                    "containers": mostly(containers, json_values),
                    "initContainers": containers,
                    "nodeName": st.text(max_size=10),
                    "nodeSelector": mostly(
                        st.dictionaries(
                            st.sampled_from(["kubernetes.io/hostname", "zone"]),
                            st.text(max_size=8),
                            max_size=2,
                        ),
                        json_values,
                    ),
                    "affinity": json_values,
                },
            ),
        }
    )
    | json_values
)
requests_ = st.fixed_dictionaries(
    {
        "uid": mostly(st.uuids().map(str), st.text(max_size=5) | json_values),
        "operation": st.sampled_from(["CREATE"] * 6 + ["UPDATE", "DELETE", "CONNECT", "PATCH"]),
        "kind": mostly(st.just({"kind": "Pod"}), st.just({"kind": "Service"}) | json_values),
        "namespace": st.sampled_from([NAMESPACE, "", "other"]),
        "object": mostly(pods, json_values),
        "dryRun": st.sampled_from([True] * 9 + [False]),
    },
    optional={"oldObject": json_values, "userInfo": json_values},
)
well_formed = mostly(
    st.fixed_dictionaries(
        {
            "apiVersion": st.sampled_from(["admission.k8s.io/v1"] * 18 + ["admission.k8s.io/v1beta1", "x"]),
            "kind": st.sampled_from(["AdmissionReview"] * 18 + ["Other"]),
            "request": mostly(requests_, json_values),
        }
    ),
    json_values,
)


_DEEP = "\x00deep:"
_HUGE = "\x00huge:"


def encode(body: Any) -> bytes:
    """The body as JSON, with each deep or huge placeholder written out in place. They are spelled
    as text only here: Python's own encoder (and hypothesis's printer) give up on such values."""
    text = json.dumps(body)
    for kind, opener, closer in ((_DEEP + "list:", "[", "]"), (_DEEP + "object:", '{"x":', "}")):
        for depth in DEPTHS:
            text = text.replace(json.dumps(f"{kind}{depth}"), opener * depth + "0" + closer * depth)
    for size in HUGE_SIZES:
        text = text.replace(json.dumps(f"{_HUGE}{size}"), "[" + ",".join(["{}"] * size) + "]")
    return text.encode()


HUGE_SIZES = (1_000, 20_000, 100_000)
_nested = st.sampled_from([f"{_DEEP}{kind}:{depth}" for kind in ("list", "object") for depth in DEPTHS])
huge_arrays = st.sampled_from([f"{_HUGE}{size}" for size in HUGE_SIZES])
hostile_values = st.sampled_from(range(20)).flatmap(
    lambda n: huge_arrays if n == 0 else _nested if n < 5 else json_values
)
"""Mostly a JSON value of any type; one in five nested deep; one in twenty a huge array (they cost the
most time, in the fuzzer as in the webhook)."""


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def _corrupted(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> Any:
    """A draw from `valid` with one place anywhere inside it replaced by a hostile value of any type."""
    body = copy.deepcopy(draw(valid))  # drawn values may be shared (st.just): never change them
    paths = _paths(body)
    path = draw(st.sampled_from(paths[1:] or paths))  # the root only when there is nothing inside
    replacement = draw(hostile_values)
    if not path:
        return replacement
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = replacement
    return body


reviews = st.sampled_from([True, False]).flatmap(
    lambda plain: well_formed if plain else _corrupted(well_formed)
)
content_types = st.sampled_from(["application/json"] * 19 + ["text/plain"])


def check_answer(body: Any, status: int, payload: bytes) -> None:
    """An answer is an AdmissionReview echoing the request's UID (never carrying a 500), or a 400."""
    assert status in (200, 400), (status, payload[:300])
    answer = json.loads(payload)
    if status == 400:
        assert answer["error"]
        return
    assert answer["response"].get("status", {}).get("code") != 500, answer
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    assert isinstance(answer["response"]["allowed"], bool)
    assert answer["response"]["uid"] == body["request"]["uid"]
    if "patch" in answer["response"]:
        assert isinstance(json.loads(base64.b64decode(answer["response"]["patch"])), list)
