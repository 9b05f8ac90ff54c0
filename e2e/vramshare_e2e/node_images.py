"""The images a real node runs without a registry: the pause image and a task image of Debian's static
busybox, written as OCI archives for containerd to import."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

from vramshare_e2e.oci import File, Image, write_layout
from vramshare_e2e.process import ClusterError
from vramshare_e2e.tools import images_cache, node_bin

PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"


TASK_IMAGE = "vramshare.local/task:1"
"""busybox (Debian's busybox-static) with NVIDIA_VISIBLE_DEVICES=all set in the image, as CUDA images do."""


BUSYBOX_APPLETS = ("sh", "env", "echo", "sleep", "cat", "ls", "true", "printenv")


def busybox_binary(cache: Path) -> Path:
    """Debian's static busybox, downloaded once with apt-get download (unpacked, never installed)."""
    target = cache / "busybox"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".busybox.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers: one downloads, the other waits
        if not target.exists():
            _download_busybox(cache, target)
    return target


def _download_busybox(cache: Path, target: Path) -> None:
    work = cache / "busybox-deb"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    download = ["apt-get", "download", "busybox-static"]
    if subprocess.run(download, cwd=work, check=False, capture_output=True).returncode != 0:
        # A fresh machine may have no package lists yet.
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        result = subprocess.run(download, cwd=work, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            raise ClusterError(f"apt-get download busybox-static failed: {result.stderr.strip()}")
    (deb,) = work.glob("busybox-static_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "x")], check=True)
    shutil.copy2(work / "x" / "bin" / "busybox", target)
    shutil.rmtree(work, ignore_errors=True)


def node_images(cache: Path | None = None) -> list[Path]:
    """The sandbox image and the task image as OCI layout tarballs (in `cache`, by default the tools'
    cache; rewritten each time from the cached binaries, which takes milliseconds)."""
    cache = cache or images_cache()
    cache.mkdir(parents=True, exist_ok=True)
    pause = write_layout(
        Image(
            reference=PAUSE_IMAGE,
            files={"/pause": File(data=Path(node_bin("pause")).read_bytes())},
            entrypoint=("/pause",),
            user="65535:65535",
        ),
        cache / "pause.oci.tar",
    )
    busybox = busybox_binary(cache).read_bytes()
    files = {"/bin/busybox": File(data=busybox)}
    files |= {f"/bin/{a}": File(link="busybox") for a in BUSYBOX_APPLETS}
    task = write_layout(
        Image(
            reference=TASK_IMAGE,
            files=files,
            cmd=("/bin/sh",),
            env={"PATH": "/bin", "NVIDIA_VISIBLE_DEVICES": "all"},
        ),
        cache / "task.oci.tar",
    )
    return [pause, task]
