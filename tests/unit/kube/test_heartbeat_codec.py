"""The heartbeat's annotation on the Lease: read back as written, and anything else refused with a
message naming what is wrong (anyone who may edit the Lease may write it)."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.kube.heartbeat import ANNOTATION_HEARTBEAT, decode, encode, lease_heartbeat, parse_lease_ref


@given(
    at=st.floats(min_value=1e9, max_value=4e9),
    version=st.integers(min_value=0, max_value=2**62),
    unconfirmed=st.frozensets(st.text(alphabet="GPU-abcdef0123456789", min_size=1, max_size=40), max_size=5),
)
def test_a_heartbeat_reads_back_as_written(at: float, version: int, unconfirmed: frozenset[str]) -> None:
    heartbeat = InventoryHeartbeat(sampled_at=at, devices_version=version, unconfirmed=unconfirmed)
    back = decode(encode(heartbeat))
    assert back.devices_version == version
    assert back.unconfirmed == unconfirmed
    assert abs(back.sampled_at - at) < 1e-5


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ("nope", "not JSON"),
        ("[]", "JSON object"),
        (json.dumps({"sampledAt": "2026-12-03T10:00:00Z", "devicesVersion": 5}), "devicesVersion"),
        (json.dumps({"sampledAt": "yesterday", "devicesVersion": "5"}), "sampledAt"),
        (
            json.dumps({"sampledAt": "2026-12-03T10:00:00Z", "devicesVersion": "5", "unconfirmed": "x"}),
            "unconfirmed",
        ),
    ],
)
def test_a_bad_heartbeat_is_refused_naming_the_field(raw: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        decode(raw)
    lease = {"metadata": {"name": "l", "namespace": "n", "annotations": {ANNOTATION_HEARTBEAT: raw}}}
    assert lease_heartbeat(lease) is None  # ignored: stored sample times apply


@pytest.mark.slow
@given(st.text(max_size=200))
def test_any_annotation_value_is_read_or_refused_never_crashes(raw: str) -> None:
    with contextlib.suppress(ValueError):
        decode(raw)


def test_the_lease_is_named_namespace_slash_name() -> None:
    assert parse_lease_ref("vramshare/vramshare-controller") == ("vramshare", "vramshare-controller")
    for bad in ("vramshare-controller", "/x", "x/", "a/b/c"):
        with pytest.raises(ValueError, match="<namespace>/<name>"):
            parse_lease_ref(bad)
