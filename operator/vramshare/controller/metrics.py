"""The controller's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vramshare.metrics_common import register_standard


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        register_standard(self.registry, component="controller")
        gpu = ["node", "uuid"]
        self.total = Gauge(
            "vramshare_gpu_total_mib", "GPU framebuffer memory, MiB.", gpu, registry=self.registry
        )
        self.used = Gauge(
            "vramshare_gpu_used_mib",
            "Used framebuffer memory in the latest sample, MiB.",
            gpu,
            registry=self.registry,
        )
        self.reserved = Gauge(
            "vramshare_gpu_reserved_mib", "Memory of active reservations, MiB.", gpu, registry=self.registry
        )
        self.headroom = Gauge(
            "vramshare_gpu_headroom_mib",
            "Memory a new pod can still be given, MiB.",
            gpu,
            registry=self.registry,
        )
        self.sample_age = Gauge(
            "vramshare_gpu_sample_age_seconds", "Age of the latest DCGM sample.", gpu, registry=self.registry
        )
        self.overused = Gauge(
            "vramshare_gpu_overused_mib",
            "Live usage beyond active reservations plus the margin, MiB (0 when within).",
            gpu,
            registry=self.registry,
        )
        self.state = Gauge(
            "vramshare_gpu_state",
            "1 for the GPU's current state (Ready, Stale, Missing).",
            [*gpu, "state"],
            registry=self.registry,
        )
        self.reservations = Gauge(
            "vramshare_reservations", "Reservations by phase.", ["phase"], registry=self.registry
        )
        self.prometheus_errors = Counter(
            "vramshare_prometheus_query_errors",
            "Failed readings of DCGM metrics from Prometheus.",
            registry=self.registry,
        )
        self.unusable_series = Gauge(
            "vramshare_dcgm_series_unusable",
            "GPUs (or series) in the latest DCGM reading that could not be used, by cause (no-node-label, "
            "incomplete, inconsistent, conflicting-duplicates, unknown-node, total-drift, ...).",
            ["cause"],
            registry=self.registry,
        )
        self.mig_gpus = Gauge(
            "vramshare_mig_gpus",
            "MIG-enabled GPUs in the inventory (shown, never handed to pods).",
            registry=self.registry,
        )
        self.pool_slots = Gauge(
            "vramshare_airflow_pool_slots",
            "The slots vramshare last set on the Airflow pool (the pool sync).",
            ["pool"],
            registry=self.registry,
        )
        self.pool_sync_failures = Counter(
            "vramshare_airflow_pool_sync_failures",
            "Failed attempts to set the Airflow pool's slots (Airflow away or refusing).",
            registry=self.registry,
        )
        self.impostor_pods = Counter(
            "vramshare_impostor_pods",
            "Pods seen carrying a reservation's label without being its pod (ignored, with an event).",
            registry=self.registry,
        )
        self.never_created_trimmed = Counter(
            "vramshare_never_created_records_trimmed",
            "Records of bookings whose pod never appeared, deleted beyond never_created_kept_per_namespace "
            "in their namespace (a loop of creates refused after admission).",
            registry=self.registry,
        )
        self.overbooked_by_late_pods = Counter(
            "vramshare_overbooked_by_late_pods",
            "Pods that appeared after their booking expired onto a GPU booked past its size since.",
            registry=self.registry,
        )
        self.transitions = Counter(
            "vramshare_reservation_transitions",
            "Reservation phase changes by the reason (PodBound: its pod first seen, bound in memory; "
            "PodNeverCreated, GpuMissing, ...).",
            ["phase", "reason"],
            registry=self.registry,
        )
        self.unschedulable_pods = Gauge(
            "vramshare_unschedulable_gpu_pods",
            "Pods with booked GPU memory that the scheduler has not placed for unschedulable_warning_s.",
            registry=self.registry,
        )
        self.queued = Gauge(
            "vramshare_queued_pods", "Pods waiting in the queue for GPU memory.", registry=self.registry
        )
        self.queue_placements = Counter(
            "vramshare_queue_placements",
            "Queued pods placed on a GPU (the gate lifted).",
            registry=self.registry,
        )
        self.poll_seconds = Histogram(
            "vramshare_inventory_poll_seconds",
            "How long one inventory poll took: reading DCGM, judging every GPU, writing what changed.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.poll_step_seconds = Histogram(
            "vramshare_inventory_poll_step_seconds",
            "Where an inventory poll's time goes, by step: read (the Prometheus query and its parsing), "
            "judge (every GPU against its samples and bookings), write (the GpuDevice writes of what "
            "changed), publish (heartbeat, node capacity, these metrics).",
            ["step"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.heartbeat_gpus = Gauge(
            "vramshare_inventory_heartbeat_gpus",
            "GPUs the last poll's inventory heartbeat (on the Lease) confirmed, and those it did not "
            "(not Ready, sampled long before the rest, or a status write that did not land).",
            ["coverage"],
            registry=self.registry,
        )
        self.device_status_writes = Counter(
            "vramshare_gpudevice_status_writes",
            "GpuDevice status writes, by why: changed (the sample's figures, state or conditions), "
            "bookings (only reservedMiB and headroomMiB; held back while webhooks commit on the GPU, "
            "at most 10 s, since every write moves its ledger token under their commits) or refresh "
            "(only the sample time, of a GPU the inventory heartbeat does not confirm, about every "
            "max_sample_age_s / 4, within a budget per poll).",
            ["why"],
            registry=self.registry,
        )
        self.queue_status_writes = Counter(
            "vramshare_queue_status_writes",
            "Writes of a waiting entry's place in the queue to its status (bounded per placement by "
            "queue_positions_shown).",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "vramshare_queue_wait_seconds",
            "How long placed pods waited in the queue.",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200),
            registry=self.registry,
        )
        self.holders = Gauge(
            "vramshare_gpu_holders",
            "Holder pods by state (Acquiring, Holding, Leaving): GPUs vramshare holds through NVIDIA's "
            "device plugin to share them.",
            ["state"],
            registry=self.registry,
        )
        self.holds_acquired = Counter(
            "vramshare_gpu_holds_acquired", "Holder pods created.", registry=self.registry
        )
        self.holds_released = Counter(
            "vramshare_gpu_holds_released",
            "Holder pods deleted after idle_release_s with nothing booked (the GPU given back).",
            registry=self.registry,
        )
        self.holds_lost = Counter(
            "vramshare_gpu_holds_lost",
            "Held GPUs with bookings on them whose holder went (deleted, evicted, preempted, node "
            "drained): the device plugin may hand them out; the bookings stay and are reported.",
            registry=self.registry,
        )
        self.leader = Gauge(
            "vramshare_controller_leader", "1 while this replica holds the lease.", registry=self.registry
        )

    def step_down(self) -> None:
        """Not leading: the leader's gauges go, so only the leader's figures are scraped and summed."""
        self.leader.set(0)
        for gauge in (self.total, self.used, self.reserved, self.headroom, self.sample_age, self.overused):
            gauge.clear()
        self.state.clear()
        self.reservations.clear()
        self.pool_slots.clear()
        self.unschedulable_pods.set(0)
        self.queued.set(0)
        self.holders.clear()
