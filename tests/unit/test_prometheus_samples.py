"""Joining Prometheus query results into samples, and the node label mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vramshare.controller.settings import ControllerSettings
from vramshare.prometheus import FREE, RESERVED, USED, DcgmSource, PrometheusAccess, samples_from
from vramshare.settings import SettingsError


def series(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1_800_000_000.0, str(value)]}


def results(**labels: str) -> dict[str, list[dict[str, Any]]]:
    base = {"UUID": "GPU-1", "gpu": "2", "modelName": "Tesla T4", **labels}
    return {
        FREE: [series(15_000, **base)],
        USED: [series(104, **base)],
        RESERVED: [series(256, **base)],
        "timestamp": [series(1_799_999_998.5, **base)],
    }


def test_joins_metrics_into_one_sample() -> None:
    reading = samples_from(results(Hostname="gpu-node-b"), node_label="Hostname")
    (s,) = reading.samples
    assert (s.uuid, s.node, s.index, s.model) == ("GPU-1", "gpu-node-b", 2, "Tesla T4")
    assert (s.free_mib, s.used_mib, s.driver_reserved_mib, s.sampled_at) == (
        15_000,
        104,
        256,
        1_799_999_998.5,
    )
    assert s.to_gpu().total_mib == 15_360


@pytest.mark.parametrize(
    ("label", "labels", "node"),
    [
        ("hostname", {"hostname": "n1"}, "n1"),
        ("node", {"node": "n2", "Hostname": "dcgm-exporter-abc"}, "n2"),
        ("instance", {"instance": "n3:9400"}, "n3"),
    ],
)
def test_node_label_is_configurable(label: str, labels: dict[str, str], node: str) -> None:
    (s,) = samples_from(results(**labels), node_label=label).samples
    assert s.node == node


def test_series_without_the_node_label_are_skipped_with_a_reason() -> None:
    reading = samples_from(results(Hostname="x"), node_label="node")
    assert reading.samples == []
    assert reading.skipped == ["GPU-1: no 'node' label to map it to a node"]


def test_missing_fb_reserved_is_none() -> None:
    r = results(Hostname="n")
    del r[RESERVED]
    (s,) = samples_from(r, node_label="Hostname").samples
    assert s.driver_reserved_mib is None


def test_prometheus_access_is_configured_from_the_settings(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("pw\n")
    token = tmp_path / "token"
    token.write_text("t1\n")
    settings = ControllerSettings(
        prometheus_url="https://thanos.example",
        prometheus_ca_file="/etc/ca.crt",
        prometheus_bearer_token_file=str(token),
        prometheus_basic_auth_username="vramshare",
        prometheus_basic_auth_password_file=str(password),
        prometheus_headers='{"X-Scope-OrgID": "ml"}',
        identity="x",
    ).validate()
    source = DcgmSource(url=settings.prometheus_url, node_label="Hostname", access=settings.prometheus_access)
    client = source._client
    assert client._session.verify == "/etc/ca.crt"
    assert client.auth == ("vramshare", "pw")
    assert client.headers == {"X-Scope-OrgID": "ml"}
    source._refresh_token()
    assert client.headers["Authorization"] == "Bearer t1"
    token.write_text("t2\n")  # rotated: the next reading sends the new one
    source._refresh_token()
    assert client.headers["Authorization"] == "Bearer t2"
    insecure = DcgmSource(
        url="https://x", node_label="Hostname", access=PrometheusAccess(insecure_skip_verify=True)
    )
    assert insecure._client._session.verify is False
    assert DcgmSource(url="https://x", node_label="Hostname")._client._session.verify is True


@pytest.mark.parametrize("headers", ["not json", '["X"]', '{"X": 1}'])
def test_bad_prometheus_headers_are_refused_by_name(headers: str) -> None:
    with pytest.raises(SettingsError, match=r"VRAMSHARE_PROMETHEUS_HEADERS=.* a JSON object of strings"):
        ControllerSettings(prometheus_headers=headers, identity="x").validate()
