"""Parsing the gpu-mem-mb annotation: strict, with messages that name annotation, value and form."""

from __future__ import annotations

import pytest

from vramshare.domain import DEFAULT_MAX_MIB, InvalidRequestError, parse_memory_request

ACCEPTED_FORM = 'expected a positive whole number of MiB between 1 and 1048576, for example "4096"'


@pytest.mark.parametrize(
    ("value", "mib"),
    [("1", 1), ("4096", 4096), (" 512 ", 512), ("0042", 42), (str(DEFAULT_MAX_MIB), DEFAULT_MAX_MIB)],
)
def test_accepts_positive_whole_numbers(value: str, mib: int) -> None:
    assert parse_memory_request(value) == mib


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "it is empty"),
        ("   ", "it is empty"),
        ("abc", "it is not a number (units are implied: MiB, write no suffix)"),
        ("4Gi", "it is not a number (units are implied: MiB, write no suffix)"),
        ("-1", "it is negative"),
        ("0", "it is zero"),
        ("000", "it is zero"),
        ("1.5", "it is not a whole number (no decimals, exponents or separators)"),
        ("1e3", "it is not a whole number (no decimals, exponents or separators)"),
        ("1,024", "it is not a whole number (no decimals, exponents or separators)"),
        ("+5", "it is not a number (units are implied: MiB, write no suffix)"),
        ("\uff14", "it is not a number (units are implied: MiB, write no suffix)"),  # fullwidth 4
        (str(DEFAULT_MAX_MIB + 1), "it is larger than any GPU"),
        ("9" * 5000, "it is larger than any GPU"),
    ],
)
def test_refuses_everything_else_with_a_full_message(value: str, problem: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_memory_request(value)
    message = str(caught.value)
    assert message.startswith('annotation "gpu-mem-mb" has value ')
    assert f": {problem}; " in message
    assert message.endswith(ACCEPTED_FORM)
    assert caught.value.value == value


def test_message_names_a_custom_annotation_and_limit() -> None:
    with pytest.raises(InvalidRequestError, match=r'^annotation "example.com/vram" has value \'x\''):
        parse_memory_request("x", annotation="example.com/vram", max_mib=100)
    with pytest.raises(InvalidRequestError, match="between 1 and 100,"):
        parse_memory_request("101", max_mib=100)


def test_long_values_are_shortened_in_the_message() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_memory_request("x" * 10_000)
    assert len(str(caught.value)) < 300
