"""Connection.load: how credentials are taken from a kubeconfig and, in a pod, from its service account."""

from __future__ import annotations

from pathlib import Path

import yaml
from kubernetes.client import Configuration
from kubernetes.config.incluster_config import InClusterConfigLoader

from tests.unit.fake_kube import FakeKube
from vramshare.kube.client import Connection, KubeClient, list_all


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


def test_the_in_cluster_service_account_token_is_sent(tmp_path: Path) -> None:
    """kubernetes' own in-cluster loader, on a pod's files: it writes the scheme as "bearer"."""
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token-1\n")
    ca.write_text("unused: not read by the loader\n")
    configuration = Configuration()
    InClusterConfigLoader(
        token_filename=str(token),
        cert_filename=str(ca),
        environ={"KUBERNETES_SERVICE_HOST": "10.1.2.3", "KUBERNETES_SERVICE_PORT": "6443"},
    ).load_and_set(configuration)
    assert configuration.api_key["BearerToken"].startswith("bearer ")  # as found; the reason for this test
    configuration.ssl_ca_cert = None  # the file above is no certificate
    connection = Connection.from_configuration(configuration, token_file=token)
    assert connection.host == "https://10.1.2.3:6443"
    assert connection.token == "sa-token-1"
    assert KubeClient(connection)._headers()["Authorization"] == "Bearer sa-token-1"


def test_basic_auth_is_not_mistaken_for_a_token(tmp_path: Path) -> None:
    connection = Connection.load(kubeconfig=write(tmp_path, {"username": "x", "password": "y"}))
    assert connection.token is None
    assert "Authorization" not in KubeClient(connection)._headers()


async def test_list_all_pages_through_a_large_collection() -> None:
    kube = FakeKube()
    for i in range(1234):
        await kube.create("/apis/x/v1/namespaces/a/things", {"metadata": {"name": f"t{i:04d}"}})
    listed = await list_all(kube, "/apis/x/v1/namespaces/a/things", page=500)
    assert kube.pages == 3  # no answer held more than 500
    assert [o["metadata"]["name"] for o in listed["items"]] == [f"t{i:04d}" for i in range(1234)]
    assert listed["metadata"]["continue"] is None
