"""Every product module sits in a layer of the import-linter contracts (pyproject.toml): a new module
that no layer names is not checked by them, so it fails here until the contracts say where it goes."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"vramshare": ROOT / "operator", "vramshare_webhook": ROOT / "webhook"}


def modules() -> list[str]:
    found = []
    for package, base in PACKAGES.items():
        for path in (base / package).rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append(".".join(parts))
    return sorted(found)


def layered() -> set[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    named: set[str] = set()
    for contract in contracts:
        if contract["type"] != "layers":
            continue
        containers = contract.get("containers", [""])
        for layer in contract["layers"]:
            for name in (n.strip() for n in layer.replace(":", "|").split("|")):
                named |= {f"{c}.{name}" if c else name for c in containers}
    return named


def test_every_module_is_in_a_layer() -> None:
    named = layered()
    roots = set(PACKAGES)

    def covered(module: str) -> bool:
        return module in roots or any(module == n or module.startswith(f"{n}.") for n in named)

    assert [m for m in modules() if not covered(m)] == []


def test_every_webhook_module_is_in_a_layer_of_the_webhook() -> None:
    """Inside the webhook too, not only the webhook as a whole."""
    named = {n for n in layered() if n.startswith("vramshare_webhook.")}
    inside = [m for m in modules() if m.startswith("vramshare_webhook.")]
    assert [m for m in inside if not any(m == n or m.startswith(f"{n}.") for n in named)] == []
    admission = [m for m in inside if m.startswith("vramshare_webhook.admission.")]
    assert [m for m in admission if m not in named] == []
