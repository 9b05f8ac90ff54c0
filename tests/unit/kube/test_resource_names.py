"""Names in API paths: what can name an object, and path segments that cannot reach another path."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramshare.kube.resources import (
    devices_path,
    events_path,
    is_object_name,
    pod_path,
    pods_path,
    reservations_path,
)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("task-1-abcd", True),
        ("gpu-85101648-73d0-50a1-aa5b-09f27f8371f3", True),
        ("a.b-c", True),
        ("x" * 253, True),
        ("x" * 254, False),
        ("", False),
        ("Upper", False),
        ("-lead", False),
        ("trail-", False),
        ("a/b", False),
        ("..", False),
        ("a?watch=true", False),
        (None, False),
        (7, False),
    ],
)
def test_object_names(value: object, ok: bool) -> None:
    assert is_object_name(value) is ok


@given(st.text(min_size=1, max_size=40))
def test_a_name_is_one_path_segment_whatever_it_holds(name: str) -> None:
    path = reservations_path("jobs", name)
    assert path.startswith("/apis/vramshare.io/v1alpha1/namespaces/jobs/gpureservations/")
    tail = path.removeprefix("/apis/vramshare.io/v1alpha1/namespaces/jobs/gpureservations/")
    assert "/" not in tail
    assert "?" not in tail
    assert "#" not in tail
    assert tail not in (".", "..")
    assert devices_path(name).count("/") == devices_path("x").count("/")


def test_ordinary_names_are_unchanged() -> None:
    assert (
        reservations_path("jobs", "task-1")
        == "/apis/vramshare.io/v1alpha1/namespaces/jobs/gpureservations/task-1"
    )
    assert devices_path("gpu-1") == "/apis/vramshare.io/v1alpha1/gpudevices/gpu-1"


@given(st.text(min_size=1, max_size=40))
def test_a_namespace_is_one_path_segment_in_every_pod_and_event_path(namespace: str) -> None:
    """Issue #42, 9: the namespace of a booking or an event is quoted wherever a path is built."""
    for path, kind in ((pods_path(namespace), "pods"), (events_path(namespace), "events")):
        segment = path.removeprefix("/api/v1/namespaces/").removesuffix(f"/{kind}")
        assert path == f"/api/v1/namespaces/{segment}/{kind}"
        assert not set(segment) & set("/?#")
        assert segment not in (".", "..")
    assert pod_path(namespace, "p").removesuffix("/p") == pods_path(namespace)
    assert pods_path("jobs") == "/api/v1/namespaces/jobs/pods"
