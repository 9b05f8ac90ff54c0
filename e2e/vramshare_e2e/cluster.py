"""A real Kubernetes control plane on loopback, with a fake GPU fleet and Prometheus.

`LocalCluster` starts, on free loopback ports: etcd; kube-apiserver (client-certificate auth, RBAC,
service-account keys); kube-controller-manager; kube-scheduler; kwok managing fake GPU nodes; the fake
DCGM exporter; and Prometheus scraping it every second. It writes an admin kubeconfig, mints client
certificates for any user and groups, keeps each component's log in its work folder, prints the tails
when something fails, and stops everything it started.

    with LocalCluster.start(settings=ClusterSettings()) as cluster:
        print(cluster.kubeconfig)

or from the command line (`make cluster`): `python -m vramshare_e2e.cluster`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

from vramshare_e2e.certs import CertificateAuthority, CertPair, service_account_keys
from vramshare_e2e.fake_dcgm import ExporterClient
from vramshare_e2e.fleet import Fleet, default_fleet

T = TypeVar("T")
PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = PACKAGE_DIR.parent / "tools" / "build.sh"
KWOK_STAGES = PACKAGE_DIR / "kwok-stages.yaml"
CRDS_DIR = PACKAGE_DIR.parents[1] / "crds"
NVIDIA_RUNTIME_CLASS = {
    "apiVersion": "node.k8s.io/v1",
    "kind": "RuntimeClass",
    "metadata": {"name": "nvidia"},
    "handler": "nvidia",
}
RUN_DURATION_ANNOTATION = "e2e.vramshare.io/run-duration"
EXIT_CODE_ANNOTATION = "e2e.vramshare.io/exit-code"


class ClusterError(RuntimeError):
    """The local control plane could not be started or used; the message carries the logs' tails."""


def say(message: str) -> None:
    print(f"[vramshare cluster] {message}", file=sys.stderr, flush=True)


def eventually(
    check: Callable[[], T],
    *,
    what: str,
    timeout_s: float = 30.0,
    interval_s: float = 0.25,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll `check` until it returns something truthy, and return that; AssertionError on timeout, with
    what `detail` returns then (the state that was not reached, for the failure's reader)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = f"; last seen: {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{seen}")
        time.sleep(interval_s)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: free when checked, but maybe not bound yet (a cluster picks all
its ports before starting any component), so never handed out twice."""


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: an outgoing connection can take a port
    from that range between our check and the server's bind (seen in CI as 'address already in use')."""
    low, high = 10_000, max(10_001, _ephemeral_range()[0])
    # Parallel test workers (pytest-xdist's gw0, gw1, ...) each draw from their own slice, so two
    # clusters starting at once never pick the same port between one's check and its bind.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit() and workers > 1:
        size = (high - low) // workers
        low += int(worker[2:]) * size
        high = low + size
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise ClusterError("no free loopback port found below the ephemeral range")


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


@dataclass(kw_only=True)
class ClusterSettings:
    """What to run and how."""

    fleet: Fleet = field(default_factory=default_fleet)
    workdir: Path | None = None
    """Where certificates, data and logs go; a fresh temporary folder when None."""
    keep_workdir: bool = False
    scrape_interval_s: float = 1.0
    scrape_jobs: int = 1
    """Scrape jobs on the one exporter: 2 is how a ServiceMonitor beside an annotation-based job
    duplicates every series (under another `job` label)."""
    with_scheduler: bool = True
    with_controller_manager: bool = True
    with_kwok: bool = True
    with_prometheus: bool = True
    install_crds: bool = True
    """Apply vramshare's CRDs from crds/ and wait until they are Established."""
    startup_timeout_s: float = 120.0


@dataclass
class Component:
    """One process of the stack: how to start it and how to tell it is ready."""

    name: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        log = self.log_path.open("ab")
        log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it stops its children too
            env=self.env,
        )
        log.close()

    def stop(self, *, timeout_s: float = 10.0, kill: bool = False) -> None:
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        # Reap stragglers in its group (a process that forked and exited first).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.process = None

    def wait_ready(self, *, timeout_s: float) -> None:
        """Until it is ready; ClusterError with its log's tail if it exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return
            if not self.running:
                raise ClusterError(f"{self.name} exited while starting; last log lines:\n{self.tail()}")
            time.sleep(0.2)
        raise ClusterError(
            f"{self.name} was not ready within {timeout_s:g} s; last log lines:\n{self.tail()}"
        )

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text[-lines:])


def http_ok(url: str, *, context: ssl.SSLContext | None = None, expect: str | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            body = resp.read().decode(errors="replace")
            return resp.status == 200 and (expect is None or expect in body)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError, OSError):
        return False


class LocalCluster:
    """A running local control plane. Create with `LocalCluster.start()`; stop with `stop()`."""

    def __init__(self, settings: ClusterSettings, bin_dir: Path) -> None:
        self.settings = settings
        self.bin_dir = bin_dir
        self._own_workdir = settings.workdir is None
        self.workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="vramshare-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs_dir = self.workdir / "logs"
        self.logs_dir.mkdir(exist_ok=True)
        self.pki_dir = self.workdir / "pki"
        self.components: dict[str, Component] = {}
        self.cleanups: list[Callable[[], None]] = []
        """Run at stop(), after the components: what outlives them (a real node's containers, mounts)."""
        self.ca = CertificateAuthority(self.pki_dir)
        self.sa_keys = service_account_keys(self.pki_dir)
        self.ports = {
            name: free_port()
            for name in (
                "etcd",
                "etcd-peer",
                "apiserver",
                "scheduler",
                "controller-manager",
                "kwok",
                "exporter",
                "prometheus",
            )
        }
        self.api_url = f"https://127.0.0.1:{self.ports['apiserver']}"
        self.exporter_url = f"http://127.0.0.1:{self.ports['exporter']}"
        self.prometheus_url = f"http://127.0.0.1:{self.ports['prometheus']}"
        self.fleet_path = self.workdir / "fleet.json"
        settings.fleet.save(self.fleet_path)
        self.exporter = ExporterClient(self.exporter_url)
        self.kubeconfig = self.mint_kubeconfig("admin", groups=("system:masters",), name="admin")

    # -- set-up -------------------------------------------------------------------------------------

    @classmethod
    def start(cls, *, settings: ClusterSettings | None = None) -> LocalCluster:
        settings = settings or ClusterSettings()
        bin_dir = tools_bin_dir()
        attempts = 3 if settings.workdir is None else 1  # a kept work folder holds the failed try's data
        for attempt in range(1, attempts + 1):
            cluster = cls(settings, bin_dir)
            try:
                cluster._start_all()
            except ClusterError as exc:
                cluster.stop()
                # A port checked free can still be bound by another program before our component binds it.
                if "address already in use" not in str(exc) or attempt == attempts:
                    raise
                say(f"a port was taken before its component bound it; starting again on new ports ({exc})")
                continue
            except BaseException:
                cluster.stop()
                raise
            return cluster
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _bin(self, name: str) -> str:
        path = self.bin_dir / name
        if not path.exists():
            raise ClusterError(f"{path} is missing; run e2e/tools/build.sh")
        return str(path)

    def _admin_tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca.cert_path))
        admin = self.pki_dir / "admin.crt"
        ctx.load_cert_chain(str(admin), str(self.pki_dir / "admin.key"))
        return ctx

    def _define_components(self) -> None:
        p, w = self.ports, self.workdir
        serving = self.ca.issue(
            "apiserver",
            common_name="kube-apiserver",
            server_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
            server_ips=("127.0.0.1", "10.0.0.1"),
        )
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        kc = str(self.kubeconfig)
        self._add(
            "etcd",
            [
                self._bin("etcd"),
                "--name=default",
                f"--data-dir={w / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{p['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{p['etcd']}",
                f"--listen-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
                f"--initial-cluster=default=http://127.0.0.1:{p['etcd-peer']}",
                "--unsafe-no-fsync=true",  # tests only: no durability needed, much faster
                "--log-level=warn",
            ],
            ready=lambda: http_ok(f"http://127.0.0.1:{p['etcd']}/health", expect='"health":"true"'),
        )
        self._add(
            "kube-apiserver",
            [
                self._bin("kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
                f"--secure-port={p['apiserver']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",  # the machine may have no default route
                # A loopback advertise address is refused by the endpoint reconciler (1.37); nothing
                # here reaches the API server through the `kubernetes` Service, so turn it off.
                "--endpoint-reconciler-type=none",
                f"--cert-dir={w / 'apiserver'}",
                f"--tls-cert-file={serving.cert_path}",
                f"--tls-private-key-file={serving.key_path}",
                f"--client-ca-file={self.ca.cert_path}",
                "--authorization-mode=Node,RBAC",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.sa_keys.cert_path}",
                f"--service-account-signing-key-file={self.sa_keys.key_path}",
                "--allow-privileged=true",
                # Webhooks behind a Service are called at an endpoint's address: there is no kube-proxy
                # here to route a Service's ClusterIP (the chart's webhook on a real node).
                "--enable-aggregator-routing=true",
                "--profiling=false",
                "--v=1",
            ],
            ready=lambda: http_ok(f"{self.api_url}/readyz", context=self._admin_tls()),
        )
        if self.settings.with_controller_manager:
            self._add(
                "kube-controller-manager",
                [
                    self._bin("kube-controller-manager"),
                    f"--kubeconfig={kc}",
                    f"--authentication-kubeconfig={kc}",
                    f"--authorization-kubeconfig={kc}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={p['controller-manager']}",
                    f"--service-account-private-key-file={self.sa_keys.key_path}",
                    f"--root-ca-file={self.ca.cert_path}",
                    "--use-service-account-credentials=true",
                    "--leader-elect=false",
                    "--v=1",
                ],
                ready=lambda: http_ok(
                    f"https://127.0.0.1:{p['controller-manager']}/healthz", context=unverified
                ),
            )
        if self.settings.with_scheduler:
            self._add(
                "kube-scheduler",
                [
                    self._bin("kube-scheduler"),
                    f"--kubeconfig={kc}",
                    f"--authentication-kubeconfig={kc}",
                    f"--authorization-kubeconfig={kc}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={p['scheduler']}",
                    "--leader-elect=false",
                    "--v=1",
                ],
                ready=lambda: http_ok(f"https://127.0.0.1:{p['scheduler']}/healthz", context=unverified),
            )
        if self.settings.with_kwok:
            self._add(
                "kwok",
                [
                    self._bin("kwok"),
                    f"--kubeconfig={kc}",
                    f"--config={KWOK_STAGES}",
                    "--manage-all-nodes=false",
                    "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                    f"--server-address=127.0.0.1:{p['kwok']}",
                    "--node-lease-duration-seconds=40",
                    "--cidr=10.244.0.0/16",
                    "--node-ip=127.0.0.1",
                ],
                ready=lambda: http_ok(f"http://127.0.0.1:{p['kwok']}/healthz"),
            )
        self._add(
            "fake-dcgm-exporter",
            [
                sys.executable,
                "-m",
                "vramshare_e2e.fake_dcgm",
                f"--fleet={self.fleet_path}",
                f"--port={p['exporter']}",
            ],
            ready=lambda: http_ok(f"{self.exporter_url}/metrics", expect="DCGM_FI_DEV_FB_FREE"),
        )
        if self.settings.with_prometheus:
            config = self.workdir / "prometheus.yml"
            interval = f"{self.settings.scrape_interval_s:g}s"
            config.write_text(
                yaml.safe_dump(
                    {
                        "global": {
                            "scrape_interval": interval,
                            "scrape_timeout": interval,
                            "evaluation_interval": interval,
                        },
                        "scrape_configs": [
                            {
                                "job_name": "dcgm-exporter" + (f"-{n}" if n else ""),
                                "static_configs": [{"targets": [f"127.0.0.1:{p['exporter']}"]}],
                            }
                            for n in range(self.settings.scrape_jobs)
                        ],
                    }
                )
            )
            self._add(
                "prometheus",
                [
                    str(prometheus_binary()),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={w / 'prometheus'}",
                    f"--web.listen-address=127.0.0.1:{p['prometheus']}",
                    "--storage.tsdb.retention.time=2h",
                    "--log.level=warn",
                ],
                ready=lambda: http_ok(f"{self.prometheus_url}/-/ready"),
            )

    def _add(self, name: str, argv: list[str], *, ready: Callable[[], bool]) -> None:
        self.components[name] = Component(
            name=name, argv=argv, log_path=self.logs_dir / f"{name}.log", ready=ready
        )

    def _start_all(self) -> None:
        started = time.monotonic()
        self._define_components()
        order = ["etcd", "kube-apiserver"]
        for name in order:
            self.start_component(name)
        if self.settings.install_crds:
            self.apply_file(CRDS_DIR)
        # As every GPU Operator release creates it (vramshare's default delivery mode names it; the
        # API server refuses pods naming a RuntimeClass that does not exist).
        self.apply_objects([NVIDIA_RUNTIME_CLASS])
        for name in self.components:
            if name not in order:
                self.components[name].start()
        for name in self.components:
            if name not in order:
                self._wait_ready(self.components[name])
        if self.settings.with_kwok:
            self.create_fake_nodes()
            self.wait_for(self._fake_nodes_ready, what="fake GPU nodes Ready", timeout_s=60)
        if self.settings.with_controller_manager:
            self.wait_for(
                lambda: self._kubectl_ok("get", "serviceaccount", "default", "-n", "default"),
                what="the default ServiceAccount",
                timeout_s=60,
            )
        if self.settings.with_prometheus:
            self.wait_for(
                self._prometheus_has_fleet, what="Prometheus scraping the fake exporter", timeout_s=60
            )
        say(f"up in {time.monotonic() - started:.1f} s; work folder {self.workdir}")

    def start_component(self, name: str) -> None:
        """(Re)start one component and wait until it is ready."""
        component = self.components[name]
        component.start()
        self._wait_ready(component)

    def stop_component(self, name: str, *, kill: bool = False) -> None:
        self.components[name].stop(kill=kill)

    def _wait_ready(self, component: Component) -> None:
        component.wait_ready(timeout_s=self.settings.startup_timeout_s)

    def wait_for(self, check: Callable[[], bool], *, what: str, timeout_s: float = 30.0) -> None:
        """Like `eventually`, but a timeout raises ClusterError carrying the components' log tails."""
        try:
            eventually(check, what=what, timeout_s=timeout_s)
        except AssertionError as exc:
            raise ClusterError(f"{exc}\n{self.diagnostics()}") from None

    # -- fake fleet -------------------------------------------------------------------------------

    def create_fake_nodes(self) -> None:
        nodes = []
        for node in self.settings.fleet.nodes:
            if node.real:
                continue  # its kubelet registers it (vramshare_e2e.node)
            nodes.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": node.name,
                        "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                        "labels": node.node_labels(),
                    },
                    "spec": {},
                    "status": {
                        "capacity": {"cpu": "32", "memory": "256Gi", "pods": "250"},
                        "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "250"},
                    },
                }
            )
        self.apply_objects(nodes)

    def _fake_nodes_ready(self) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        try:
            items = json.loads(out)["items"]
        except (ValueError, KeyError):
            return False
        ready = {
            n["metadata"]["name"]
            for n in items
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        }
        return all(node.name in ready for node in self.settings.fleet.nodes if not node.real)

    def _prometheus_has_fleet(self) -> bool:
        """Every GPU's series from every scrape job, whichever exporter family the fleet writes as."""
        series = self.prometheus_query('group by (UUID, job) ({__name__=~"DCGM_.+", UUID!=""})')
        return len(series) == len(self.settings.fleet.all_gpus()) * self.settings.scrape_jobs

    def prometheus_query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return []
        return list(body.get("data", {}).get("result", []))

    # -- Kubernetes access ----------------------------------------------------------------------------

    def mint_client_cert(self, user: str, *, groups: tuple[str, ...] = ()) -> CertPair:
        """A client certificate the API server authenticates as `user` in `groups`."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
        return self.ca.issue(f"user-{safe}", common_name=user, organizations=groups, client=True)

    def mint_kubeconfig(self, user: str, *, groups: tuple[str, ...] = (), name: str | None = None) -> Path:
        """A kubeconfig for `user` in `groups` (for RBAC tests: bind roles to that user or group)."""
        pair = self.mint_client_cert(user, groups=groups)
        if name == "admin":
            shutil.copy(pair.cert_path, self.pki_dir / "admin.crt")
            shutil.copy(pair.key_path, self.pki_dir / "admin.key")
        return self._write_kubeconfig(
            name or pair.cert_path.stem,
            user=user,
            credentials={"client-certificate": str(pair.cert_path), "client-key": str(pair.key_path)},
        )

    def service_account_kubeconfig(self, namespace: str, service_account: str) -> Path:
        """A kubeconfig authenticating as a ServiceAccount through a bound token (TokenRequest API), as
        a pod of that ServiceAccount would: for testing the exact permissions of a chart's roles."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").strip()
        return self._write_kubeconfig(
            f"sa-{namespace}-{service_account}",
            user=f"system:serviceaccount:{namespace}:{service_account}",
            credentials={"token": token},
        )

    def _write_kubeconfig(self, name: str, *, user: str, credentials: dict[str, str]) -> Path:
        path = self.workdir / f"{name}.kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "vramshare-local",
                    "cluster": {"server": self.api_url, "certificate-authority": str(self.ca.cert_path)},
                }
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [
                {"name": "vramshare-local", "context": {"cluster": "vramshare-local", "user": user}}
            ],
            "current-context": "vramshare-local",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None, kubeconfig: Path | None = None
    ) -> str:
        result = subprocess.run(
            [self._bin("kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout if result.returncode == 0 else result.stderr

    def _kubectl_ok(self, *args: str) -> bool:
        return (
            subprocess.run(
                [self._bin("kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                capture_output=True,
                timeout=30,
                check=False,
            ).returncode
            == 0
        )

    def apply_objects(self, objects: list[dict[str, Any]]) -> None:
        self.kubectl(
            "apply",
            "--server-side",
            "--field-manager=vramshare-e2e",
            "-f",
            "-",
            stdin=yaml.safe_dump_all(objects),
        )

    def apply_file(self, path: Path) -> None:
        """Apply a manifest file or folder, waiting for CRDs in it to be Established."""
        self.kubectl("apply", "--server-side", "--field-manager=vramshare-e2e", "-f", str(path))
        files = [path] if path.is_file() else sorted(path.glob("*.yaml"))
        crds = [
            doc["metadata"]["name"]
            for f in files
            for doc in yaml.safe_load_all(f.read_text())
            if doc and doc.get("kind") == "CustomResourceDefinition"
        ]
        if crds:
            self.kubectl(
                "wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{name}" for name in crds]
            )

    # -- tear-down and reporting --------------------------------------------------------------------

    def diagnostics(self) -> str:
        parts = []
        for c in self.components.values():
            state = "running" if c.running else "stopped"
            parts.append(f"--- {c.name} ({state}), {c.log_path}:\n{c.tail(15)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop every component, all at once, and remove the work folder unless asked to keep it.

        At tear-down nothing is being tested: graceful shutdowns (the webhook's drain, the
        controller's Lease release) have their own tests, so they are not waited for one after the
        other here. Each gets SIGTERM and a few seconds, then SIGKILL."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.components))) as pool:
            list(pool.map(lambda c: c.stop(timeout_s=4.0), reversed(list(self.components.values()))))
        for cleanup in reversed(self.cleanups):  # what outlives its component (a real node's containers)
            cleanup()
        if self._own_workdir and not self.settings.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [c.process.pid for c in self.components.values() if c.process is not None]

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            say(f"failed: {exc}\n{self.diagnostics()}")
        self.stop()

    def describe(self) -> str:
        return "\n".join(
            [
                f"kubeconfig:    {self.kubeconfig}",
                f"API server:    {self.api_url}",
                f"Prometheus:    {self.prometheus_url}",
                f"DCGM exporter: {self.exporter_url}/metrics (control API: {self.exporter_url}/fleet)",
                f"logs:          {self.logs_dir}",
                f"try:           {self.bin_dir / 'kubectl'} --kubeconfig {self.kubeconfig} get nodes",
            ]
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run vramshare's local control plane in the foreground.")
    parser.add_argument("--workdir", type=Path, help="keep certificates, data and logs here")
    parser.add_argument("--fleet", type=Path, help="fleet JSON (default: 2 x A100 40GB + 3 x T4)")
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="only build the binaries and install Prometheus where missing, then exit (before parallel "
        "test workers start clusters: they must not both run apt-get)",
    )
    args = parser.parse_args(argv)
    if args.prepare:
        from vramshare_e2e.node import node_images  # here: vramshare_e2e.node imports this module

        try:
            say(f"control-plane binaries in {tools_bin_dir()}; Prometheus at {prometheus_binary()}")
            say(f"real-node images: {', '.join(p.name for p in node_images())}")
        except ClusterError as exc:
            raise SystemExit(f"[vramshare cluster] {exc}") from None
        return
    settings = ClusterSettings(
        workdir=args.workdir,
        keep_workdir=args.workdir is not None,
        fleet=Fleet.load(args.fleet) if args.fleet else default_fleet(),
    )
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with LocalCluster.start(settings=settings) as cluster:
        print(cluster.describe(), flush=True)
        print("Ctrl-C stops everything.", flush=True)
        while not stop:
            for c in cluster.components.values():
                if not c.running:
                    say(f"{c.name} exited; last log lines:\n{c.tail()}")
                    stop = True
            time.sleep(0.5)
    say("stopped")


if __name__ == "__main__":
    main()
