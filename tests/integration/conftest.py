"""Integration tests run against one real local control plane per session (see vramshare_e2e.cluster)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client, config

from vramshare_e2e.cluster import LocalCluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    local = LocalCluster.start()
    with local:
        yield local


@pytest.fixture(scope="session")
def api(cluster: LocalCluster) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture(scope="session")
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def namespace_labels() -> dict[str, str]:
    """The labels `namespace` is created with; a module overrides this fixture to set its own."""
    return {}


@pytest.fixture
def namespace(
    core: client.CoreV1Api, request: pytest.FixtureRequest, namespace_labels: dict[str, str]
) -> Iterator[str]:
    """A fresh namespace per test, named after it. Its labels are set when it is created: a label added
    afterwards reaches the API server's namespace cache, which webhook namespaceSelectors are matched
    against, a moment later, and a pod created in that moment is not sent to the webhook at all."""
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=namespace_labels))
    )
    yield name
    core.delete_namespace(name)
