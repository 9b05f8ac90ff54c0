"""The defaults of a settings dataclass, against which the README's and the demo's tables are checked."""

from __future__ import annotations

from dataclasses import fields, is_dataclass


def defaults(settings: object) -> dict[str, object]:
    """VRAMSHARE_<NAME> -> default, as `vramshare.settings.from_env` reads them (nested dataclasses
    share the flat namespace)."""
    out: dict[str, object] = {}
    for f in fields(settings):  # type: ignore[arg-type]
        value = getattr(settings, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            out |= defaults(value)
        else:
            out[f"VRAMSHARE_{f.name.upper()}"] = value
    return out
