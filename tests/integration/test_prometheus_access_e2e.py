"""Prometheus as production setups run it: behind an HTTPS gateway that wants a bearer token and a
tenant header (Thanos, Mimir, managed Prometheus). The controller reads DCGM through it with a CA
file, a token file (read again at every reading, so a rotated token is picked up) and the header; the
gateway is a real HTTPS proxy in front of the cluster's real Prometheus. Its own control plane."""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vramshare_e2e.admission_parts import start_auth_proxy
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import start_controller, wait_for_gpu_devices
from vramshare_e2e.process import eventually

pytestmark = pytest.mark.cluster

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, int, Path]]:
    token_file = tmp_path_factory.mktemp("prometheus") / "token"
    token_file.write_text(TOKEN + "\n")
    with LocalCluster.start() as local:
        port = start_auth_proxy(local, token=TOKEN, header="X-Scope-OrgID: ml")
        start_controller(
            local,
            name="controller",
            env={
                "VRAMSHARE_PROMETHEUS_URL": f"https://127.0.0.1:{port}",
                "VRAMSHARE_PROMETHEUS_CA_FILE": str(local.ca.cert_path),
                "VRAMSHARE_PROMETHEUS_BEARER_TOKEN_FILE": str(token_file),
                "VRAMSHARE_PROMETHEUS_HEADERS": '{"X-Scope-OrgID": "ml"}',
                "VRAMSHARE_POLL_INTERVAL_S": "1",
                "VRAMSHARE_MAX_SAMPLE_AGE_S": "6",
            },
        )
        yield local, port, token_file


def proxy_stats(port: int, ca: Path) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=str(ca))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/stats", context=context, timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def states(cluster: LocalCluster) -> set[str]:
    items = json.loads(cluster.kubectl("get", "gpudevices", "-o", "json"))["items"]
    return {d.get("status", {}).get("state", "") for d in items}


def test_the_inventory_is_read_through_an_authenticating_https_gateway(
    stack: tuple[LocalCluster, int, Path],
) -> None:
    cluster, port, token_file = stack
    wait_for_gpu_devices(cluster)
    eventually(lambda: states(cluster) == {"Ready"}, what="every GPU Ready through the gateway")
    stats = proxy_stats(port, cluster.ca.cert_path)
    assert stats["allowed"] > 0
    assert stats["refused"] == 0
    # A rotated token: the file changes, the next readings carry the new value.
    token_file.write_text("a-revoked-token\n")
    eventually(lambda: proxy_stats(port, cluster.ca.cert_path)["refused"] > 0, what="the old token refused")
    eventually(lambda: states(cluster) == {"Stale"}, what="GPUs Stale while Prometheus refuses")
    token_file.write_text(TOKEN + "\n")
    eventually(lambda: states(cluster) == {"Ready"}, what="Ready again with the rotated token")
    log = cluster.component("controller").log_path.read_text()
    assert "Prometheus unreachable" in log
    assert "401" in log
