"""How the controller reaches Prometheus (TLS, auth, headers) and the settings that configure it.
Reading the series themselves: test_dcgm_series.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramshare.controller.settings import ControllerSettings
from vramshare.prometheus import DcgmSource, PrometheusAccess
from vramshare.settings import SettingsError


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
