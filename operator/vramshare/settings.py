"""Reading VRAMSHARE_* environment variables into settings dataclasses, with errors that name the
variable, the value and what is accepted. Shared by the webhook and the controller.

A field that is itself a settings dataclass (the shared `Accounting`) is read from the same flat
namespace: `accounting.settle_s` is VRAMSHARE_SETTLE_S in both components."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields, is_dataclass, replace
from enum import StrEnum
from typing import Any, TypeVar

from vramshare.domain.accounting import Accounting

T = TypeVar("T")


class SettingsError(ValueError):
    pass


def _accepted(current: object) -> str:
    if isinstance(current, bool):
        return "true or false"
    if isinstance(current, StrEnum):
        return "one of " + ", ".join(m.value for m in type(current))
    if isinstance(current, int):
        return "a whole number"
    if isinstance(current, float):
        return "a number"
    return "text"


def from_env(defaults: T, env: Mapping[str, str] | None = None) -> T:
    """`defaults` (a dataclass instance) with every field whose VRAMSHARE_<NAME> is set replaced."""
    env = os.environ if env is None else env
    changes: dict[str, Any] = {}
    for f in fields(defaults):  # type: ignore[arg-type]
        key = f"VRAMSHARE_{f.name.upper()}"
        current = getattr(defaults, f.name)
        if is_dataclass(current) and not isinstance(current, type):
            changes[f.name] = from_env(current, env)
            continue
        if key not in env:
            continue
        raw = env[key]
        try:
            if isinstance(current, bool):
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                changes[f.name] = raw.lower() in ("true", "1", "yes")
            elif isinstance(current, StrEnum):
                changes[f.name] = type(current)(raw)
            elif isinstance(current, int):
                changes[f.name] = int(raw)
            elif isinstance(current, float):
                changes[f.name] = float(raw)
            else:
                changes[f.name] = raw
        except ValueError:
            raise SettingsError(f"{key}={raw!r} is not valid: expected {_accepted(current)}") from None
    return replace(defaults, **changes)  # type: ignore[type-var]


def variables(defaults: object) -> set[str]:
    """Every VRAMSHARE_* variable `from_env` reads for the settings dataclass `defaults`."""
    out = set()
    for f in fields(defaults):  # type: ignore[arg-type]
        current = getattr(defaults, f.name)
        if is_dataclass(current) and not isinstance(current, type):
            out |= variables(current)
        else:
            out.add(f"VRAMSHARE_{f.name.upper()}")
    return out


def invalid(name: str, value: object, accepted: str) -> SettingsError:
    return SettingsError(f"VRAMSHARE_{name.upper()}={value!r} is not valid: expected {accepted}")


def check_accounting(accounting: Accounting) -> Accounting:
    """The shared accounting settings, or a SettingsError for the first invalid one."""
    for name, value, accepted in accounting.problems():
        raise invalid(name, value, accepted)
    return accounting
