"""The self-managed TLS mode against the real API server: CA injection, re-injection, rotation under
load without a failed admission; and the 429 denial mode with Retry-After."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest
from cryptography import x509
from kubernetes import client
from kubernetes.client.rest import ApiException

from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import seed_inventory, start_webhook, webhook_configuration
from vramshare_e2e.ports import free_port

pytestmark = pytest.mark.cluster
CONFIG = "vramshare-selfmanaged"
SECRET_NS = "vramshare-system"


@pytest.fixture(scope="module")
def self_managed(cluster: LocalCluster, core: client.CoreV1Api) -> Iterator[int]:
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=SECRET_NS)))
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name="shard-c", labels={"vramshare-e2e/shard": "c"}))
    )
    seed_inventory(cluster)
    port = free_port()
    config = webhook_configuration(cluster, ports={"c": port})
    config["metadata"]["name"] = CONFIG
    del config["webhooks"][0]["clientConfig"]["caBundle"]
    cluster.apply_objects([config])
    env = {
        "VRAMSHARE_PORT": str(port),
        "VRAMSHARE_TLS_MODE": "self-managed",
        "VRAMSHARE_TLS_NAMES": "127.0.0.1,localhost",
        "VRAMSHARE_NAMESPACE": SECRET_NS,
        "VRAMSHARE_WEBHOOK_CONFIGURATION": CONFIG,
        "VRAMSHARE_TLS_SERVING_VALIDITY_S": "60",
        # The CA would not outlive the next serving certificate at any renewal: each one rotates the CA.
        "VRAMSHARE_TLS_CA_VALIDITY_S": "70",
        "VRAMSHARE_TLS_SYNC_INTERVAL_S": "1",
        "VRAMSHARE_DENIAL_CODE": "429",
        "VRAMSHARE_RETRY_AFTER_S": "17",
    }
    start_webhook(cluster, name="webhook-c", env=env, port=port)
    yield port
    cluster.kubectl("delete", "mutatingwebhookconfiguration", CONFIG)
    cluster.stop_component("webhook-c")


def secret_ca(core: client.CoreV1Api) -> str:
    """The CAs the Secret says clients must trust (base64, as in the caBundle)."""
    return core.read_namespaced_secret("vramshare-webhook-tls", SECRET_NS).data["ca-bundle.crt"]


def cas_in(bundle_b64: str) -> list[int]:
    return [c.serial_number for c in x509.load_pem_x509_certificates(base64.b64decode(bundle_b64))]


def injected_ca(cluster: LocalCluster) -> str:
    config = json.loads(cluster.kubectl("get", "mutatingwebhookconfiguration", CONFIG, "-o", "json"))
    return config["webhooks"][0]["clientConfig"].get("caBundle", "")


def served_serial(port: int) -> int:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def pod(name: str, mib: str | None = None) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations={"gpu-mem-mb": mib} if mib else {}),
        spec=client.V1PodSpec(containers=[client.V1Container(name="base", image="example.invalid/x")]),
    )


def test_ca_is_injected_and_pods_are_admitted(
    cluster: LocalCluster, core: client.CoreV1Api, self_managed: int
) -> None:
    assert injected_ca(cluster) == secret_ca(core)
    created = core.create_namespaced_pod("shard-c", pod("tls-ok", "1000"))
    assert created.metadata.annotations["vramshare.io/gpu-uuid"].startswith("GPU-")


def test_refusal_in_429_mode_carries_retry_after(core: client.CoreV1Api, self_managed: int) -> None:
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod("shard-c", pod("too-big", "500000"))
    assert refused.value.status == 429
    assert refused.value.headers["Retry-After"] == "17"
    assert "retry after 17 s" in json.loads(refused.value.body)["message"]


def test_wiped_ca_bundle_is_reinjected(
    cluster: LocalCluster, core: client.CoreV1Api, self_managed: int
) -> None:
    cluster.kubectl(
        "patch",
        "mutatingwebhookconfiguration",
        CONFIG,
        "--type=json",
        "-p",
        json.dumps([{"op": "remove", "path": "/webhooks/0/clientConfig/caBundle"}]),
    )
    assert injected_ca(cluster) == ""
    deadline = time.monotonic() + 15
    while injected_ca(cluster) != secret_ca(core):
        assert time.monotonic() < deadline, "caBundle was not re-injected"
        time.sleep(0.5)


def test_ca_rotation_under_concurrent_load_fails_no_admission(
    cluster: LocalCluster, core: client.CoreV1Api, self_managed: int
) -> None:
    """The serving certificate lives 60 s and is renewed with 20 s left, and the 70 s CA cannot cover
    the next one, so the renewal makes a new CA. Four clients keep creating pods through the API server
    (which holds keep-alive connections to the webhook) until 10 s after the new certificate is served."""
    ca_before = cas_in(secret_ca(core))
    first = served_serial(self_managed)
    failures: list[str] = []
    created = [0]
    rotated_at: list[float] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                core.create_namespaced_pod("shard-c", pod(f"load-{worker}-{n}"))
                created[0] += 1
            except ApiException as exc:
                failures.append(f"{exc.status}: {exc.body}")
            n += 1
            time.sleep(0.05)

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if not rotated_at and served_serial(self_managed) != first:
                rotated_at.append(time.monotonic())
                during = cas_in(injected_ca(cluster))
            if rotated_at and time.monotonic() - rotated_at[0] > 10:
                break
            time.sleep(0.2)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert rotated_at, "the serving certificate was not renewed"
    ca_after = cas_in(secret_ca(core))
    assert ca_after[0] not in ca_before, "the CA was not rotated"
    # While the new certificate was served, the caBundle held the new CA and the old one.
    assert set(during) >= {ca_after[0], ca_before[0]}
    assert failures == []
    print(f"\n{created[0]} admissions from 4 concurrent clients across a CA rotation, 0 failed")
    assert created[0] > 100


def test_secret_mode_serves_a_secret_kept_by_someone_else(
    cluster: LocalCluster, core: client.CoreV1Api, self_managed: int
) -> None:
    """A replica in the `secret` mode serves the certificate another party keeps (here: webhook-c)."""
    port = free_port()
    env = {
        "VRAMSHARE_TLS_MODE": "secret",
        "VRAMSHARE_NAMESPACE": SECRET_NS,
        "VRAMSHARE_TLS_SYNC_INTERVAL_S": "1",
    }
    start_webhook(cluster, name="webhook-d", env=env, port=port)
    try:
        # webhook-c renews every ~40 s; a renewal between the two reads is retried, a mismatch is not.
        deadline = time.monotonic() + 5
        while True:
            secret = core.read_namespaced_secret("vramshare-webhook-tls", SECRET_NS)
            kept = x509.load_pem_x509_certificate(base64.b64decode(secret.data["tls.crt"])).serial_number
            if served_serial(port) == kept:
                break
            assert time.monotonic() < deadline, "the secret mode does not serve the Secret's certificate"
            time.sleep(0.5)
        ctx = ssl.create_default_context(cadata=base64.b64decode(secret.data["ca.crt"]).decode())
        ctx.check_hostname = False  # the certificate names 127.0.0.1 as an IP SAN; verify the chain
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        cluster.stop_component("webhook-d")
