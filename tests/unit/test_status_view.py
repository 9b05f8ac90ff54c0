"""`vramshare status` rendering: tables, bars, JSON."""

from __future__ import annotations

import json

import yaml

from tests.unit.domain.builders import NOW
from vramshare.domain.freshness import InventoryHeartbeat
from vramshare.kube.heartbeat import ANNOTATION_HEARTBEAT, encode
from vramshare.kube.resources import format_time
from vramshare.status import GpuRow, bar, from_objects, newest_heartbeat, output, render, to_json

DEVICE = {
    "metadata": {"name": "gpu-1234567890abcdef"},
    "spec": {"uuid": "GPU-1234567890abcdef", "nodeName": "gpu-node-a", "index": 1, "model": "A100"},
    "status": {
        "totalMiB": 40960,
        "usedMiB": 10240,
        "reservedMiB": 20480,
        "headroomMiB": 19968,
        "state": "Ready",
        "sampledAt": format_time(NOW - 3),
    },
}
RESERVATION = {
    "metadata": {"name": "train-abc", "namespace": "airflow", "creationTimestamp": format_time(NOW - 300)},
    "spec": {
        "podName": "train",
        "memoryMiB": 20480,
        "nodeName": "gpu-node-a",
        "gpuUUID": "GPU-1234567890abcdef",
        "gpuIndex": 1,
    },
    "status": {"phase": "Bound"},
}


def test_bar_shows_used_then_reserved_then_free() -> None:
    gpu = GpuRow(
        node="n",
        index=0,
        uuid="u",
        model="m",
        state="Ready",
        total_mib=100,
        used_mib=25,
        reserved_mib=50,
        headroom_mib=40,
        sample_age_s=1,
    )
    assert bar(gpu, width=8) == "##++...."
    over = GpuRow(
        node="n",
        index=0,
        uuid="u",
        model="m",
        state="Ready",
        total_mib=100,
        used_mib=75,
        reserved_mib=50,
        headroom_mib=0,
        sample_age_s=1,
    )
    assert bar(over, width=8) == "######.."


def test_tables_name_gpus_and_reservations() -> None:
    text = render(from_objects([DEVICE], [RESERVATION], now=NOW))
    lines = text.splitlines()
    assert lines[0] == "GPUs"
    assert lines[1].split()[:10] == [
        "NODE",
        "IDX",
        "MODEL",
        "UUID",
        "TOTAL",
        "USED",
        "RESERVED",
        "HEADROOM",
        "STATE",
        "SAMPLED",
    ]
    assert lines[2].split()[:10] == [
        "gpu-node-a",
        "1",
        "A100",
        "GPU-12345678…",
        "40960",
        "10240",
        "20480",
        "19968",
        "Ready",
        "3s",
    ]
    assert lines[2].endswith("[######++++++............]")
    reservations = lines[lines.index("Reservations") + 2].split()
    assert reservations == ["airflow", "train", "20480", "gpu-node-a", "1", "GPU-12345678…", "Bound", "5m"]


def test_empty_cluster_says_so() -> None:
    text = render(from_objects([], [], now=NOW))
    assert "No GPUs known (is the controller running?)" in text
    assert "No reservations." in text


def test_json_output() -> None:
    data = json.loads(to_json(from_objects([DEVICE], [RESERVATION], now=NOW)))
    assert data["gpus"][0]["headroom_mib"] == 19968
    assert data["gpus"][0]["sample_age_s"] == 3
    assert data["reservations"][0] == {
        "namespace": "airflow",
        "name": "train-abc",
        "pod": "train",
        "mib": 20480,
        "node": "gpu-node-a",
        "gpu_uuid": "GPU-1234567890abcdef",
        "gpu_index": 1,
        "phase": "Bound",
        "age_s": 300.0,
        "queue_position": None,
        "more_gpus": [],
    }


def test_queued_entries_show_their_position_and_no_gpu() -> None:
    from vramshare.status import from_objects, render

    queued = {
        "metadata": {"name": "big-1", "namespace": "airflow", "creationTimestamp": "2026-11-30T10:00:00Z"},
        "spec": {"podName": "train-big", "memoryMiB": 32768},
        "status": {"phase": "Queued", "queuePosition": 2},
    }
    status = from_objects([], [queued], now=1_800_000_000.0)
    row = status.reservations[0]
    assert (row.phase, row.queue_position, row.gpu_uuid) == ("Queued", 2, "")
    line = render(status).splitlines()[-1]
    assert "train-big" in line
    assert "Queued #2" in line


def test_a_pod_with_several_gpus_is_one_row_listing_them() -> None:
    def member(name: str, uuid: str, index: int) -> dict[str, object]:
        return {
            "metadata": {
                "name": name,
                "namespace": "airflow",
                "creationTimestamp": format_time(NOW - 60),
                "labels": {"vramshare.io/reservation-set": "ddp-abc"},
            },
            "spec": {
                "podName": "ddp",
                "memoryMiB": 8192,
                "nodeName": "gpu-node-a",
                "gpuUUID": uuid,
                "gpuIndex": index,
                "gpuCount": 2,
            },
            "status": {"phase": "Bound"},
        }

    objects = [member("ddp-abc-gpu1", "GPU-bbbb", 3), member("ddp-abc", "GPU-aaaa", 2)]
    status = from_objects([DEVICE], objects, now=NOW)
    (row,) = status.reservations
    assert (row.name, row.gpu_uuid, row.more_gpus) == ("ddp-abc", "GPU-aaaa", (("GPU-bbbb", 3),))
    line = render(status).splitlines()[-1].split()
    assert line[:6] == ["airflow", "ddp", "2x8192", "gpu-node-a", "2,3", "GPU-aaaa,GPU-bbbb"]


def test_wide_and_yaml_outputs() -> None:
    status = from_objects([DEVICE], [RESERVATION], now=NOW)
    wide = output(status, fmt="wide").splitlines()
    header = wide[-2].split()
    assert header[:3] == ["NAMESPACE", "RESERVATION", "POD"]
    assert "GPU-1234567890abcdef" in wide[-1]  # in full
    assert "GPU-12345678…" in output(status, fmt="table")
    data = yaml.safe_load(output(status, fmt="yaml"))
    assert data == json.loads(output(status, fmt="json"))
    assert data["reservations"][0]["name"] == "train-abc"


def test_a_mig_gpu_says_so_in_the_table_and_the_json() -> None:
    mig = json.loads(json.dumps(DEVICE))
    mig["status"]["mig"] = {
        "enabled": True,
        "summary": "2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2)",
        "instances": [{"profile": "3g.20gb", "instanceID": 1}, {"profile": "3g.20gb", "instanceID": 2}],
    }
    status = from_objects([mig], [], now=NOW)
    assert "Ready, MIG" in render(status)
    assert json.loads(to_json(status))["gpus"][0]["mig"] == "2 GPU instances: 3g.20gb (GI 1), 3g.20gb (GI 2)"
    assert from_objects([DEVICE], [], now=NOW).gpus[0].mig == ""


def test_the_delivery_preflight_shows_per_gpu_and_why_a_node_cannot() -> None:
    why = "the GPU Operator's ClusterPolicy cluster-policy has spec.cdi.enabled: true: ..."
    cannot = json.loads(json.dumps(DEVICE))
    cannot["status"]["delivery"] = {
        "mode": "env",
        "result": "CannotDeliver",
        "message": why,
        "modes": [{"mode": "env", "result": "CannotDeliver", "message": why}],
    }
    shown = render(from_objects([cannot, cannot], [], now=NOW))
    header, row = shown.splitlines()[1:3]
    assert "DELIVERY" in header
    assert "CannotDeliver" in row
    # Said once per node and reason, under the table.
    assert shown.count(f"gpu-node-a: delivery mode env cannot deliver: {why}") == 1
    assert json.loads(to_json(from_objects([cannot], [], now=NOW)))["gpus"][0]["delivery"] == "CannotDeliver"
    plain = render(from_objects([DEVICE], [], now=NOW))
    assert "cannot deliver" not in plain


def test_sample_ages_count_from_the_controllers_heartbeat_where_it_confirms_the_gpu() -> None:
    """Issue #31: an unchanged GPU's status is not rewritten; the newest heartbeat on a controller
    Lease dates it, as the webhook dates it."""

    def lease(name: str, beat: InventoryHeartbeat) -> dict[str, object]:
        return {
            "metadata": {
                "name": name,
                "namespace": "vramshare",
                "annotations": {ANNOTATION_HEARTBEAT: encode(beat)},
            }
        }

    old = {**DEVICE, "status": {**DEVICE["status"], "sampledAt": format_time(NOW - 600)}}
    newer = InventoryHeartbeat(sampled_at=NOW - 2, devices_version=7)
    heartbeat = newest_heartbeat(
        [lease("a", InventoryHeartbeat(sampled_at=NOW - 50, devices_version=1)), lease("b", newer)]
    )
    assert heartbeat == newer
    dated = from_objects([old], [], now=NOW, heartbeat=heartbeat)
    assert dated.gpus[0].sample_age_s == 2
    unconfirmed = InventoryHeartbeat(
        sampled_at=NOW - 2, devices_version=7, unconfirmed=frozenset({"GPU-1234567890abcdef"})
    )
    assert from_objects([old], [], now=NOW, heartbeat=unconfirmed).gpus[0].sample_age_s == 600
    assert from_objects([old], [], now=NOW).gpus[0].sample_age_s == 600


def test_gpus_not_shared_say_why_and_a_booked_one_is_called_out() -> None:
    """`vramshare status` tells who else hands a GPU out, once per reason, and calls out a GPU that is
    not shared but still booked: its hold went while tasks ran there (issue #43)."""
    why = "not held: node gpu-node-a advertises nvidia.com/gpu: 8 (NVIDIA's device plugin ...)"

    def not_shared(uuid: str, index: int, reserved: int) -> dict[str, object]:
        device = json.loads(json.dumps(DEVICE))
        device["spec"] |= {"uuid": uuid, "index": index}
        device["status"] |= {
            "state": "NotShared",
            "reservedMiB": reserved,
            "conditions": [{"type": "Ready", "status": "False", "reason": "NotShared", "message": why}],
        }
        return device

    shown = render(from_objects([not_shared("GPU-a", 0, 0), not_shared("GPU-b", 1, 20480)], [], now=NOW))
    assert shown.count(f"not shared (2 GPUs: gpu-node-a/0, gpu-node-a/1): {why}") == 1
    assert "gpu-node-a GPU 1: not shared yet 20480 MiB booked on it" in shown
    assert "GPU 0: not shared yet" not in shown
    assert "not shared" not in render(from_objects([DEVICE], [], now=NOW))


def _pod(name: str, *, label: str = "train-abc", created: float = NOW - 299) -> dict[str, object]:
    return {
        "metadata": {
            "name": name,
            "namespace": "airflow",
            "uid": f"uid-{name}",
            "creationTimestamp": format_time(created),
            "labels": {"vramshare.io/reservation": label},
            "annotations": {"vramshare.io/gpu-uuid": "GPU-1234567890abcdef"},
        },
        "status": {"phase": "Running"},
    }


def test_a_booking_is_shown_bound_where_its_pod_exists_though_nothing_wrote_it() -> None:
    """Issue #45: the controller writes nothing when a booking's pod appears; the object says Reserved
    (the CRD's default) and `vramshare status` shows what the pods say."""
    reserved = {**RESERVATION, "status": {"phase": "Reserved"}}
    shown = from_objects([DEVICE], [reserved], now=NOW, pods=[_pod("train")])
    assert [r.phase for r in shown.reservations] == ["Bound"]
    # Without the pods (a user who may not list them), or with only a copy of its label: as written.
    assert [r.phase for r in from_objects([DEVICE], [reserved], now=NOW).reservations] == ["Reserved"]
    copied = from_objects([DEVICE], [reserved], now=NOW, pods=[_pod("someone-else")])
    assert [r.phase for r in copied.reservations] == ["Reserved"]
    # Ended bookings are shown as written, whatever pod is left.
    released = {**RESERVATION, "status": {"phase": "Released"}}
    assert [
        r.phase for r in from_objects([DEVICE], [released], now=NOW, pods=[_pod("train")]).reservations
    ] == ["Released"]
