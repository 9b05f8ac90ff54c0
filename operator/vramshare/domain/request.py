"""Reading a pod's memory request from its annotation, strictly.

The annotation is typed by people in DAG files; anything other than a plain positive whole number of
MiB is refused with a message that names the annotation, the value and the accepted form, because a
silently misread request (1.5 -> 1, 1e3 -> 1000) books the wrong GPU.
"""

from __future__ import annotations

import re

DEFAULT_ANNOTATION = "gpu-mem-mb"
DEFAULT_MAX_MIB = 1024 * 1024
"""1 TiB: larger than any single GPU sold today, small enough to catch typos of extra digits."""

_WHOLE_NUMBER = re.compile(r"[0-9]+", re.ASCII)
_SHOWN_CHARS = 40


class InvalidRequestError(ValueError):
    """The annotation's value is not an acceptable memory request; `str()` is the user's message."""

    def __init__(self, *, annotation: str, value: str, problem: str, max_mib: int) -> None:
        self.annotation = annotation
        self.value = value
        shown = value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "..."
        super().__init__(
            f'annotation "{annotation}" has value {shown!r}: {problem}; '
            f'expected a positive whole number of MiB between 1 and {max_mib}, for example "4096"'
        )


def parse_memory_request(
    value: str, *, annotation: str = DEFAULT_ANNOTATION, max_mib: int = DEFAULT_MAX_MIB
) -> int:
    """The MiB asked for by an annotation value, or `InvalidRequestError`."""

    def refuse(problem: str) -> InvalidRequestError:
        return InvalidRequestError(annotation=annotation, value=value, problem=problem, max_mib=max_mib)

    text = value.strip()
    if not text:
        raise refuse("it is empty")
    if not _WHOLE_NUMBER.fullmatch(text):
        if re.fullmatch(r"[+-]?[0-9]*[.,eE][0-9eE.,+-]*", text):
            raise refuse("it is not a whole number (no decimals, exponents or separators)")
        if text.startswith("-"):
            raise refuse("it is negative")
        raise refuse("it is not a number (units are implied: MiB, write no suffix)")
    if len(text.lstrip("0")) > len(str(max_mib)):
        raise refuse("it is larger than any GPU")
    mib = int(text)
    if mib == 0:
        raise refuse("it is zero")
    if mib > max_mib:
        raise refuse("it is larger than any GPU")
    return mib


COUNT_ANNOTATION = "gpu-count"
DEFAULT_MAX_GPUS = 8
"""The most GPUs one pod may ask for: the most one node usually holds."""


def parse_gpu_count(
    value: str, *, annotation: str = COUNT_ANNOTATION, max_count: int = DEFAULT_MAX_GPUS
) -> int:
    """How many GPUs a pod asks for, from its annotation value; `InvalidRequestError` when it is not a
    whole number between 1 and `max_count`."""
    text = value.strip()
    if _WHOLE_NUMBER.fullmatch(text) and len(text) <= 4 and 1 <= int(text) <= max_count:
        return int(text)
    shown = value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "..."
    raise InvalidCountError(
        f'annotation "{annotation}" has value {shown!r}: expected a whole number of GPUs between 1 and '
        f'{max_count}, for example "2" (each GPU gets the memory the memory annotation asks for)'
    )


class InvalidCountError(ValueError):
    """The GPU-count annotation's value is not acceptable; `str()` is the user's message."""
