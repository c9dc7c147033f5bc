"""weightcache.units: the one formatter of sizes and ages, and the parser of sizes."""

from __future__ import annotations

import pytest

from weightcache.units import format_age, format_bytes, parse_size


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B" and format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(4096) == "4.0 KiB"
    assert format_bytes(1 << 20) == "1.0 MiB" and format_bytes(3 << 30) == "3.0 GiB"
    assert format_bytes(5 << 40) == "5.0 TiB" and format_bytes(2048 << 40) == "2048.0 TiB"
    assert format_bytes(-1536) == "-1.5 KiB"


def test_format_age() -> None:
    assert [format_age(s) for s in (0, 42, 119)] == ["0s", "42s", "119s"]
    assert [format_age(s) for s in (120, 600, 7199)] == ["2m", "10m", "120m"]
    assert [format_age(s) for s in (7200, 9000, 172799)] == ["2.0h", "2.5h", "48.0h"]
    assert format_age(259200) == "3.0d"


def test_parse_size_round_trips_the_formatter() -> None:
    assert parse_size("512") == 512 and parse_size("64K") == 65536 and parse_size("1.5GiB") == 3 << 29
    assert parse_size(" 40g ") == 40 << 30 and parse_size("2TB") == 2 << 40
    for n in (1536, 3 << 30, 5 << 40):
        assert parse_size(format_bytes(n).replace(" ", "")) == n
    for bad in ("", "G", "abc", "-1G", "0", "nan", "inf"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
