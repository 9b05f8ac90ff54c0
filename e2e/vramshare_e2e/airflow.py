"""A real Apache Airflow next to the local control plane, for the Airflow tests.

Airflow runs from its own cached virtualenv (e2e/tools/airflow.sh), never imported here: its CLI and
its API server are separate processes, and code that must run inside Airflow (the executor's
pod launch) runs as a script in that virtualenv. Its home is a temporary folder with a SQLite
metadata database and the simple auth manager with one user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramshare_e2e.cluster import LocalCluster
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import Component, http_ok

TOOLS = Path(__file__).resolve().parent.parent / "tools"
USER, PASSWORD = "vramshare", "pool-sync-password"


def airflow_bin(flavour: str = "airflow") -> Path:
    """The bin directory of an Airflow virtualenv (`airflow`: Airflow 3; `airflow2`: Airflow 2),
    installed once and cached."""
    out = subprocess.run(
        ["bash", str(TOOLS / "airflow.sh"), flavour], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return Path(out.strip().splitlines()[-1])


def _outside_environ() -> dict[str, str]:
    """This process's environment without its Airflow settings and virtualenv, for an Airflow process."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VIRTUAL_ENV"))}


@dataclass(frozen=True, kw_only=True)
class Airflow:
    bin: Path
    home: Path
    kubeconfig: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment every Airflow process of this home runs with."""
        return {
            **_outside_environ(),
            "PATH": f"{self.bin}:{os.environ.get('PATH', '')}",
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.home / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "false",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
        }

    def run(
        self, *args: str, timeout_s: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """An `airflow` CLI command; its output is returned, whatever its exit status."""
        return subprocess.run(
            [str(self.bin / "airflow"), *args],
            env={**self.env, **(env or {})},
            cwd=self.home,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """An `airflow` CLI command in the background, its output (stdout and stderr) piped."""
        return self._popen([str(self.bin / "airflow"), *args], env=env)

    def start_python(
        self, script: Path, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """A Python script inside Airflow's virtualenv, with this home, in the background."""
        return self._popen([str(self.bin / "python"), str(script), *args], env=env)

    def _popen(self, argv: list[str], *, env: dict[str, str] | None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            argv,
            env={**self.env, **(env or {})},
            cwd=self.home,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def prepare(cluster: LocalCluster, *, home: Path) -> Airflow:
    """An Airflow home with its metadata database made, talking to `cluster`."""
    airflow = Airflow(bin=airflow_bin(), home=home, kubeconfig=cluster.kubeconfig)
    (home / "dags").mkdir(parents=True, exist_ok=True)
    (home / "passwords.json").write_text(json.dumps({USER: PASSWORD}))
    done = airflow.run("db", "migrate")
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{done.stdout[-3000:]}")
    return airflow


def start_api_server(cluster: LocalCluster, airflow: Airflow, *, name: str = "airflow-api-server") -> int:
    """Airflow's API server (REST API v2, token login) as a component of `cluster`; returns its port."""
    port = free_port()
    component = Component(
        name=name,
        argv=[str(airflow.bin / "airflow"), "api-server", "--port", str(port), "--workers", "1"],
        log_path=cluster.logs_dir / f"{name}.log",
        ready=lambda: http_ok(f"http://127.0.0.1:{port}/api/v2/monitor/health"),
        env=airflow.env,
    )
    cluster.add_component(component)
    return port


def api_get(port: int, path: str) -> Any:
    """GET from Airflow's REST API (v2) as the test user."""
    login = urllib.request.Request(
        f"http://127.0.0.1:{port}/auth/token",
        data=json.dumps({"username": USER, "password": PASSWORD}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(login, timeout=10) as resp:
        token = json.loads(resp.read())["access_token"]
    get = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/v2/{path}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(get, timeout=10) as resp:
        return json.loads(resp.read())


def pool_slots(port: int, pool: str) -> int | None:
    """The pool's slots as Airflow's REST API reports them (None: no such pool)."""
    try:
        return int(api_get(port, f"pools/{pool}")["slots"])
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def latest_task_instances(port: int, dag_id: str) -> list[dict[str, Any]]:
    """The task instances of the DAG's latest run, from the REST API (no CLI start-up per call)."""
    runs = api_get(port, f"dags/{dag_id}/dagRuns?order_by=-start_date&limit=1")["dag_runs"]
    run_id = urllib.parse.quote(runs[0]["dag_run_id"], safe="")
    return api_get(port, f"dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]  # type: ignore[no-any-return]


VIEWER = "viewer"
"""An Airflow 2 user who may read pools but not edit them."""


@contextmanager
def airflow2_webserver(home: Path) -> Iterator[str]:
    """Airflow 2's webserver on a free loopback port, its REST API v1 taking basic auth, with an
    Admin user USER and a Viewer user VIEWER (both with PASSWORD); yields its base URL."""
    bin_dir = airflow_bin("airflow2")
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **_outside_environ(),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "false",
        "AIRFLOW__API__AUTH_BACKENDS": "airflow.api.auth.backend.basic_auth,airflow.api.auth.backend.session",
        "AIRFLOW__WEBSERVER__SECRET_KEY": "vramshare-e2e",
        "PYTHONWARNINGS": "ignore",
    }

    def cli(*args: str) -> None:
        done = subprocess.run(
            [str(bin_dir / "airflow"), *args],
            env=env,
            cwd=home,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"airflow {args[0]} {args[1]} failed:\n{done.stdout[-3000:]}")

    cli("db", "migrate")
    cli("sync-perm", "--include-dags")  # makes the roles other than Admin (the webserver would, later)
    for user, role in ((USER, "Admin"), (VIEWER, "Viewer")):
        cli(
            "users",
            "create",
            "-u",
            user,
            "-p",
            PASSWORD,
            "-r",
            role,
            "-f",
            user,
            "-l",
            "e2e",
            "-e",
            f"{user}@e2e",
        )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Component(
        name="airflow2-webserver",
        argv=[str(bin_dir / "airflow"), "webserver", "--port", str(port), "--workers", "1"],
        log_path=home / "webserver.log",
        ready=lambda: http_ok(f"{url}/api/v1/health"),
        env=env,
    )
    server.start()
    try:
        server.wait_ready(timeout_s=120)
        yield url
    finally:
        server.stop()


if __name__ == "__main__":  # print the bin directory (installs Airflow if needed)
    print(airflow_bin(), file=sys.stdout)
