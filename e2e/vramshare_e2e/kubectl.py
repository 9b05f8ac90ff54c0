"""kubectl against the local API server, as a test or the demo runs it: a command's output, or a
ClusterError with kubectl's own words; manifests applied server-side, CRDs waited for."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from vramshare_e2e.process import ClusterError


class Kubectl:
    def __init__(self, *, binary: Path, kubeconfig: Path) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig

    def __call__(
        self, *args: str, check: bool = True, stdin: str | None = None, kubeconfig: Path | None = None
    ) -> str:
        result = subprocess.run(
            [str(self.binary), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout if result.returncode == 0 else result.stderr

    def ok(self, *args: str) -> bool:
        """Whether the command succeeds (its output unread)."""
        done = subprocess.run(
            [str(self.binary), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return done.returncode == 0

    def apply_objects(self, objects: list[dict[str, Any]]) -> None:
        self(
            "apply",
            "--server-side",
            "--field-manager=vramshare-e2e",
            "-f",
            "-",
            stdin=yaml.safe_dump_all(objects),
        )

    def apply_file(self, path: Path) -> None:
        """Apply a manifest file or folder, waiting for CRDs in it to be Established."""
        self("apply", "--server-side", "--field-manager=vramshare-e2e", "-f", str(path))
        files = [path] if path.is_file() else sorted(path.glob("*.yaml"))
        crds = [
            doc["metadata"]["name"]
            for f in files
            for doc in yaml.safe_load_all(f.read_text())
            if doc and doc.get("kind") == "CustomResourceDefinition"
        ]
        if crds:
            self("wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{name}" for name in crds])
