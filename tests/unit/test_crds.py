"""The CRD files: valid YAML with the kinds, short names, schemas and printer columns people rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

CRDS = Path(__file__).resolve().parents[2] / "crds"


def load(name: str) -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all((CRDS / name).read_text()))
    assert isinstance(doc, dict)
    return doc


def columns(crd: dict[str, Any]) -> dict[str, str]:
    (version,) = crd["spec"]["versions"]
    return {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}


def schema_field(crd: dict[str, Any], json_path: str) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    node = version["schema"]["openAPIV3Schema"]
    for part in json_path.strip(".").split("."):
        node = node["properties"][part]
    return node  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("file", "kind", "plural", "short", "scope"),
    [
        ("vramshare.io_gpureservations.yaml", "GpuReservation", "gpureservations", "gpures", "Namespaced"),
        ("vramshare.io_gpudevices.yaml", "GpuDevice", "gpudevices", "gpudev", "Cluster"),
    ],
)
def test_crd_identity(file: str, kind: str, plural: str, short: str, scope: str) -> None:
    crd = load(file)
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == f"{plural}.vramshare.io"
    spec = crd["spec"]
    assert spec["group"] == "vramshare.io"
    assert spec["scope"] == scope
    assert spec["names"]["kind"] == kind
    assert short in spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1"
    assert version["served"]
    assert version["storage"]
    assert version["subresources"] == {"status": {}}


def test_reservation_columns_point_at_real_fields() -> None:
    crd = load("vramshare.io_gpureservations.yaml")
    cols = columns(crd)
    assert list(cols)[:9] == ["Pod", "MiB", "Node", "GPU", "Index", "GPUs", "Phase", "Queue", "Age"]
    for name, path in cols.items():
        if name != "Age":
            schema_field(crd, path)  # raises KeyError when a column points nowhere
    assert schema_field(crd, ".status.phase")["enum"] == [
        "Queued",
        "Reserved",
        "Bound",
        "Released",
        "Expired",
        "Lost",
        "Held",
        "Granted",
    ]
    assert schema_field(crd, ".spec.memoryMiB")["minimum"] == 1


def test_device_columns_point_at_real_fields() -> None:
    crd = load("vramshare.io_gpudevices.yaml")
    cols = columns(crd)
    for wanted in ["Node", "Index", "Model", "Total", "Used", "Reserved", "Headroom", "Sampled"]:
        assert wanted in cols
        schema_field(crd, cols[wanted])


def test_schemas_are_structural() -> None:
    """Every object node declares a type; no field relies on x-kubernetes-preserve-unknown-fields."""

    def walk(node: dict[str, Any], where: str) -> None:
        assert "type" in node, f"{where} has no type"
        assert not node.get("x-kubernetes-preserve-unknown-fields"), where
        for key, child in node.get("properties", {}).items():
            if key != "metadata":
                walk(child, f"{where}.{key}")
        if "items" in node:
            walk(node["items"], f"{where}[]")

    for file in CRDS.glob("*.yaml"):
        (version,) = load(file.name)["spec"]["versions"]
        walk(version["schema"]["openAPIV3Schema"], file.name)
