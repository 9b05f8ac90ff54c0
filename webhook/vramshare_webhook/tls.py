"""Serving TLS: from certificate files reloaded in place, from a Secret, or self-managed.

Reloading into the same SSLContext means new connections get the new certificate while requests in
flight finish on the old one: rotation drops nothing. TLS 1.2 is the oldest version accepted.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ssl
from collections.abc import Callable
from pathlib import Path

import structlog

from vramshare.kube.client import ApiError, KubeClient, Obj
from vramshare_webhook import certificates

CA_SETTLE_S = 2.0
"""After a CA rotation, how long a replica waits between publishing the new caBundle and serving a
certificate of the new CA (the API server reads webhook configurations through a watch)."""

log = structlog.get_logger("vramshare.webhook.tls")


class ReloadingTls:
    def __init__(self, *, cert_file: Path, key_file: Path, client_ca_file: Path | None = None) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_ca_file is not None:
            # Optional at the handshake: probes and scrapes come without a certificate; /mutate
            # requires one (see vramshare_webhook.callers). One that is presented must verify.
            self.context.verify_mode = ssl.CERT_OPTIONAL
            self.context.load_verify_locations(cafile=str(client_ca_file))
        self._stamp: tuple[float, float] | None = None
        self.reload_if_changed()

    def _current_stamp(self) -> tuple[float, float]:
        return (self.cert_file.stat().st_mtime, self.key_file.stat().st_mtime)

    def reload_if_changed(self) -> bool:
        stamp = self._current_stamp()
        if stamp == self._stamp:
            return False
        self.context.load_cert_chain(str(self.cert_file), str(self.key_file))
        if self._stamp is not None:
            log.info("serving certificate reloaded", cert_file=str(self.cert_file))
        self._stamp = stamp
        return True

    async def watch(self, *, interval_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.reload_if_changed()
            except (OSError, ssl.SSLError) as exc:  # a half-written pair: keep serving the old one
                log.warning("serving certificate not reloaded", error=str(exc))


class SecretTls:
    """Serving certificates kept in a Secret, written to files that `ReloadingTls` serves.

    With `manage=True` (the self-managed mode) it also makes the CA and the serving certificate when
    they are missing or due for renewal, stores them in the Secret (several replicas race safely:
    create and replace carry preconditions, and the loser adopts the winner's), and keeps the CA in
    the `caBundle` of every webhook in the MutatingWebhookConfiguration, re-injecting it if it is
    wiped. The CA outlives many serving certificates, so renewal never invalidates the caBundle and
    no request is dropped. With `manage=False` it only follows a Secret someone else maintains
    (cert-manager, an operator's own).
    """

    def __init__(
        self,
        *,
        kube: KubeClient,
        namespace: str,
        secret: str,
        directory: Path,
        manage: bool,
        names: tuple[str, ...] = (),
        webhook_configuration: str = "",
        serving_validity: dt.timedelta = certificates.SERVING_VALIDITY,
        ca_validity: dt.timedelta = certificates.CA_VALIDITY,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        if manage and not names:
            raise ValueError("the self-managed TLS mode needs the names the webhook is reached by")
        self.kube = kube
        self.path = f"/api/v1/namespaces/{namespace}/secrets/{secret}"
        self.namespace = namespace
        self.secret = secret
        self.directory = directory
        self.manage = manage
        self.names = names
        self.webhook_configuration = webhook_configuration
        self.serving_validity = serving_validity
        self.ca_validity = ca_validity
        self.clock = clock
        self.cert_file = directory / "tls.crt"
        self.key_file = directory / "tls.key"
        self.injected = False
        self.rotations = 0

    @property
    def renew_before(self) -> dt.timedelta:
        return self.serving_validity / 3

    async def _read(self) -> tuple[certificates.Bundle | None, Obj | None]:
        try:
            obj = await self.kube.get(self.path)
        except ApiError as exc:
            if exc.not_found:
                return None, None
            raise
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        return certificates.Bundle.from_secret_data(data), obj

    async def _store(self, bundle: certificates.Bundle, existing: Obj | None) -> None:
        data = {k: base64.b64encode(v).decode() for k, v in bundle.to_secret_data().items()}
        if existing is None:
            await self.kube.create(
                f"/api/v1/namespaces/{self.namespace}/secrets",
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "type": "Opaque",
                    "metadata": {
                        "name": self.secret,
                        "namespace": self.namespace,
                        "labels": {"app.kubernetes.io/managed-by": "vramshare"},
                    },
                    "data": data,
                },
            )
        else:
            await self.kube.replace(self.path, {**existing, "data": data})

    async def sync(self) -> bool:
        """One pass: make sure the Secret holds a good bundle, serve it, inject its CA. True on change."""
        for _ in range(5):
            bundle, existing = await self._read()
            if not self.manage:
                if bundle is None:
                    raise RuntimeError(f"Secret {self.namespace}/{self.secret} has no tls.crt/tls.key/ca.crt")
                break
            now = self.clock()
            reason = certificates.needs_renewal(bundle, names=self.names, at=now + self.renew_before)
            if reason is None:
                break
            # Keep the CA while it outlives the next serving certificate: the caBundle then stays valid.
            # A new CA is published next to the old one, which stays trusted until it expires.
            keep = certificates.ca_usable(bundle, at=now + self.serving_validity)
            fresh = certificates.generate(
                names=self.names,
                now=now,
                serving_validity=self.serving_validity,
                ca_validity=self.ca_validity,
                keep_ca=bundle if keep else None,
                previous=bundle,
            )
            try:
                await self._store(fresh, existing)
            except ApiError as exc:
                if exc.conflict:  # another replica renewed first: adopt theirs
                    continue
                raise
            self.rotations += 1
            log.info(
                "serving certificate issued",
                reason=reason,
                secret=f"{self.namespace}/{self.secret}",
                serial=certificates.serial(fresh.cert),
            )
        else:
            raise RuntimeError("could not settle the serving certificate Secret (kept conflicting)")
        bundle, _ = await self._read()
        assert bundle is not None
        # Trust first, then serve: the caBundle holds the new CA before any replica serves a
        # certificate it signed, and still holds the old CA for the replicas that do not yet.
        if self.manage and self.webhook_configuration:
            await self._inject(bundle.ca_bundle)
            if self.cert_file.exists() and not certificates.signed_by(
                self.cert_file.read_bytes(), bundle.ca_cert
            ):
                await asyncio.sleep(CA_SETTLE_S)  # the API server's view of the caBundle catches up
        return self._write(bundle)

    def _write(self, bundle: certificates.Bundle) -> bool:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.cert_file.exists() and self.cert_file.read_bytes() == bundle.cert:
            return False
        for path, content in ((self.key_file, bundle.key), (self.cert_file, bundle.cert)):
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(content)
            tmp.chmod(0o600)
            tmp.replace(path)
        return True

    async def _inject(self, ca_pem: bytes) -> bool:
        """Keep `ca_pem` in every webhook's caBundle; True when it had to be written."""
        path = (
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/"
            + self.webhook_configuration
        )
        config = await self.kube.get(path)
        wanted = base64.b64encode(ca_pem).decode()
        ops = [
            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": wanted}
            for i, hook in enumerate(config.get("webhooks") or [])
            if hook.get("clientConfig", {}).get("caBundle") != wanted
        ]
        if ops:
            # The test op fails the patch if the list changed meanwhile, instead of patching a wrong entry.
            version = config["metadata"]["resourceVersion"]
            await self.kube.json_patch(
                path, [{"op": "test", "path": "/metadata/resourceVersion", "value": version}, *ops]
            )
            log.info("caBundle injected", configuration=self.webhook_configuration, webhooks=len(ops))
        self.injected = True
        return bool(ops)

    async def run(self, *, tls: ReloadingTls, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self.sync():
                    tls.reload_if_changed()
            except Exception as exc:  # keep serving what we have; the next pass tries again
                log.warning("certificate sync failed", error=str(exc))
