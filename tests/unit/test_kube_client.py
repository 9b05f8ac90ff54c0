"""Connection.load: how credentials are taken from a kubeconfig."""

from __future__ import annotations

from pathlib import Path

import yaml

from vramshare.kube.client import Connection, KubeClient


def write(tmp_path: Path, user: dict[str, str]) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


def test_bearer_token_from_kubeconfig_is_sent(tmp_path: Path) -> None:
    connection = Connection.load(kubeconfig=write(tmp_path, {"token": "abc123"}))
    assert connection.host == "https://127.0.0.1:6443"
    assert connection.token == "abc123"
    headers = KubeClient(connection)._headers()
    assert headers["Authorization"] == "Bearer abc123"


def test_basic_auth_is_not_mistaken_for_a_token(tmp_path: Path) -> None:
    connection = Connection.load(kubeconfig=write(tmp_path, {"username": "x", "password": "y"}))
    assert connection.token is None
    assert "Authorization" not in KubeClient(connection)._headers()
