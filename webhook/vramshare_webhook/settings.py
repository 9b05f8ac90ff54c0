"""The webhook's settings: one dataclass, read from VRAMSHARE_* environment variables.

Each field's environment variable is its name in upper case with the VRAMSHARE_ prefix, e.g.
`denial_code` -> `VRAMSHARE_DENIAL_CODE`. Values are checked at start-up; a wrong one stops the
process with a message naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from vramshare.domain import (
    DEFAULT_ANNOTATION,
    DEFAULT_MAX_GPUS,
    DEFAULT_MAX_MIB,
    Accounting,
    AllocationSettings,
    FairnessSettings,
    Policy,
)
from vramshare.domain.grants import MAX_LASTS_S, MIN_LASTS_S, GrantTerms
from vramshare.domain.tenancy import (
    DEFAULT_PENDING_MIB_PER_NAMESPACE,
    DEFAULT_PENDING_MIB_PER_USER,
    TenancySettings,
)
from vramshare.kube.heartbeat import DEFAULT_CONTROLLER_LEASE, parse_lease_ref
from vramshare.kube.resources import (
    MEMORY_RESOURCE,
    is_extended_resource_name,
    is_object_name,
    is_service_name,
)
from vramshare.logs import LEVELS
from vramshare.settings import check_accounting, from_env, invalid
from vramshare_webhook.delivery_modes import DeliveryMode

MAX_SERVING_VALIDITY_S = 397 * 86400


class TlsMode(StrEnum):
    FILES = "files"
    """VRAMSHARE_TLS_CERT_FILE/_KEY_FILE (a mounted Secret, e.g. cert-manager's), reloaded on change."""
    SECRET = "secret"
    """Read tls.crt/tls.key from the Secret VRAMSHARE_TLS_SECRET through the API and follow its changes."""
    SELF_MANAGED = "self-managed"
    """Make a CA and serving certificate, keep them in that Secret, inject the CA into the webhook
    configuration's caBundle, renew before expiry."""


class RefusalStyle(StrEnum):
    """How a pod that does not fit is refused, chosen for the Airflow component that created it."""

    FORBIDDEN = "forbidden"
    """403: the create fails; the task's own retries (retries, retry_delay) apply."""
    RETRY_AFTER = "retry-after"
    """429 with Retry-After: the KubernetesPodOperator retries the create inside the same try. The
    KubernetesExecutor would pause the creation of every pod until then, GPU or not."""
    REQUEUE = "requeue"
    """403 whose message says "exceeded quota", as a ResourceQuota refusal does: the KubernetesExecutor
    puts the task back in its queue without spending a try (up to [kubernetes_executor]
    task_publish_max_retries; -1 is unlimited) and pauses nothing else."""


EXECUTOR_LABEL = "kubernetes_executor"
"""Airflow's KubernetesExecutor labels its worker pods kubernetes_executor=True."""


@dataclass(frozen=True, kw_only=True)
class WebhookSettings:
    annotation: str = DEFAULT_ANNOTATION
    """The pod annotation carrying the memory request in MiB."""
    max_request_mib: int = DEFAULT_MAX_MIB
    """Larger requests are refused as typos."""
    max_pending_per_namespace: int = 1000
    """At most this many bookings per namespace not yet bound to a pod (0: no limit). A real pod appears
    milliseconds after its admission and is bound within a second or so, even in a burst; a flood of
    forged or failing admissions is bounded by this, each such booking for the reservation TTL."""
    max_pending_mib_per_namespace: int = DEFAULT_PENDING_MIB_PER_NAMESPACE
    """MiB of bookings per namespace whose pods have not appeared yet (0: no bound): what pods that
    never appear (refused after admission, a taken name) can withhold from the fleet, each for the
    reservation TTL. A real pod appears milliseconds after its admission; see "Teams sharing a fleet"."""
    max_pending_mib_per_user: int = DEFAULT_PENDING_MIB_PER_USER
    """The same per user (the creator of the pod as the API server authenticated it); 0: no bound."""
    max_holds_per_namespace: int = 1
    """Refuse mode's holds per namespace at most (each counted against its quota); 0: none."""
    wait_for_other_gates: bool = True
    """A GPU pod another admission system holds (a scheduling gate other than vramshare's at creation,
    or Kueue's label kueue.x-k8s.io/queue-name) books nothing while it is held: it waits behind
    vramshare's gate too and is placed once vramshare's gate is its last (Kueue admitted it). Pods with
    several GPUs, and delivery modes cdi and volume-mounts, are booked at admission as before."""
    memory_resource: str = MEMORY_RESOURCE
    """The extended resource each admitted pod requests (its MiB, all GPUs together), which the
    controller advertises in each GPU node's capacity: a ResourceQuota on requests.<it> is the
    namespace's GPU-memory quota. Empty: pods get no such request and no quota applies."""
    max_gpus_per_pod: int = DEFAULT_MAX_GPUS
    """The most GPUs one pod may ask for with the annotation gpu-count (all on one node)."""
    policy: Policy = Policy.SPREAD
    """spread (the GPU with the most headroom) or binpack (the least that fits); shared with the
    controller's queue."""
    near_tie_mib: int = 512
    """GPUs within this of the policy's best count as tied; ties go to this replica's own preferred
    GPU, so replicas deciding at once rarely pick the same one and conflict. 0: the strict policy."""
    identity: str = ""
    """This replica's name (the chart sets the pod name); defaults to hostname-pid."""
    grant_pods: int = 0
    """Grants (`vramshare.domain.grants`): a replica that books a pod on a GPU also takes room there for
    this many more pods of its size (at most a quarter of the room left), in `namespace`, and books its
    next pods inside it with a create alone, no ledger token bump. Other replicas count the grant's
    unused part as booked until it is given back (idle for grant_idle_s, or at shutdown) or lapses.
    0: no grants."""
    grant_lasts_s: float = 15.0
    """A grant lasts this long unrenewed (renewed every third of it); the controller ends it 2 s after."""
    grant_idle_s: float = 10.0
    """A grant nothing was booked in for this long is given back."""
    accounting: Accounting = field(default_factory=Accounting)
    """Shared with the controller: VRAMSHARE_SAFETY_MARGIN_MIB, _SETTLE_S, _MAX_SAMPLE_AGE_S, _STALE_MODE."""
    denial_code: int = 403
    """How pods other than the KubernetesExecutor's are refused by default: 403 (the task's own retries
    apply) or 429 (retryAfterSeconds; the KubernetesPodOperator retries the create in the try)."""
    executor_refusal: RefusalStyle = RefusalStyle.REQUEUE
    """How the KubernetesExecutor's worker pods (label kubernetes_executor=True) are refused by
    default: requeue, forbidden or retry-after (see RefusalStyle)."""
    refusal_annotation: str = "gpu-refusal"
    """The pod annotation that chooses the refusal for one pod: forbidden, retry-after or requeue."""
    refusal_namespace_label: str = "vramshare.io/refusal"
    """The namespace label that chooses it for a namespace's pods (the pod's annotation comes first)."""
    retry_after_s: int = 60
    """With 429: the longest Retry-After; the one sent is estimated from how fast memory frees lately."""
    retry_after_min_s: int = 5
    """With 429: the shortest Retry-After sent."""
    hold_min_mib: int = 10_240
    """Refused requests of at least this many MiB get a hold: the GPU closest to fitting them keeps the
    memory that frees on it for their task's next try. 0 turns holds off."""
    max_holds: int = 1
    """At most this many holds at once, fleet-wide: the oldest refused large requests get them."""
    hold_limit_s: float = 900.0
    """How long a hold lasts at most (the controller ends it; shared with it)."""
    queue_by_default: bool = False
    """Queue mode for pods whose namespace and annotation do not say: a pod that does not fit now waits
    behind a scheduling gate until the controller places it, instead of being refused."""
    queue_annotation: str = "gpu-queue"
    """The pod annotation that chooses queue mode for one pod: "true" or "false"."""
    queue_namespace_label: str = "vramshare.io/queue"
    """The namespace label that chooses queue mode for a namespace: "true" or "false"."""
    guardrails_by_default: bool = True
    """Tell the frameworks in admitted pods their memory budget (TF_FORCE_GPU_ALLOW_GROWTH,
    XLA_PYTHON_CLIENT_MEM_FRACTION, VRAMSHARE_GPU_MEMORY_MIB/_FRACTION, the MPS limit on MPS nodes)
    unless the pod's annotation gpu-guardrails or its namespace label vramshare.io/guardrails says
    "false"."""
    hide_gpus: bool = True
    """Give pods without the annotation NVIDIA_VISIBLE_DEVICES=void (only managed namespaces reach it)."""
    delivery_mode: DeliveryMode = DeliveryMode.RUNTIME_CLASS
    """How the booked GPU reaches the container (see vramshare_webhook.delivery_modes): env (the variable
    alone: NVIDIA's runtime is the nodes' default), runtime-class (also the pod's runtimeClassName:
    GPU Operator 25.10+, whose default runtime is runc), cdi (NVIDIA's NRI plugin reads the devices
    from a pod annotation) or volume-mounts (device-list mounts, for toolkits that refuse the variable
    from unprivileged containers). A namespace's label vramshare.io/delivery chooses for its pods.
    runtime-class by default: it delivers on GPU Operator 25.10+ with its defaults (runc the default
    runtime, where env gives no GPU) and on every earlier release (each creates the class nvidia)."""
    runtime_class_name: str = "nvidia"
    """The RuntimeClass whose handler is NVIDIA's runtime (delivery mode runtime-class)."""
    device_list_claim: str = ""
    """Delivery mode volume-mounts: the PersistentVolumeClaim, in each GPU pod's namespace, bound to a
    PersistentVolume whose hostPath is /dev/null (namespaces whose Pod Security forbids hostPath
    volumes); empty: a hostPath volume of /dev/null in the pod."""
    decision_deadline_s: float = 8.0
    """The whole answer's deadline: past it the webhook refuses and withdraws whatever it booked, so
    nothing stays booked for a request the API server gave up on. Keep it below timeoutSeconds."""
    reinvocation_window_s: float = 30.0
    """A reinvocation (a later webhook changed the pod) keeps the first pass's booking only while that
    booking is younger than this, unbound and untaken; keep it at least timeoutSeconds."""
    shutdown_delay_s: float = 3.0
    """On SIGTERM: how long the webhook keeps answering, already not ready, so the Service's
    endpoints drop it before it stops listening (in-flight answers are then finished, within the
    decision deadline). The chart's preStop sleep comes before this."""
    host: str = "0.0.0.0"
    """The address the webhook listens on."""
    port: int = 8443
    """The HTTPS port the webhook listens on (the chart's webhook.port)."""
    metrics_port: int = 0
    """A port of its own for /metrics (plain HTTP): a NetworkPolicy can then let Prometheus scrape it
    without reaching /mutate. 0: /metrics only on the HTTPS port, beside /mutate."""
    tls_mode: TlsMode = TlsMode.FILES
    """files (tls_cert_file and tls_key_file, reloaded when they change), secret (tls_secret, kept by
    someone else) or self-managed (the webhook issues its certificate into tls_secret and keeps the
    caBundle)."""
    tls_cert_file: str = ""
    """Mode files: the serving certificate (PEM), reloaded when the file changes."""
    tls_key_file: str = ""
    """Mode files: the serving certificate's private key (PEM)."""
    tls_secret: str = "vramshare-webhook-tls"
    """Modes secret and self-managed: the TLS Secret in `namespace`."""
    tls_names: str = ""
    """Comma-separated DNS names and IPs the API server reaches the webhook by (self-managed mode)."""
    tls_serving_validity_s: float = 365 * 86400.0
    """Lifetime of a self-managed serving certificate; it is renewed when a third of it is left."""
    tls_ca_validity_s: float = 3650 * 86400.0
    """Lifetime of the self-managed CA. When it would not outlive the next serving certificate a new CA
    is made; the caBundle holds old and new together until the old one expires."""
    tls_sync_interval_s: float = 30.0
    """How often the Secret and the caBundle are checked."""
    client_ca_file: str = ""
    """PEM file of the CA that signed the client certificate the API server presents to admission
    webhooks (its AdmissionConfiguration's kubeconfig). Set: /mutate answers only a caller presenting a
    certificate this CA signed (with a name in client_names), and refuses any other with 403 before
    reading its review, so a forged review books nothing. Empty: any caller that reaches the port."""
    client_names: str = ""
    """Comma-separated common names (or DNS names) accepted from certificates client_ca_file signed;
    empty: any it signed."""
    webhook_configuration: str = "vramshare"
    """The MutatingWebhookConfiguration whose caBundle the self-managed mode keeps."""
    namespace: str = "vramshare"
    """The webhook's own namespace (where its TLS Secret lives); the chart sets it from the pod."""
    controller_lease: str = ""
    """`<namespace>/<name>` of the controller's Lease, which carries the inventory heartbeat (the
    sample time of GPUs whose figures did not change); empty: `<namespace>/vramshare-controller`."""
    replica_lease_s: float = 0.0
    """Each replica renews a Lease of its own every third of this, in `namespace`, so the replicas up
    deal GPUs that tie out among themselves and rarely race for the same one (vramshare.domain.shards);
    a replica not seen renewing for this long is taken to be gone (15 is a good value). 0, the default:
    no Lease, no dealing (each replica breaks ties by its own hashed preference). Off by default
    because it needs the right to write Leases whose names are not known ahead (see the chart)."""
    replica_service: str = ""
    """The webhook's own Service, in `namespace`: the pods ready behind it (its EndpointSlices) are
    the replicas up, among which GPUs that tie are dealt out. Read-only (list and watch
    EndpointSlices); each replica's `identity` must be its pod's name. The chart sets both. Empty: no
    dealing this way (see replica_lease_s for replicas not behind a Service)."""
    kubeconfig: str = ""
    """Empty: the in-cluster service account."""
    log_level: str = "info"
    """debug, info, warning or error (one JSON object per line on stdout)."""

    @property
    def allocation(self) -> AllocationSettings:
        return AllocationSettings(
            policy=self.policy, accounting=self.accounting, near_tie_mib=self.near_tie_mib
        )

    @property
    def grants(self) -> GrantTerms:
        return GrantTerms(pods=self.grant_pods, lasts_s=self.grant_lasts_s, idle_s=self.grant_idle_s)

    @property
    def fairness(self) -> FairnessSettings:
        return FairnessSettings(hold_min_mib=self.hold_min_mib, hold_limit_s=self.hold_limit_s)

    @property
    def tenancy(self) -> TenancySettings:
        return TenancySettings(
            max_pending_mib_per_namespace=self.max_pending_mib_per_namespace,
            max_pending_mib_per_user=self.max_pending_mib_per_user,
            max_holds_per_namespace=self.max_holds_per_namespace,
        )

    @property
    def default_refusal(self) -> RefusalStyle:
        return RefusalStyle.RETRY_AFTER if self.denial_code == 429 else RefusalStyle.FORBIDDEN

    @property
    def client_name_list(self) -> frozenset[str]:
        return frozenset(n.strip() for n in self.client_names.split(",") if n.strip())

    def retry_hint_after(self, retry_after_s: int, style: RefusalStyle | None = None) -> str:
        """The refusal's last sentence: how the task will be retried."""
        match style or self.default_refusal:
            case RefusalStyle.RETRY_AFTER:
                return f"The pod was not created; retry after {retry_after_s} s (Airflow retries the task)."
            case RefusalStyle.REQUEUE:
                # "exceeded quota" is what the KubernetesExecutor looks for to re-queue the task.
                return (
                    "The pod was not created: GPU memory exceeded quota for now; the KubernetesExecutor "
                    "re-queues the task without spending a try."
                )
            case _:
                return "The pod was not created; Airflow retries the task after its retry_delay."

    def validate(self) -> WebhookSettings:
        if self.log_level.lower() not in LEVELS:
            raise invalid("log_level", self.log_level, ", ".join(LEVELS))
        if self.denial_code not in (403, 429):
            raise invalid("denial_code", self.denial_code, "403 or 429")
        if not 0 <= self.metrics_port <= 65535 or (self.metrics_port and self.metrics_port == self.port):
            accepted = f"0 (on the HTTPS port) or a port other than port ({self.port})"
            raise invalid("metrics_port", self.metrics_port, accepted)
        check_accounting(self.accounting)
        if not 0 < self.decision_deadline_s <= 29:
            raise invalid("decision_deadline_s", self.decision_deadline_s, "seconds between 0 and 29")
        if not 1 <= self.retry_after_min_s <= self.retry_after_s:
            raise invalid(
                "retry_after_min_s", self.retry_after_min_s, f"1 to retry_after_s ({self.retry_after_s})"
            )
        if not 0 <= self.grant_pods <= 1000:
            raise invalid("grant_pods", self.grant_pods, "0 (no grants) to 1000")
        if not MIN_LASTS_S <= self.grant_lasts_s <= MAX_LASTS_S:
            raise invalid(
                "grant_lasts_s", self.grant_lasts_s, f"seconds from {MIN_LASTS_S:g} to {MAX_LASTS_S:g}"
            )
        if not self.grant_idle_s > 0:
            raise invalid("grant_idle_s", self.grant_idle_s, "a positive number of seconds")
        if self.hold_min_mib < 0:
            raise invalid("hold_min_mib", self.hold_min_mib, "0 (no holds) or more MiB")
        if self.max_holds < 0:
            raise invalid("max_holds", self.max_holds, "0 or more")
        if self.hold_limit_s <= 0:
            raise invalid("hold_limit_s", self.hold_limit_s, "a positive number of seconds")
        if self.max_pending_per_namespace < 0:
            raise invalid("max_pending_per_namespace", self.max_pending_per_namespace, "0 (no limit) or more")
        for name in ("max_pending_mib_per_namespace", "max_pending_mib_per_user", "max_holds_per_namespace"):
            if getattr(self, name) < 0:
                raise invalid(name, getattr(self, name), "0 (no bound) or more")
        if self.memory_resource and not is_extended_resource_name(self.memory_resource):
            raise invalid(
                "memory_resource",
                self.memory_resource,
                "empty or an extended resource name such as vramshare.io/gpu-mem-mib (a domain outside "
                "kubernetes.io, a slash, a name)",
            )
        if not is_object_name(self.runtime_class_name):
            raise invalid("runtime_class_name", self.runtime_class_name, "a RuntimeClass name")
        if self.device_list_claim and not is_object_name(self.device_list_claim):
            raise invalid(
                "device_list_claim", self.device_list_claim, "empty or a PersistentVolumeClaim name"
            )
        if not 1 <= self.max_gpus_per_pod <= 64:
            raise invalid("max_gpus_per_pod", self.max_gpus_per_pod, "1 to 64")
        if self.near_tie_mib < 0:
            raise invalid("near_tie_mib", self.near_tie_mib, "0 or more MiB")
        if self.replica_lease_s != 0 and not 3 <= self.replica_lease_s <= 300:
            raise invalid("replica_lease_s", self.replica_lease_s, "0 (off) or 3 to 300 seconds")
        if self.replica_service and not is_service_name(self.replica_service):
            raise invalid(
                "replica_service",
                self.replica_service,
                "empty or a Service name (a DNS-1035 label: a-z, 0-9 and -, 63 at most)",
            )
        if self.replica_service and self.replica_lease_s:
            raise invalid(
                "replica_lease_s",
                self.replica_lease_s,
                "0 while replica_service is set: the replicas up come from one of them, not both",
            )
        if not 0 <= self.shutdown_delay_s <= 60:
            raise invalid("shutdown_delay_s", self.shutdown_delay_s, "0 to 60 seconds")
        if self.reinvocation_window_s <= 0:
            raise invalid("reinvocation_window_s", self.reinvocation_window_s, "a positive number of seconds")
        if self.tls_mode is TlsMode.FILES and not (self.tls_cert_file and self.tls_key_file):
            raise invalid(
                "tls_cert_file",
                self.tls_cert_file,
                "both VRAMSHARE_TLS_CERT_FILE and VRAMSHARE_TLS_KEY_FILE in the files TLS mode",
            )
        if self.tls_mode is TlsMode.SELF_MANAGED and not self.tls_name_list:
            raise invalid(
                "tls_names", self.tls_names, "the DNS names or IPs the webhook is reached by, comma-separated"
            )
        if not 60 <= self.tls_serving_validity_s <= MAX_SERVING_VALIDITY_S:
            raise invalid(
                "tls_serving_validity_s",
                self.tls_serving_validity_s,
                f"60 to {MAX_SERVING_VALIDITY_S:g} seconds (397 days, the most browsers and most policies "
                "accept for a serving certificate)",
            )
        if self.controller_lease:
            try:
                parse_lease_ref(self.controller_lease)
            except ValueError:
                raise invalid(
                    "controller_lease", self.controller_lease, "<namespace>/<name> of the controller's Lease"
                ) from None
        if self.tls_ca_validity_s <= self.tls_serving_validity_s:
            raise invalid(
                "tls_ca_validity_s",
                self.tls_ca_validity_s,
                f"more seconds than tls_serving_validity_s ({self.tls_serving_validity_s:g})",
            )
        return self

    @property
    def lease_ref(self) -> tuple[str, str]:
        """(namespace, name) of the controller's Lease."""
        if not self.controller_lease:
            return self.namespace, DEFAULT_CONTROLLER_LEASE
        return parse_lease_ref(self.controller_lease)

    @property
    def tls_name_list(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.tls_names.split(",") if n.strip())

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WebhookSettings:
        settings = from_env(cls(), env).validate()
        if not settings.identity:
            settings = replace(settings, identity=f"{socket.gethostname()}-{os.getpid()}")
        return settings
