"""`kubectl vramshare status` against the controller's stack: as an installed command, as kubectl's
plugin with kubectl's flags, and installed by krew on a bare Python."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.controller_stack import (
    controller_stack,
    devices,
)
from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.components import (
    bare_booking,
)
from vramshare_e2e.plugin import build as build_plugin
from vramshare_e2e.process import eventually
from vramshare_e2e.tools import tools_bin_dir

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalCluster]:
    with controller_stack() as local:
        yield local


def a_booking_to_show(stack: LocalCluster, name: str) -> None:
    """A booking in `jobs` for the status command to show, once every GPU is known: the tests of
    the command make their own, so that each passes run alone (`-k`) as in the module."""
    fleet = stack.settings.fleet
    eventually(lambda: len(devices(stack)) == len(fleet.all_gpus()), what="GpuDevices")
    _, gpu = fleet.all_gpus()[1]
    booking = bare_booking(
        name=name,
        namespace="jobs",
        pod=f"{name}-pod",
        node="gpu-node-a",
        uuid=gpu.uuid,
        index=gpu.index,
        mib=1024,
    )
    stack.kubectl("create", "-f", "-", stdin=json.dumps(booking))


def test_vramshare_status_against_the_stack(stack: LocalCluster) -> None:
    """Run as an installed command with the cluster's kubeconfig, as a person or kubectl would. The
    test makes the booking it looks for: run alone (`-k`), it found none before."""
    a_booking_to_show(stack, "shown-by-status")
    cli = Path(sys.executable).parent / "kubectl-vramshare"
    table = subprocess.run(
        [str(cli), "status", "--kubeconfig", str(stack.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert table.startswith("GPUs\nNODE")
    assert "gpu-node-b" in table
    assert "Reservations\nNAMESPACE" in table
    data = json.loads(
        subprocess.run(
            [str(cli), "status", "-o", "json", "--kubeconfig", str(stack.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    api = {d["spec"]["uuid"]: d["status"]["headroomMiB"] for d in devices(stack).values()}
    listed = {g["uuid"]: g["headroom_mib"] for g in data["gpus"]}
    assert set(listed) == set(api)
    names = {r["name"] for r in data["reservations"]}
    assert "shown-by-status" in names
    bad = subprocess.run(
        [str(cli), "status", "--kubeconfig", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("vramshare status: cannot read the cluster:")


def test_the_kubectl_plugin_takes_kubectls_flags(stack: LocalCluster) -> None:
    """--context, -n, -o yaml|wide and -w, as `kubectl vramshare status ...` is used."""
    a_booking_to_show(stack, "shown-by-the-plugin")
    cli = Path(sys.executable).parent / "kubectl-vramshare"
    context = stack.kubectl("config", "current-context").strip()

    def run(*args: str) -> str:
        return subprocess.run(
            [str(cli), "status", "--kubeconfig", str(stack.kubeconfig), "--context", context, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout

    everywhere = yaml.safe_load(run("-o", "yaml", "-A"))
    in_jobs = yaml.safe_load(run("-o", "yaml", "-n", "jobs"))
    assert {r["namespace"] for r in in_jobs["reservations"]} == {"jobs"}
    assert len(everywhere["reservations"]) >= len(in_jobs["reservations"]) > 0
    wide = run("-o", "wide", "-n", "jobs")
    assert "RESERVATION" in wide
    wrong = subprocess.run(
        [str(cli), "status", "--kubeconfig", str(stack.kubeconfig), "--context", "no-such-context"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert wrong.returncode == 1
    assert "no-such-context" in wrong.stderr
    # -w prints again when something changes, until interrupted.
    watching = subprocess.Popen(
        [str(cli), "status", "--kubeconfig", str(stack.kubeconfig), "-w", "--interval", "0.5", "-n", "jobs"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert watching.stdout is not None
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(iter(watching.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        # Started (imports take a while on a busy machine) and printed twice: the sample ages move.
        eventually(
            lambda: sum(line.startswith("GPUs") for line in printed) >= 2, what="two prints", timeout_s=60
        )
    finally:
        watching.send_signal(signal.SIGINT)
        watching.wait(timeout=20)
    assert watching.returncode == 0


def test_the_krew_package_installs_with_krew_and_runs_on_a_bare_python(
    stack: LocalCluster, tmp_path: Path
) -> None:
    """The archive and manifest a release ships: validated by krew's own validator, installed by krew
    from the archive, and run with a Python that has no site-packages (all it needs is inside)."""
    plugin = build_plugin(tmp_path / "dist", version="0.1.0", show=False)
    bin_dir = tools_bin_dir()
    validated = subprocess.run(
        [str(bin_dir / "validate-krew-manifest"), "-manifest", str(plugin.manifest), "-skip-install"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert validated.returncode == 0, validated.stderr
    assert "structural validation OK" in validated.stderr
    spec = yaml.safe_load(plugin.manifest.read_text())["spec"]
    assert {p["sha256"] for p in spec["platforms"]} == {plugin.sha256}
    assert {p["uri"] for p in spec["platforms"]} == {
        "https://github.com/vramshare/vramshare/releases/download/v0.1.0/kubectl-vramshare-v0.1.0.tar.gz"
    }
    # kubectl finds krew as kubectl-krew, and the plugin's `python3` is one without site-packages.
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "kubectl-krew").symlink_to(bin_dir / "krew")
    (shims / "kubectl").symlink_to(bin_dir / "kubectl")
    (shims / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    (shims / "python3").chmod(0o755)
    krew_root = tmp_path / "krew"
    env = {
        "PATH": f"{krew_root / 'bin'}:{shims}:/usr/bin:/bin",
        "KREW_ROOT": str(krew_root),
        "HOME": str(tmp_path),
    }

    def kubectl(*args: str) -> str:
        done = subprocess.run(
            ["kubectl", *args], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    kubectl("krew", "install", f"--manifest={plugin.manifest}", f"--archive={plugin.archive}")
    assert (krew_root / "store" / "vramshare" / "v0.1.0" / "LICENSE").is_file()
    shown = kubectl("vramshare", "status", "--kubeconfig", str(stack.kubeconfig), "-o", "json")
    api = {d["spec"]["uuid"] for d in devices(stack).values()}
    assert {g["uuid"] for g in json.loads(shown)["gpus"]} == api
