"""The product image for real nodes: what `make image` builds from the Dockerfile (buildah on a Debian
base, no Docker engine, no registry), exported as an OCI archive that a node's containerd imports.

The archive is keyed by a hash of everything the Dockerfile copies, so the image the tests run is the
code under test, rebuilt (from buildah's cached layers: only the vramshare wheel, when only the code
changed) whenever that code changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from vramshare_e2e.process import ClusterError, say
from vramshare_e2e.tools import apt_install, images_cache

ROOT = Path(__file__).resolve().parents[2]
BUILD_IMAGE = ROOT / "e2e" / "tools" / "build-image.sh"
INPUTS = ("Dockerfile", "pyproject.toml", "README.md", "operator", "webhook")
"""What the Dockerfile copies (tests/integration/test_packaging.py keeps the two lists in step)."""
BUILDAH = ("buildah", "--storage-driver", "vfs")


@dataclass(frozen=True, kw_only=True)
class ProductImage:
    reference: str
    """As the chart names it: repository:tag, e.g. localhost/vramshare:0.1.0."""
    archive: Path
    """OCI archive (a tarball of an OCI layout), ready for `ctr images import`."""

    @property
    def repository(self) -> str:
        return self.reference.rsplit(":", 1)[0]

    @property
    def tag(self) -> str:
        return self.reference.rsplit(":", 1)[1]


def inputs_digest(root: Path = ROOT) -> str:
    """sha256 over the paths and contents of the Dockerfile's inputs (bytecode caches left out)."""
    digest = hashlib.sha256()
    for name in INPUTS:
        path = root / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc" or ".egg-info" in str(f):
                continue
            digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _ensure_build_tools() -> None:
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        apt_install(*missing)


def product_image(cache: Path) -> ProductImage:
    """The current code's image as an OCI archive in `cache`, built and exported when missing."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    reference = f"localhost/vramshare:{version}"
    archive = cache / f"vramshare-{inputs_digest()}.oci.tar"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".product-image.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers: one builds, the other waits
        if not archive.exists():
            _ensure_build_tools()
            started = time.monotonic()
            say(f"building the product image {reference} from the Dockerfile (make image)")
            result = subprocess.run(["bash", str(BUILD_IMAGE)], cwd=ROOT, check=False)
            if result.returncode != 0:
                raise ClusterError(f"building the product image failed (see above); ran {BUILD_IMAGE}")
            for old in cache.glob("vramshare-*.oci.tar"):
                old.unlink()  # an earlier code's image
            partial = archive.with_suffix(".partial")
            partial.unlink(missing_ok=True)
            pushed = subprocess.run(
                [*BUILDAH, "push", "--quiet", reference, f"oci-archive:{partial}:{reference}"],
                check=False,
                capture_output=True,
                text=True,
            )
            if pushed.returncode != 0:
                raise ClusterError(f"buildah push to an OCI archive failed: {pushed.stderr.strip()}")
            partial.rename(archive)
            size = archive.stat().st_size / 2**20
            say(f"product image built and exported in {time.monotonic() - started:.0f} s ({size:.0f} MiB)")
    return ProductImage(reference=reference, archive=archive)


def main() -> None:
    """`make node-image`: build (when the code changed) and export the image for real nodes."""
    try:
        image = product_image(images_cache())
    except ClusterError as exc:
        raise SystemExit(f"[vramshare image] {exc}") from None
    say(f"product image for real nodes: {image.reference} in {image.archive}")


if __name__ == "__main__":
    main()
