"""A real Kubernetes control plane on loopback, with a fake GPU fleet and Prometheus.

`LocalCluster` starts, on free loopback ports: etcd; kube-apiserver (client-certificate auth, RBAC,
service-account keys); kube-controller-manager; kube-scheduler; kwok managing fake GPU nodes; the fake
DCGM exporter; and Prometheus scraping it every second. It writes an admin kubeconfig, mints client
certificates for any user and groups, keeps each component's log in its work folder, prints the tails
when something fails, and stops everything it started.

    with LocalCluster.start(settings=ClusterSettings()) as cluster:
        print(cluster.kubeconfig)

or from the command line (`make cluster`): `python -m vramshare_e2e.cli`.
"""

from __future__ import annotations

import shutil
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

from vramshare_e2e.certs import CertificateAuthority, CertPair, service_account_keys
from vramshare_e2e.credentials import Credentials
from vramshare_e2e.fake_dcgm import ExporterClient
from vramshare_e2e.fake_nodes import fake_node_objects, fake_nodes_ready, instant_query
from vramshare_e2e.fleet import Fleet, default_fleet
from vramshare_e2e.kubectl import Kubectl
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import ClusterError, Component, eventually, http_ok, say
from vramshare_e2e.tools import prometheus_binary, tools_bin_dir

T = TypeVar("T")
PACKAGE_DIR = Path(__file__).resolve().parent
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
        self._components: dict[str, Component] = {}
        self._cleanups: list[Callable[[], None]] = []
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
        self.credentials = Credentials(
            ca=self.ca, pki_dir=self.pki_dir, workdir=self.workdir, api_url=self.api_url
        )
        self.kubeconfig = self.mint_kubeconfig("admin", groups=("system:masters",), name="admin")
        self._kubectl = Kubectl(binary=bin_dir / "kubectl", kubeconfig=self.kubeconfig)

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
                # The API server authenticates to admission webhooks with a client certificate, as the
                # README tells operators to configure theirs.
                f"--admission-control-config-file={self.credentials.webhook_admission_config()}",
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
        self._components[name] = Component(
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
        for name in self._components:
            if name not in order:
                self._components[name].start()
        for name in self._components:
            if name not in order:
                self._wait_ready(self._components[name])
        if self.settings.with_kwok:
            self.create_fake_nodes()
            self.wait_for(self._fake_nodes_ready, what="fake GPU nodes Ready", timeout_s=60)
        if self.settings.with_controller_manager:
            self.wait_for(
                lambda: self._kubectl.ok("get", "serviceaccount", "default", "-n", "default"),
                what="the default ServiceAccount",
                timeout_s=60,
            )
        if self.settings.with_prometheus:
            self.wait_for(
                self._prometheus_has_fleet, what="Prometheus scraping the fake exporter", timeout_s=60
            )
        say(f"up in {time.monotonic() - started:.1f} s; work folder {self.workdir}")

    def add_component(self, component: Component, *, ready_timeout_s: float | None = None) -> Component:
        """Run `component` as part of the stack: started now and waited for (up to `ready_timeout_s`, by
        default the settings' startup timeout), stopped with the rest, its log tail in the diagnostics."""
        self._components[component.name] = component
        component.start()
        component.wait_ready(timeout_s=ready_timeout_s or self.settings.startup_timeout_s)
        return component

    def component(self, name: str) -> Component:
        return self._components[name]

    def find_component(self, name: str) -> Component | None:
        return self._components.get(name)

    @property
    def components(self) -> list[Component]:
        """Every component of the stack, in the order they were added."""
        return list(self._components.values())

    def on_cleanup(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` at stop(), after every component has stopped (what outlives them: a real node's
        containers and mounts), the last added first."""
        self._cleanups.append(cleanup)

    def start_component(self, name: str) -> None:
        """(Re)start one component and wait until it is ready."""
        component = self._components[name]
        component.start()
        self._wait_ready(component)

    def stop_component(self, name: str, *, kill: bool = False) -> None:
        self._components[name].stop(kill=kill)

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
        self.apply_objects(fake_node_objects(self.settings.fleet))

    def _fake_nodes_ready(self) -> bool:
        return fake_nodes_ready(self.kubectl("get", "nodes", "-o", "json", check=False), self.settings.fleet)

    def _prometheus_has_fleet(self) -> bool:
        """Every GPU's series from every scrape job, whichever exporter family the fleet writes as."""
        series = self.prometheus_query('group by (UUID, job) ({__name__=~"DCGM_.+", UUID!=""})')
        return len(series) == len(self.settings.fleet.all_gpus()) * self.settings.scrape_jobs

    def prometheus_query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result ([] while Prometheus does not answer)."""
        return instant_query(self.prometheus_url, promql)

    # -- Kubernetes access ----------------------------------------------------------------------------

    def mint_client_cert(self, user: str, *, groups: tuple[str, ...] = ()) -> CertPair:
        """A client certificate the API server authenticates as `user` in `groups`."""
        return self.credentials.client_cert(user, groups=groups)

    def mint_kubeconfig(self, user: str, *, groups: tuple[str, ...] = (), name: str | None = None) -> Path:
        """A kubeconfig for `user` in `groups` (for RBAC tests: bind roles to that user or group)."""
        return self.credentials.kubeconfig(user, groups=groups, name=name)

    def service_account_kubeconfig(self, namespace: str, service_account: str) -> Path:
        """A kubeconfig authenticating as a ServiceAccount through a bound token (TokenRequest API), as
        a pod of that ServiceAccount would: for testing the exact permissions of a chart's roles."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").strip()
        return self.credentials.write_kubeconfig(
            f"sa-{namespace}-{service_account}",
            user=f"system:serviceaccount:{namespace}:{service_account}",
            credentials={"token": token},
        )

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None, kubeconfig: Path | None = None
    ) -> str:
        """kubectl as the admin (or with `kubeconfig`): its output; ClusterError when it fails (`check`)."""
        return self._kubectl(*args, check=check, stdin=stdin, kubeconfig=kubeconfig)

    def apply_objects(self, objects: list[dict[str, Any]]) -> None:
        self._kubectl.apply_objects(objects)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create a namespace with its labels in the one write. A label added afterwards reaches the API
        server's namespace cache, which webhook namespaceSelectors are matched against, a moment later,
        and a pod created in that moment is not sent to the webhook at all (a CI run once saw a pod
        admitted without a booking that way)."""
        self.apply_objects(
            [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}]
        )
        return name

    def apply_file(self, path: Path) -> None:
        """Apply a manifest file or folder, waiting for CRDs in it to be Established."""
        self._kubectl.apply_file(path)

    # -- tear-down and reporting --------------------------------------------------------------------

    def diagnostics(self) -> str:
        parts = []
        for c in self._components.values():
            state = "running" if c.running else "stopped"
            parts.append(f"--- {c.name} ({state}), {c.log_path}:\n{c.tail(15)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop every component, all at once, and remove the work folder unless asked to keep it.

        At tear-down nothing is being tested: graceful shutdowns (the webhook's drain, the
        controller's Lease release) have their own tests, so they are not waited for one after the
        other here. Each gets SIGTERM and a few seconds, then SIGKILL."""
        with ThreadPoolExecutor(max_workers=max(1, len(self._components))) as pool:
            list(pool.map(lambda c: c.stop(timeout_s=4.0), reversed(list(self._components.values()))))
        for cleanup in reversed(self._cleanups):  # what outlives its component (a real node's containers)
            cleanup()
        if self._own_workdir and not self.settings.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [c.process.pid for c in self._components.values() if c.process is not None]

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
