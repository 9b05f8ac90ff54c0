"""The tool binaries the local stack runs: etcd, Kubernetes, kwok, helm and the rest, built once from
their Go modules by e2e/tools/build.sh into a cache outside the repository; Prometheus from Debian."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from vramshare_e2e.process import ClusterError, say

BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "build.sh"


def tools_bin_dir() -> Path:
    """The directory with the control-plane binaries, building what is missing (cached by version)."""
    override = os.environ.get("VRAMSHARE_BIN")
    if override:
        return Path(override)
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], check=False, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise ClusterError(f"building the control-plane binaries failed (see above); ran {BUILD_SCRIPT}")
    return Path(result.stdout.strip().splitlines()[-1])


def apt_install(*packages: str) -> None:
    """Install Debian's `packages` (root only; otherwise say the command to run)."""
    names = " ".join(packages)
    if os.geteuid() != 0:
        verb = "is" if len(packages) == 1 else "are"
        raise ClusterError(
            f"{names} {verb} not installed; run: sudo apt-get install --no-install-recommends {names}"
        )
    say(f"installing {names} from Debian's packages (once)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def prometheus_binary() -> Path:
    """Debian's Prometheus, installed with apt-get when missing (the machine reaches Debian's mirrors)."""
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    apt_install("prometheus")
    # The package's own service would listen on 0.0.0.0:9090; ours runs on loopback only.
    subprocess.run(["pkill", "-x", "prometheus"], check=False)
    found = shutil.which("prometheus")
    if not found:
        raise ClusterError("apt-get installed prometheus but it is not on PATH")
    return Path(found)


def images_cache() -> Path:
    root = (
        os.environ.get("VRAMSHARE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vramshare"
    )
    return Path(root) / "node-images"


def node_bin(name: str) -> str:
    path = tools_bin_dir() / name
    if not path.exists():
        raise ClusterError(f"{name} is not built: run make tools (REAL_NODE=1)")
    return str(path)
