"""The manual as a static site: `make docs` builds `docs/` into `site/` with MkDocs in strict mode, so a
broken link, a missing anchor or a page left out of the navigation fails the build.

The diagrams are Mermaid, which Material for MkDocs loads from a CDN unless the page already has it: the
site carries its own copy (from the npm registry, pinned by version and checksum, cached outside the
repository) so it renders offline, behind a firewall, and in the tests.

    python -m vramshare_e2e.docs_site [--site DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from vramshare_e2e.tools import apt_install

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "vramshare" / "docs"
MERMAID_VERSION = "11.12.0"
MERMAID_SHA256 = "07e37dfa97b337ccc85365d57eddf99b9706f09db3b59b260d0333b23b343c4b"
VENDORED = ROOT / "docs" / "assets" / "vendor" / "mermaid.min.js"
"""Where mkdocs.yml's extra_javascript finds it (ignored by git)."""


def mermaid() -> Path:
    """mermaid.min.js of MERMAID_VERSION, fetched once with `npm pack` and checked against its sha256."""
    cached = CACHE / f"mermaid-{MERMAID_VERSION}" / "mermaid.min.js"
    if not cached.exists():
        print(f"[docs] fetching mermaid {MERMAID_VERSION} (npm pack, once)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                ["npm", "pack", f"mermaid@{MERMAID_VERSION}", "--silent"],
                cwd=tmp,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            with tarfile.open(Path(tmp) / f"mermaid-{MERMAID_VERSION}.tgz") as archive:
                member = archive.extractfile("package/dist/mermaid.min.js")
                assert member is not None
                data = member.read()
        digest = hashlib.sha256(data).hexdigest()
        if digest != MERMAID_SHA256:
            raise RuntimeError(f"mermaid {MERMAID_VERSION}: sha256 {digest}, expected {MERMAID_SHA256}")
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_bytes(data)
    return cached


def chromium() -> str:
    """Debian's Chromium, installed with apt-get where missing, for the manual's browser test (Playwright
    drives it; its own browser download is not used)."""
    found = shutil.which("chromium")
    if found is None:
        apt_install("chromium")
        found = shutil.which("chromium")
    if found is None:
        raise RuntimeError("apt-get installed chromium but it is not on PATH")
    return found


def build(site: Path = ROOT / "site") -> float:
    """Build the site into `site` (strict); return the seconds it took."""
    VENDORED.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(mermaid(), VENDORED)
    started = time.monotonic()
    # Not --quiet: it drops the warnings before strict mode counts them, and the build passes.
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vramshare_e2e.docs_site")
    parser.add_argument(
        "--chromium", action="store_true", help="only install Debian's Chromium where missing"
    )
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="where the site is written")
    args = parser.parse_args(argv)
    if args.chromium:
        print(f"[docs] chromium: {chromium()}")
        return
    seconds = build(args.site)
    print(f"[docs] built {args.site} in {seconds:.1f} s (strict: no broken link or anchor)")


if __name__ == "__main__":
    main()
