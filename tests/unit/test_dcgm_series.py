"""Reading the corpus of exporter outputs (tests/unit/dcgm_corpus) the way the controller reads
Prometheus: one query, one Sample per GPU, loud about what it cannot use."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.promql_model import Scrape, answer, corpus
from vramshare.dcgm_series import (
    METRIC_LABEL,
    PART_LABEL,
    Cause,
    promql,
    samples_from,
    valid_node_label,
)
from vramshare.domain.inventory import Sample

T = 1_800_000_000.0
A100_BUSY = "GPU-0a1b2c3d-0000-4000-8000-000000000001"
A100_IDLE = "GPU-0a1b2c3d-0000-4000-8000-000000000002"


def read(*scrapes: Scrape, node_label: str = "auto", at: float = T + 5) -> Any:
    results = answer(promql(node_label=node_label), scrapes, at=at, node_label=node_label)
    return samples_from(results, node_label=node_label, evaluated_at=at)


def by_uuid(samples: list[Sample]) -> dict[str, Sample]:
    return {s.uuid: s for s in samples}


@pytest.mark.parametrize("name", ["4.5.3-4.8.2.prom", "4.6.0-4.8.3.prom", "dcgm-4.7-bytes.prom"])
def test_every_exporter_family_reads_as_the_same_two_gpus(name: str) -> None:
    reading = read(Scrape(corpus(name), at=T))
    assert reading.unusable == []
    gpus = by_uuid(reading.samples)
    assert set(gpus) == {A100_BUSY, A100_IDLE}
    busy = gpus[A100_BUSY]
    assert (busy.node, busy.index, busy.model) == ("gpu-a100-1", 0, "NVIDIA A100-SXM4-40GB")
    assert (busy.free_mib, busy.used_mib, busy.driver_reserved_mib) == (30_000, 10_448, 512)
    assert busy.total_mib == 40_960
    assert busy.sampled_at == T
    assert gpus[A100_IDLE].to_gpu().free_mib == 40_448


def test_the_capacity_metric_is_the_total_where_published() -> None:
    text = corpus("dcgm-4.7-bytes.prom").replace("} 42949672960", "} 42949672961", 1)  # 1 byte more
    gpus = by_uuid(read(Scrape(text, at=T)).samples)
    assert gpus[A100_BUSY].capacity_mib == 40_960  # whole MiB, rounded down
    mib_only = by_uuid(read(Scrape(corpus("4.5.3-4.8.2.prom"), at=T)).samples)
    assert mib_only[A100_BUSY].capacity_mib is None  # FB_TOTAL is not collected by default


def test_bytes_that_are_not_whole_mib_round_down() -> None:
    text = (
        corpus("dcgm-4.7-bytes.prom")
        .replace("} 31457280000", "} 31457280001")
        .replace("} 10955522048", "} 10955522047")
    )
    busy = by_uuid(read(Scrape(text, at=T)).samples)[A100_BUSY]
    assert (busy.free_mib, busy.used_mib) == (30_000, 10_447)


def test_a_gpu_reported_in_both_families_is_read_from_the_bytes_alone() -> None:
    """One exporter collecting both namings writes them with the same labels."""
    mib = (
        corpus("4.6.0-4.8.3.prom")
        .replace("} 30000", "} 29000")
        .replace("DCGM_FI_DRIVER", "DCGM_FI_SYSTEM_DRIVER")
    )
    reading = read(Scrape(mib + corpus("dcgm-4.7-bytes.prom"), at=T))
    assert reading.unusable == []
    assert by_uuid(reading.samples)[A100_BUSY].free_mib == 30_000


@pytest.mark.parametrize(
    ("name", "node_label", "node"),
    [
        ("4.5.3-4.8.2.prom", "auto", "gpu-a100-1"),
        ("4.6.0-4.8.3.prom", "auto", "gpu-a100-1"),
        ("4.6.0-4.8.3.prom", "hostname", "gpu-a100-1"),
        ("4.5.3-4.8.2.prom", "Hostname", "gpu-a100-1"),
        ("pod-hostname.prom", "auto", "nvidia-dcgm-exporter-x7k2p"),
    ],
)
def test_the_node_label_maps_series_to_nodes(name: str, node_label: str, node: str) -> None:
    (first, _) = read(Scrape(corpus(name), at=T), node_label=node_label).samples
    assert first.node == node


def test_a_node_label_the_series_lack_is_loud_and_named() -> None:
    reading = read(Scrape(corpus("4.6.0-4.8.3.prom"), at=T), node_label="Hostname")
    assert reading.samples == []
    assert {u.cause for u in reading.unusable} == {Cause.NO_NODE}
    assert "no 'Hostname' label" in reading.unusable[0].detail
    assert "set node_label" in reading.unusable[0].detail


def test_a_relabelled_node_label_and_instance_host_port() -> None:
    target = {"node": "gpu-a100-1", "instance": "gpu-a100-1:9400", "job": "dcgm"}
    scrape = Scrape(corpus("pod-hostname.prom"), at=T, target=target)
    assert {s.node for s in read(scrape, node_label="node").samples} == {"gpu-a100-1"}
    assert {s.node for s in read(scrape, node_label="instance").samples} == {"gpu-a100-1"}


def test_prometheus_operator_relabelled_series_are_one_gpu_each() -> None:
    shape = json.loads(corpus("prometheus-operator.json"))
    attribution = ",".join(f'{k}="{v}"' for k, v in shape["exporter_pod_attribution"].items())
    text = corpus(shape["exposition"]).replace(
        'DCGM_FI_DRIVER_VERSION="580.95.05"}', f'DCGM_FI_DRIVER_VERSION="580.95.05",{attribution}}}'
    )
    reading = read(Scrape(text, at=T, target=shape["target_labels"]))
    assert reading.unusable == []
    gpus = by_uuid(reading.samples)
    assert set(gpus) == {A100_BUSY, A100_IDLE}
    assert gpus[A100_BUSY].node == "gpu-a100-1"  # not the exporter pod, not the exported_pod
    # The pod DCGM attributes the GPU to is the exported one, not the exporter's own (target) pod.
    assert gpus[A100_BUSY].pods == (("airflow", "train-bert-7f9c"),)


def test_the_pods_dcgm_attributes_a_gpu_to_are_read_from_every_series_naming_one() -> None:
    """dcgm-exporter's Kubernetes mapping repeats a GPU's series once per pod it maps the GPU to
    (time-slicing: several), with pod, namespace and container labels; older releases say pod_name and
    pod_namespace. A scrape with no such target labels keeps the plain names."""
    lines = []
    for line in corpus("4.6.0-4.8.3.prom").splitlines():
        if A100_BUSY in line:  # every metric of the GPU, once per pod
            lines.append(line.replace('"}', '",pod="job-a",namespace="ml",container="main"}'))
            line = line.replace('"}', '",pod_name="job-b",pod_namespace="ml"}')
        lines.append(line)
    reading = read(Scrape("\n".join(lines) + "\n", at=T))
    gpus = by_uuid(reading.samples)
    assert gpus[A100_BUSY].pods == (("ml", "job-a"), ("ml", "job-b"))
    assert gpus[A100_IDLE].pods == ()


def test_two_scrape_jobs_on_one_exporter_are_one_gpu_each_from_the_freshest_scrape() -> None:
    text = corpus("4.6.0-4.8.3.prom")
    grown = text.replace("} 30000", "} 28000").replace("} 10448", "} 12448")
    reading = read(
        Scrape(text, at=T, target={"job": "servicemonitor"}),
        Scrape(grown, at=T + 0.4, target={"job": "annotations"}),
    )
    assert reading.unusable == []
    busy = by_uuid(reading.samples)[A100_BUSY]
    assert (busy.free_mib, busy.used_mib, busy.sampled_at) == (28_000, 12_448, T + 0.4)
    assert len(reading.samples) == 2


def test_duplicates_that_disagree_at_the_same_time_are_reported_and_the_least_free_taken() -> None:
    text = corpus("4.6.0-4.8.3.prom")
    other = text.replace("} 30000", "} 29000").replace("} 10448", "} 11448")
    reading = read(
        Scrape(text, at=T, target={"prometheus_replica": "a"}),
        Scrape(other, at=T, target={"prometheus_replica": "b"}),
    )
    busy = by_uuid(reading.samples)[A100_BUSY]
    assert (busy.free_mib, busy.used_mib) == (29_000, 11_448)
    (conflict,) = reading.unusable
    assert conflict.cause is Cause.CONFLICT
    assert A100_BUSY in conflict.detail
    assert "disagree" in conflict.detail


def test_a_mig_gpu_is_one_gpu_with_its_instances_never_a_small_whole_gpu() -> None:
    reading = read(Scrape(corpus("mig-a100.prom"), at=T))
    assert reading.unusable == []
    gpus = by_uuid(reading.samples)
    mig = gpus["GPU-a810a1fc-9f46-0e6f-5cef-bf34c2248e12"]
    assert [(i.profile, i.instance_id, i.used_mib, i.free_mib) for i in mig.mig] == [
        ("3g.20gb", 1, 12, 19_956),
        ("3g.20gb", 2, 8012, 11_956),
    ]
    assert (mig.used_mib, mig.free_mib) == (8024, 31_912)  # the instances' sums, not one instance's
    assert mig.to_gpu().mig_enabled
    whole = gpus["GPU-604c7a18-e7d0-02e0-723a-7578be840651"]
    assert whole.mig == ()
    assert whole.free_mib == 40_448


def test_mig_instances_without_framebuffer_series_are_still_seen_as_mig() -> None:
    reading = read(Scrape(corpus("mig-h100-no-fb.prom"), at=T))
    gpus = by_uuid(reading.samples)
    h100 = gpus["GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77"]
    assert [(i.profile, i.instance_id, i.used_mib) for i in h100.mig] == [
        ("1g.10gb", 7, None),
        ("1g.10gb", 8, None),
        ("1g.10gb", 9, None),
    ]
    assert h100.node == "gsrh100-074"
    assert not gpus["GPU-6b2e1d2c-0000-4000-8000-00000000h101"].mig


def labelled(metric: str, value: float, at: float, **labels: str) -> list[dict[str, Any]]:
    tags = {**labels, METRIC_LABEL: metric}
    return [
        {"metric": {"__name__": metric, **tags}, "value": [T, str(value)]},
        {"metric": {**tags, PART_LABEL: "timestamp"}, "value": [T, str(at)]},
    ]


def test_figures_from_different_scrapes_are_not_one_reading() -> None:
    gpu = {"UUID": "GPU-1", "hostname": "n1", "gpu": "0"}
    results = [
        *labelled("DCGM_FI_DEV_FB_FREE", 2208, T, **gpu),
        *labelled("DCGM_FI_DEV_FB_USED", 28_000, T - 1, **gpu),  # remote write: the older scrape's
    ]
    reading = samples_from(results, evaluated_at=T)
    assert reading.samples == []
    (why,) = reading.unusable
    assert why.cause is Cause.INCONSISTENT
    assert "different scrapes" in why.detail


@pytest.mark.parametrize(
    ("results", "cause"),
    [
        (labelled("DCGM_FI_DEV_FB_FREE", 1, T, UUID="GPU-1", hostname="n"), Cause.INCOMPLETE),
        (labelled("DCGM_FI_DEV_FB_FREE", 1, T, hostname="n"), Cause.NO_UUID),
        (labelled("DCGM_FI_DEV_FB_FREE", float("nan"), T, UUID="GPU-1", hostname="n"), Cause.NOT_A_NUMBER),
    ],
)
def test_unusable_series_say_why(results: list[dict[str, Any]], cause: Cause) -> None:
    reading = samples_from(results, evaluated_at=T)
    assert reading.samples == []
    assert [u.cause for u in reading.unusable] == [cause]


def test_fb_reserved_absent_is_none() -> None:
    text = "\n".join(line for line in corpus("4.6.0-4.8.3.prom").splitlines() if "FB_RESERVED" not in line)
    busy = by_uuid(read(Scrape(text, at=T)).samples)[A100_BUSY]
    assert busy.driver_reserved_mib is None
    assert busy.total_mib == 40_448


def test_the_query_carries_the_selector_and_every_metric_name() -> None:
    query = promql(selector='job="dcgm"', node_label="node")
    assert query.count('job="dcgm"') == 10  # the values, each metric's times, the MIG markers
    assert "DCGM_FI_DEV_FB_CAPACITY_BYTES" in query
    assert "DCGM_FI_DEV_FB_FREE|" in query
    assert "group by (UUID, uuid, GPU_I_ID, GPU_I_PROFILE, node)" in query


@pytest.mark.parametrize(
    ("value", "ok"),
    [("auto", True), ("node", True), ("exported_node", True), ("1x", False), ("a-b", False), ("", False)],
)
def test_node_label_names_are_validated(value: str, ok: bool) -> None:
    assert valid_node_label(value) is ok


@given(
    free=st.integers(min_value=0, max_value=200_000),
    used=st.integers(min_value=0, max_value=200_000),
    offsets=st.lists(
        st.floats(min_value=0, max_value=30, allow_nan=False), min_size=1, max_size=5, unique=True
    ),
)
def test_duplicates_are_never_summed_or_mixed(free: int, used: int, offsets: list[float]) -> None:
    """However many sources repeat one GPU at whatever times, it is one GPU with one source's figures."""
    text = (
        f'DCGM_FI_DEV_FB_FREE{{gpu="0",UUID="GPU-1",hostname="n"}} {free}\n'
        f'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="GPU-1",hostname="n"}} {used}\n'
    )
    scrapes = [Scrape(text, at=T + o, target={"job": f"j{i}"}) for i, o in enumerate(offsets)]
    reading = read(*scrapes, at=T + 60)
    (s,) = reading.samples
    assert (s.free_mib, s.used_mib, s.sampled_at) == (free, used, T + max(offsets))
    assert reading.unusable == []
