"""The wheel (and so the image) holds product code only: built from exactly what the Dockerfile copies."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_built_from_the_dockerfiles_sources_holds_only_product_code(tmp_path: Path) -> None:
    build = re.split(r"(?m)^FROM ", (ROOT / "Dockerfile").read_text())[1]
    copied = [s for line in re.findall(r"(?m)^COPY (?!--from)(.+)$", build) for s in line.split()[:-1]]
    assert "e2e/" not in " ".join(copied), "the image build copies the test harness"
    context = tmp_path / "context"
    for source in copied:
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (context / source).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, context / source)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(tmp_path),
            str(context),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("vramshare-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"vramshare", "vramshare_webhook", wheel.name.split("-py")[0] + ".dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "vramshare/controller/__main__.py" in names
    assert "vramshare_webhook/__main__.py" in names
    assert not [n for n in names if "e2e" in n or n.startswith("tests/")]
