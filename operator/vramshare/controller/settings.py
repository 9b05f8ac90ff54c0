"""The controller's settings, read from VRAMSHARE_* environment variables (see vramshare.settings)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from vramshare.airflow_pools import AirflowAccess
from vramshare.controller.leader import LeaseTiming
from vramshare.dcgm_series import valid_node_label
from vramshare.domain import Accounting, AllocationSettings, Policy, QueueSettings
from vramshare.domain.delivery_judgement import MODES
from vramshare.domain.holds import HoldSettings
from vramshare.domain.inventory import InventorySettings
from vramshare.domain.ownership import DevicePluginGpus
from vramshare.domain.pools import PoolBasis, PoolRule
from vramshare.kube.heartbeat import DEFAULT_CONTROLLER_LEASE
from vramshare.kube.resources import MEMORY_RESOURCE, is_extended_resource_name, is_object_name
from vramshare.logs import LEVELS
from vramshare.prometheus import PrometheusAccess
from vramshare.settings import check_accounting, from_env, invalid


@dataclass(frozen=True, kw_only=True)
class ControllerSettings:
    prometheus_url: str = "http://prometheus-server.monitoring.svc"
    """Where DCGM metrics are read: Prometheus' HTTP API (or Thanos, Mimir, a managed Prometheus)."""
    node_label: str = "auto"
    """The DCGM series label holding the Kubernetes node name. `auto`: `hostname` (dcgm-exporter
    4.6.0-4.8.3 and later), else `Hostname` (earlier releases); or name one, e.g. a relabelled `node`,
    or `instance` (host:port, the port is dropped)."""
    metrics_selector: str = ""
    """Extra PromQL label matchers for the DCGM series, e.g. job="dcgm-exporter"."""
    prometheus_ca_file: str = ""
    """An https Prometheus is verified against this CA bundle (default: the system's CAs)."""
    prometheus_insecure_skip_verify: bool = False
    """Do not verify an https Prometheus' certificate."""
    prometheus_bearer_token_file: str = ""
    """Sent as a bearer token, read again for every reading (a rotated token is picked up)."""
    prometheus_basic_auth_username: str = ""
    """Basic auth towards Prometheus: the user (with prometheus_basic_auth_password_file)."""
    prometheus_basic_auth_password_file: str = ""
    """Basic auth towards Prometheus: a file holding the password, read at every reading."""
    prometheus_headers: str = ""
    """Extra headers as a JSON object, e.g. {"X-Scope-OrgID": "ml"} for a Mimir or Cortex tenant."""
    prometheus_query_delay_s: float = 1.0
    """Each reading is evaluated this far in the past, so that samples still on their way into the
    store (Thanos receive, Mimir ingesters) cannot split it. Raise it for remote-write setups."""
    total_drift_tolerance_mib: int = 64
    """A reading whose free + used + reserved differs from the card's pinned total by more is rejected."""
    poll_interval_s: float = 5.0
    """How often the inventory is read from Prometheus."""
    delivery_mode: str = "runtime-class"
    """The webhook's delivery mode (the chart passes the webhook's value): the preflight reports
    whether it can deliver on each GPU's node (GpuDevice status.delivery, an event when it cannot)."""
    runtime_class_name: str = "nvidia"
    """The webhook's runtime class (delivery mode runtime-class)."""
    memory_resource: str = MEMORY_RESOURCE
    """The webhook's memory resource (the chart passes the webhook's value): advertised in each GPU
    node's capacity as the sum of its GPUs' MiB. Empty: not advertised."""
    delivery_check_interval_s: float = 30.0
    """How often the preflight rereads the RuntimeClasses and the GPU Operator's ClusterPolicy."""
    accounting: Accounting = field(default_factory=Accounting)
    """Shared with the webhook: VRAMSHARE_SAFETY_MARGIN_MIB, _SETTLE_S, _MAX_SAMPLE_AGE_S, _STALE_MODE."""
    missing_grace_s: float = 60.0
    """A GPU absent from DCGM's series this long is Missing (no new bookings)."""
    forget_missing_after_s: float = 86_400.0
    """A GPU Missing this long with nothing booked on it is deleted (GpuDevice), with an event. 0: never."""
    reservation_ttl_s: float = 20.0
    """A Reserved reservation whose pod has not appeared by then expires: the pod was rejected after
    vramshare admitted it. Keep it above the webhooks' timeouts; a pod that appears later still gets
    its booking back."""
    bind_wait_s: float = 5.0
    """A queued pod's placement whose pod is seen before it runs is written Bound once it runs, or this
    long after the pod was created, whichever comes first: one status write (Bound with the start
    time) for a pod that starts within it, where binding at first sight wrote twice (issue #31). Other
    bookings are bound in memory at first sight, with no write (issue #45). 0: write at first sight.
    Below the reservation TTL."""
    retention_s: float = 3600.0
    """Released, Expired and Lost reservations are deleted this long after they ended."""
    never_created_retention_s: float = 300.0
    """Bookings whose pod never appeared (Expired, PodNeverCreated) are deleted this long after they
    ended, sooner than retention_s: their event on the GpuReservation says why, and a loop of creates
    refused after admission makes one every time."""
    never_created_kept_per_namespace: int = 50
    """At most this many of those are kept per namespace, the newest; older ones are deleted at the next
    sweep, so no tenant can fill the API server (and the controller's memory) with them."""
    lifecycle_interval_s: float = 10.0
    """How often every reservation is checked (pod events act at once; this catches the rest)."""
    unschedulable_warning_s: float = 60.0
    """A booked pod the scheduler has not placed for this long gets a Warning event and counts in
    vramshare_unschedulable_gpu_pods (its memory is held for a pod that does not run)."""
    policy: Policy = Policy.SPREAD
    """Which fitting GPU a queued pod gets (the webhook's VRAMSHARE_POLICY)."""
    queue_interval_s: float = 2.0
    """How often the queue is planned when nothing wakes it (a pod ending, a reservation released)."""
    queue_positions_shown: int = 10
    """How many of the queue's first entries have their position written to their status. Each
    placement moves every entry behind it one place up, so writing every position cost as many
    writes as the queue was long; the others say that more than this many wait ahead of them."""
    hold_limit_s: float = 900.0
    """How long a hold lasts: queue mode's on one GPU for the head of the queue, refuse mode's for a
    refused large request's next try (ended here, as Expired/HoldLapsed)."""
    airflow_url: str = ""
    """Airflow's API server (Airflow 3, e.g. http://airflow-api-server.airflow.svc:8080) or webserver
    (Airflow 2, REST API v1 with basic auth): the leader keeps the pool airflow_pool's slots in step
    with the fleet. Empty: no pool sync."""
    airflow_pool: str = "NODE_GPU_COUNT"
    """The pool GPU tasks use (Kaapana's name); created when missing."""
    airflow_pool_basis: PoolBasis = PoolBasis.READY_GPUS
    """ready-gpus: one slot per Ready GPU; memory: per Ready GPU, how many tasks of
    airflow_pool_task_mib fit in its memory less the safety margin."""
    airflow_pool_task_mib: int = 8192
    """Basis memory: the typical task's MiB; each Ready GPU gives as many slots as such tasks fit in
    its memory less the safety margin."""
    airflow_pool_min_slots: int = 0
    """Never fewer slots than this."""
    airflow_pool_resync_s: float = 60.0
    """The slots are set again this often even when unchanged (a hand edit is undone)."""
    airflow_username: str = ""
    """The Airflow user that edits the pool (token login at /auth/token, or basic auth on Airflow 2)."""
    airflow_password_file: str = ""
    """A file with the user's password (the chart mounts controller.airflowPool.credentialsSecret)."""
    airflow_ca_file: str = ""
    """An https API server is verified against this CA bundle (default: the system's CAs)."""
    device_plugin_gpus: DevicePluginGpus = DevicePluginGpus.HOLD
    """On a node where NVIDIA's device plugin advertises nvidia.com/gpu (and that is not dedicated to
    vramshare by a label): hold, share the GPUs vramshare holds through the plugin (holder pods in its
    namespace, requesting nvidia.com/gpu: 1 each); exclude, share none of them."""
    holder_image: str = ""
    """The holder pods' image (the chart sets vramshare's own). Empty: no holders are made, and GPUs the
    device plugin hands out are not shared."""
    holder_image_pull_policy: str = "IfNotPresent"
    """The holder pods' imagePullPolicy (Always, IfNotPresent or Never)."""
    holder_host_network: bool = False
    """Holder pods on the node's network (where pods have no route to the API server)."""
    holder_api_server: str = ""
    """host:port of the API server for holder pods, where pods cannot reach the kubernetes Service
    (the chart passes global.apiServer). Empty: the Service."""
    holder_service_account: str = ""
    """The holder pods' ServiceAccount: each writes its GPU's UUID on itself (get and patch on pods in
    the controller's namespace)."""
    holder_priority_class: str = ""
    """The holder pods' PriorityClass (the chart's own: it preempts no one)."""
    holder_runtime_class: str = ""
    """The holder pods' RuntimeClass, the one that gives a container its GPU (NVIDIA's runtime, as for
    device-plugin pods on the cluster). Empty: the node's default runtime."""
    holders_min_idle_per_node: int = 1
    """Held GPUs with nothing booked kept on each node; a booking on the last of them acquires another."""
    holders_max_per_node: int = 0
    """At most this many holders on a node (0: every GPU its device plugin advertises)."""
    holders_max: int = 0
    """At most this many holders in the cluster (0: no limit)."""
    holders_idle_release_s: float = 300.0
    """A held GPU beyond the idle minimum is given back to the device plugin after this long with
    nothing booked on it."""
    namespace: str = "vramshare"
    """The controller's own namespace (its Lease, its events); the chart sets it from the pod."""
    lease_name: str = DEFAULT_CONTROLLER_LEASE
    """The Lease the controller replicas elect their leader by."""
    lease_duration_s: float = 15.0
    """A stand-by takes over a Lease it has seen unchanged for this long (by its own clock)."""
    lease_renew_deadline_s: float = 10.0
    """The leader steps down when it has not renewed for this long: shorter than the duration."""
    lease_retry_period_s: float = 2.0
    """How often the leader renews and a stand-by looks."""
    identity: str = ""
    """This replica's name in the Lease; defaults to hostname-pid."""
    metrics_host: str = "0.0.0.0"
    """The address the metrics endpoint listens on; with hostNetwork the chart sets the pod's IP, so
    replicas sharing a node's network do not also listen on its other addresses."""
    metrics_port: int = 8080
    """The port /metrics is served on."""
    kubeconfig: str = ""
    """A kubeconfig file; empty: the pod's in-cluster service account."""
    log_level: str = "info"
    """debug, info, warning or error (one JSON object per line on stdout)."""

    @property
    def allocation(self) -> AllocationSettings:
        return AllocationSettings(policy=self.policy, accounting=self.accounting)

    @property
    def queue(self) -> QueueSettings:
        return QueueSettings(hold_limit_s=self.hold_limit_s)

    @property
    def prometheus_access(self) -> PrometheusAccess:
        headers: object = {}
        if self.prometheus_headers.strip():
            try:
                headers = json.loads(self.prometheus_headers)
            except ValueError:
                headers = None
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise invalid(
                "prometheus_headers",
                self.prometheus_headers,
                'a JSON object of strings, e.g. {"X-Scope-OrgID": "ml"}',
            )
        return PrometheusAccess(
            ca_file=self.prometheus_ca_file,
            insecure_skip_verify=self.prometheus_insecure_skip_verify,
            bearer_token_file=self.prometheus_bearer_token_file,
            basic_auth_username=self.prometheus_basic_auth_username,
            basic_auth_password_file=self.prometheus_basic_auth_password_file,
            headers=headers,
        )

    @property
    def airflow_pool_rule(self) -> PoolRule:
        return PoolRule(
            basis=self.airflow_pool_basis,
            task_mib=self.airflow_pool_task_mib,
            safety_margin_mib=self.accounting.safety_margin_mib,
            minimum=self.airflow_pool_min_slots,
        )

    @property
    def airflow_access(self) -> AirflowAccess:
        return AirflowAccess(
            url=self.airflow_url,
            username=self.airflow_username,
            password_file=self.airflow_password_file,
            ca_file=self.airflow_ca_file,
        )

    @property
    def lease(self) -> LeaseTiming:
        return LeaseTiming(
            duration_s=self.lease_duration_s,
            renew_deadline_s=self.lease_renew_deadline_s,
            retry_period_s=self.lease_retry_period_s,
        )

    @property
    def holds(self) -> HoldSettings:
        return HoldSettings(
            min_idle_per_node=self.holders_min_idle_per_node,
            max_per_node=self.holders_max_per_node,
            max_total=self.holders_max,
            idle_release_s=self.holders_idle_release_s,
        )

    @property
    def inventory(self) -> InventorySettings:
        return InventorySettings(
            accounting=self.accounting,
            missing_grace_s=self.missing_grace_s,
            forget_missing_after_s=self.forget_missing_after_s,
            total_drift_tolerance_mib=self.total_drift_tolerance_mib,
        )

    def validate(self) -> ControllerSettings:
        if self.log_level.lower() not in LEVELS:
            raise invalid("log_level", self.log_level, ", ".join(LEVELS))
        check_accounting(self.accounting)
        for name in (
            "poll_interval_s",
            "reservation_ttl_s",
            "lease_duration_s",
            "lease_renew_deadline_s",
            "lease_retry_period_s",
            "lifecycle_interval_s",
            "queue_interval_s",
            "unschedulable_warning_s",
            "hold_limit_s",
            "delivery_check_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise invalid(name, getattr(self, name), "a positive number of seconds")
        if not 0 <= self.bind_wait_s < self.reservation_ttl_s:
            raise invalid(
                "bind_wait_s",
                self.bind_wait_s,
                f"0 or more seconds, below reservation_ttl_s ({self.reservation_ttl_s:g})",
            )
        if self.never_created_retention_s < 0:
            raise invalid("never_created_retention_s", self.never_created_retention_s, "0 or more seconds")
        if self.never_created_kept_per_namespace < 0:
            raise invalid(
                "never_created_kept_per_namespace", self.never_created_kept_per_namespace, "0 or more"
            )
        for name in ("holders_min_idle_per_node", "holders_max_per_node", "holders_max"):
            if getattr(self, name) < 0:
                raise invalid(name, getattr(self, name), "a whole number of 0 or more")
        if self.holders_idle_release_s < 0:
            raise invalid("holders_idle_release_s", self.holders_idle_release_s, "0 or more seconds")
        if self.holder_image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise invalid(
                "holder_image_pull_policy", self.holder_image_pull_policy, "Always, IfNotPresent or Never"
            )
        if self.holder_api_server and not self.holder_api_server.rpartition(":")[2].isdigit():
            raise invalid(
                "holder_api_server", self.holder_api_server, "empty or host:port, e.g. 10.0.0.1:6443"
            )
        for name in ("holder_service_account", "holder_priority_class", "holder_runtime_class"):
            if getattr(self, name) and not is_object_name(getattr(self, name)):
                raise invalid(name, getattr(self, name), "empty or an object name (lower case, digits, -, .)")
        if self.queue_positions_shown < 1:
            raise invalid("queue_positions_shown", self.queue_positions_shown, "a whole number of 1 or more")
        if self.delivery_mode not in MODES:
            raise invalid("delivery_mode", self.delivery_mode, ", ".join(MODES))
        if not is_object_name(self.runtime_class_name):
            raise invalid("runtime_class_name", self.runtime_class_name, "a RuntimeClass name")
        if self.memory_resource and not is_extended_resource_name(self.memory_resource):
            raise invalid(
                "memory_resource",
                self.memory_resource,
                "empty or an extended resource name such as vramshare.io/gpu-mem-mib",
            )
        if self.airflow_url and not self.airflow_url.startswith(("http://", "https://")):
            raise invalid(
                "airflow_url", self.airflow_url, "an http:// or https:// URL of Airflow's API server"
            )
        if self.airflow_url and not self.airflow_pool.strip():
            raise invalid("airflow_pool", self.airflow_pool, "the name of an Airflow pool")
        if self.airflow_pool_task_mib <= 0:
            raise invalid("airflow_pool_task_mib", self.airflow_pool_task_mib, "a positive number of MiB")
        if self.airflow_pool_min_slots < 0:
            raise invalid("airflow_pool_min_slots", self.airflow_pool_min_slots, "0 or more")
        if self.airflow_pool_resync_s <= 0:
            raise invalid("airflow_pool_resync_s", self.airflow_pool_resync_s, "a positive number of seconds")
        if self.forget_missing_after_s < 0:
            raise invalid("forget_missing_after_s", self.forget_missing_after_s, "0 (never) or more seconds")
        if self.lease_renew_deadline_s >= self.lease_duration_s:
            raise invalid(
                "lease_renew_deadline_s",
                self.lease_renew_deadline_s,
                f"seconds below lease_duration_s ({self.lease_duration_s:g}), so a leader steps down before "
                "a stand-by may take over",
            )
        if self.lease_retry_period_s >= self.lease_renew_deadline_s:
            raise invalid(
                "lease_retry_period_s",
                self.lease_retry_period_s,
                f"seconds below lease_renew_deadline_s ({self.lease_renew_deadline_s:g})",
            )
        if not valid_node_label(self.node_label):
            raise invalid(
                "node_label",
                self.node_label,
                "auto, or a Prometheus label name (letters, digits and _, not starting with a digit), "
                "e.g. hostname, Hostname, node, instance",
            )
        if self.prometheus_query_delay_s < 0:
            raise invalid("prometheus_query_delay_s", self.prometheus_query_delay_s, "0 or more seconds")
        if self.total_drift_tolerance_mib < 0:
            raise invalid("total_drift_tolerance_mib", self.total_drift_tolerance_mib, "0 or more MiB")
        if not self.prometheus_url.startswith(("http://", "https://")):
            raise invalid("prometheus_url", self.prometheus_url, "an http:// or https:// URL")
        self.prometheus_access  # noqa: B018 (validates prometheus_headers)
        if self.prometheus_basic_auth_username and not self.prometheus_basic_auth_password_file:
            raise invalid(
                "prometheus_basic_auth_password_file",
                self.prometheus_basic_auth_password_file,
                "the file holding the password of prometheus_basic_auth_username",
            )
        if not self.identity:
            return replace(self, identity=f"{socket.gethostname()}-{os.getpid()}")
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ControllerSettings:
        return from_env(cls(), env).validate()
