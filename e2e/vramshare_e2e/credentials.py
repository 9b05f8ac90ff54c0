"""Who talks to the local API server: client certificates minted for any user and groups, and the
kubeconfigs that carry them (or a ServiceAccount's token)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from vramshare_e2e.certs import CertificateAuthority, CertPair

WEBHOOK_CLIENT = "vramshare-e2e-kube-apiserver"
"""The common name of the client certificate the API server presents to admission webhooks (its
AdmissionConfiguration's kubeconfig), as an operator configures theirs: vramshare's webhook answers
admission reviews only from it (VRAMSHARE_CLIENT_NAMES)."""


class Credentials:
    """Mints client certificates from the cluster's CA and writes kubeconfigs into its work folder."""

    def __init__(self, *, ca: CertificateAuthority, pki_dir: Path, workdir: Path, api_url: str) -> None:
        self.ca = ca
        self.pki_dir = pki_dir
        self.workdir = workdir
        self.api_url = api_url
        self._webhook_client: CertPair | None = None

    def client_cert(self, user: str, *, groups: tuple[str, ...] = ()) -> CertPair:
        """A client certificate the API server authenticates as `user` in `groups`."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
        return self.ca.issue(f"user-{safe}", common_name=user, organizations=groups, client=True)

    def kubeconfig(self, user: str, *, groups: tuple[str, ...] = (), name: str | None = None) -> Path:
        """A kubeconfig for `user` in `groups` (for RBAC tests: bind roles to that user or group)."""
        pair = self.client_cert(user, groups=groups)
        if name == "admin":
            shutil.copy(pair.cert_path, self.pki_dir / "admin.crt")
            shutil.copy(pair.key_path, self.pki_dir / "admin.key")
        return self.write_kubeconfig(
            name or pair.cert_path.stem,
            user=user,
            credentials={"client-certificate": str(pair.cert_path), "client-key": str(pair.key_path)},
        )

    def write_kubeconfig(self, name: str, *, user: str, credentials: dict[str, str]) -> Path:
        """A kubeconfig named `name` for `user` with these credentials (a certificate, or a token)."""
        path = self.workdir / f"{name}.kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "vramshare-local",
                    "cluster": {"server": self.api_url, "certificate-authority": str(self.ca.cert_path)},
                }
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [
                {"name": "vramshare-local", "context": {"cluster": "vramshare-local", "user": user}}
            ],
            "current-context": "vramshare-local",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def webhook_admission_config(self) -> Path:
        """An AdmissionConfiguration for the API server (`--admission-control-config-file`): it presents
        a client certificate (common name `WEBHOOK_CLIENT`, from the cluster's CA) to every admission
        webhook that asks for one."""
        pair = self.webhook_client()
        kubeconfig = self.workdir / "webhook-client.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "users": [
                        {
                            "name": "*",
                            "user": {
                                "client-certificate": str(pair.cert_path),
                                "client-key": str(pair.key_path),
                            },
                        }
                    ],
                }
            )
        )
        kubeconfig.chmod(0o600)
        webhook = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "WebhookAdmissionConfiguration",
            "kubeConfigFile": str(kubeconfig),
        }
        config = self.workdir / "admission-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "apiserver.config.k8s.io/v1",
                    "kind": "AdmissionConfiguration",
                    "plugins": [
                        {"name": "MutatingAdmissionWebhook", "configuration": webhook},
                        {"name": "ValidatingAdmissionWebhook", "configuration": webhook},
                    ],
                }
            )
        )
        return config

    def webhook_client(self) -> CertPair:
        """The API server's client certificate for webhooks (to post reviews as it does), issued once."""
        if self._webhook_client is None:
            self._webhook_client = self.ca.issue(
                "apiserver-webhook-client", common_name=WEBHOOK_CLIENT, client=True
            )
        return self._webhook_client
