"""The kubectl plugin as krew ships plugins: a self-contained archive and its manifest.

`kubectl-vramshare` (`vramshare.status`) becomes one executable zip (Python's zipapp) holding vramshare
and its pure-Python dependencies, built without C extensions (aiohttp, multidict, yarl, frozenlist,
propcache and PyYAML all have pure-Python fallbacks), so one archive runs on any OS and architecture
with Python 3.11 or newer. The archive (`kubectl-vramshare-<version>.tar.gz`: the zipapp and the
licence) and the krew manifest naming its release URL and sha256 are written to `dist/`; a release
uploads the archive and submits the manifest to krew-index. `make plugin` builds them; the tests
validate the manifest with krew's own validator and install the archive with krew.

Usage: python -m vramshare_e2e.plugin [--out dist] [--version 0.1.0]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipapp
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RELEASES = "https://github.com/vramshare/vramshare/releases/download"
HOMEPAGE = "https://github.com/vramshare/vramshare"
PURE = ("aiohttp", "multidict", "yarl", "frozenlist", "propcache", "pyyaml", "charset-normalizer")
"""Packages with compiled wheels and a pure-Python build; built from source without extensions."""
NO_EXTENSIONS = {
    "AIOHTTP_NO_EXTENSIONS": "1",
    "MULTIDICT_NO_EXTENSIONS": "1",
    "YARL_NO_EXTENSIONS": "1",
    "FROZENLIST_NO_EXTENSIONS": "1",
    "PROPCACHE_NO_EXTENSIONS": "1",
    "PYYAML_FORCE_LIBYAML": "0",
}
PLATFORMS = [("linux", "amd64"), ("linux", "arm64"), ("darwin", "amd64"), ("darwin", "arm64")]


@dataclass(frozen=True, kw_only=True)
class Plugin:
    archive: Path
    manifest: Path
    sha256: str


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def project_version() -> str:
    return str(_project()["version"])


def _requirements() -> list[str]:
    """What the plugin imports beyond the standard library, with vramshare's own version bounds."""
    wanted = {"aiohttp", "kubernetes", "pyyaml"}
    deps = [
        d for d in _project()["dependencies"] if re.split(r"[<>=!~ ]", d, maxsplit=1)[0].lower() in wanted
    ]
    # kubernetes 37 imports pydantic, whose core is compiled; 36 is the newest without it, and the
    # plugin only loads kubeconfigs with it.
    return [*deps, "kubernetes<37"]


def build_zipapp(stage: Path, target: Path, *, show: bool = True) -> None:
    env = {**os.environ, **NO_EXTENSIONS, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(stage)]
    if show:
        print(f"[vramshare plugin] installing {', '.join(_requirements())} without C extensions", flush=True)
    subprocess.run([*pip, "--no-binary", ",".join(PURE), *_requirements()], check=True, env=env)
    subprocess.run([*pip, "--no-deps", "--upgrade", str(ROOT)], check=True, env=env)
    compiled = sorted(str(p.relative_to(stage)) for p in stage.rglob("*") if p.suffix in (".so", ".pyd"))
    if compiled:
        raise RuntimeError(f"compiled modules would tie the archive to one platform: {compiled}")
    for junk in [*stage.glob("*.dist-info"), *stage.glob("bin"), *stage.rglob("__pycache__")]:
        shutil.rmtree(junk, ignore_errors=True)
    zipapp.create_archive(
        stage, target, interpreter="/usr/bin/env python3", main="vramshare.status:main", compressed=True
    )


def manifest(*, version: str, sha256: str) -> str:
    uri = f"{RELEASES}/v{version}/kubectl-vramshare-v{version}.tar.gz"
    platforms = "".join(
        f"""  - selector:
      matchLabels:
        os: {os_name}
        arch: {arch}
    uri: {uri}
    sha256: {sha256}
    bin: kubectl-vramshare
"""
        for os_name, arch in PLATFORMS
    )
    return f"""apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: vramshare
spec:
  version: v{version}
  homepage: {HOMEPAGE}
  shortDescription: Show the GPUs and GPU memory bookings of vramshare
  description: |
    vramshare lets Kubernetes pods share NVIDIA GPUs by memory: an admission webhook books GPU
    memory for each pod from live DCGM metrics. This plugin shows the GPUs (total, used, reserved,
    headroom, state) and the bookings per pod, once or as they change:
      kubectl vramshare status [-n NS | -A] [-o table|wide|json|yaml] [-w]
  caveats: |
    The plugin runs with python3 (3.11 or newer) from your PATH.
  platforms:
{platforms}"""


def build(out: Path, *, version: str, show: bool = True) -> Plugin:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp) / "kubectl-vramshare"
        build_zipapp(Path(tmp) / "stage", app, show=show)
        archive = out / f"kubectl-vramshare-v{version}.tar.gz"
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for path, name in ((app, "kubectl-vramshare"), (ROOT / "LICENSE", "LICENSE")):
                info = tar.gettarinfo(str(path), arcname=name)
                info.mode = 0o755 if name == "kubectl-vramshare" else 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with path.open("rb") as f:
                    tar.addfile(info, f)
        archive.write_bytes(buffer.getvalue())
    sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
    path = out / "vramshare.yaml"
    path.write_text(manifest(version=version, sha256=sha256))
    if show:
        size = archive.stat().st_size / 1e6
        print(f"[vramshare plugin] {archive} ({size:.1f} MB, sha256 {sha256})\n[vramshare plugin] {path}")
    return Plugin(archive=archive, manifest=path, sha256=sha256)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    parser.add_argument("--version", default=project_version())
    args = parser.parse_args(argv)
    build(args.out, version=args.version)


if __name__ == "__main__":
    main()
