"""policies.units: parse_bytes / format_bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.units import format_bytes, parse_bytes

UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1.5 GiB", 3 * 2**29),
        ("4096", 4096),
        ("  2 kib ", 2048),
        (".5KiB", 512),
        ("1e3", 1000),
        ("2.5e-1 KiB", 256),
        ("0", 0),
        ("7b", 7),
    ],
)
def test_parse_bytes_examples(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_passes_ints_through() -> None:
    assert parse_bytes(12345) == 12345
    assert parse_bytes(0) == 0


def test_parse_bytes_whole_numbers_are_exact_beyond_float_precision() -> None:
    # 2**53 + 1 is not representable as a float; sizes must not be silently rounded.
    assert parse_bytes(str(2**53 + 1)) == 2**53 + 1
    assert parse_bytes(f"{2**53 + 1}KiB") == (2**53 + 1) * 1024


@pytest.mark.parametrize("text", ["-1", "8 XB", "", "abc", "1..5GiB", "GiB", "1 2 GiB", "nan", "inf"])
def test_parse_bytes_rejects_bad_text_and_names_it(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_bytes(text)
    assert repr(text) in str(e.value)
    assert "GiB" in str(e.value)  # lists the allowed units


def test_parse_bytes_rejects_negative_int_bool_and_non_finite() -> None:
    with pytest.raises(ValueError, match="-5"):
        parse_bytes(-5)
    with pytest.raises(ValueError, match="True"):
        parse_bytes(True)
    with pytest.raises(ValueError, match="not finite"):
        parse_bytes("1e400 GiB")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3 * 2**30, "3.0 GiB"),
        (-3 * 2**30, "-3.0 GiB"),
        (2**40, "1.0 TiB"),
        (5 * 2**20 - 1, "5.0 MiB"),
    ],
)
def test_format_bytes_examples(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_precision() -> None:
    assert format_bytes(2**30 + 2**28, precision=2) == "1.25 GiB"
    assert format_bytes(2**30, precision=0) == "1 GiB"


@given(st.integers(min_value=0, max_value=2**70), st.sampled_from(sorted(UNITS)))
@settings(max_examples=150, deadline=None)
def test_parse_whole_number_with_any_unit(k: int, unit: str) -> None:
    assert parse_bytes(f"{k}{unit}") == k * UNITS[unit]
    assert parse_bytes(f"{k} {unit.lower()}") == k * UNITS[unit]


@given(st.integers(min_value=0, max_value=2**60))
@settings(max_examples=200, deadline=None)
def test_format_then_parse_round_trips_within_rounding(n: int) -> None:
    back = parse_bytes(format_bytes(n))
    if n < 1024:
        assert back == n
    else:
        # one decimal of a value >= 1 in its unit: relative error at most 0.05 / 1
        assert abs(back - n) <= 0.05 * n + 1


@given(st.integers(min_value=-(2**50), max_value=2**50))
@settings(max_examples=100, deadline=None)
def test_format_bytes_is_odd(n: int) -> None:
    text = format_bytes(n)
    assert format_bytes(-n) == (text[1:] if text.startswith("-") else ("-" + text if n else text))
