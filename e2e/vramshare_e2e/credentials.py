"""Who talks to the local API server: client certificates minted for any user and groups, and the
kubeconfigs that carry them (or a ServiceAccount's token)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from vramshare_e2e.certs import CertificateAuthority, CertPair


class Credentials:
    """Mints client certificates from the cluster's CA and writes kubeconfigs into its work folder."""

    def __init__(self, *, ca: CertificateAuthority, pki_dir: Path, workdir: Path, api_url: str) -> None:
        self.ca = ca
        self.pki_dir = pki_dir
        self.workdir = workdir
        self.api_url = api_url

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
