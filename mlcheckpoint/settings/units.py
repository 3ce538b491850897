"""Sizes and rates as people write them: "8GiB", "1.5T", "100MB/s", "1Gbit", "auto"."""

from __future__ import annotations

import re

from ..errors import ConfigError

# Binary for the bare letters and the -iB forms (like mount's size=8g); SI for KB, MB, GB, TB.
_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3,
          "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object, setting: str) -> int:
    """A positive byte count from an int or a string such as "8589934592", "8G", "8GiB",
    "8GB" or "1.5T" (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB of 1000)."""
    number = _size_of(value)
    if number is None or not 1 <= number < float("inf"):
        raise ConfigError(
            f"{setting}={value!r} is not a size: give a positive number of bytes, optionally "
            "with a unit: K, M, G, T or KiB, MiB, GiB, TiB (powers of 1024), or KB, MB, GB, TB "
            "(powers of 1000), e.g. 8GiB")
    return int(number)


def _size_of(value: object) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None or m[2].lower() not in _UNITS:
        return None
    unit = _UNITS[m[2].lower()]
    return int(m[1]) * unit if m[1].isdigit() else float(m[1]) * unit


# Rates: the byte units above, or bits (always powers of 1000, as networks count), each with
# an optional "/s" ("100MB/s", "1Gbit", "800Mbit/s", "10Gbps").
_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
         "bps": 1, "kbps": 10**3, "mbps": 10**6, "gbps": 10**9, "tbps": 10**12}
_UNCAPPED = ("none", "unlimited", "off")


def parse_bandwidth(value: object, setting: str) -> int | str:
    """A replication bandwidth budget: bytes per second (an int, or a string such as
    "125000000", "100MB/s", "1Gbit", "800Mbit/s"), 0 (also "none", "unlimited") for no cap,
    or "auto" for the default derived from the link (replication/core/budget.py)."""
    word = value.strip().lower() if isinstance(value, str) else None
    if word == "auto":
        return "auto"
    if word in _UNCAPPED:
        return 0
    number = _size_of(value) if word is None else _rate_of(word.removesuffix("/s"))
    if number is None or not 0 <= number < float("inf") or 0 < number < 1:
        raise ConfigError(
            f"{setting}={value!r} is not a bandwidth: give bytes per second (e.g. 125000000), "
            "optionally with a unit: 100MB/s, 1.5GB/s (bytes; K/M/G/T and KiB/MiB/GiB are "
            "powers of 1024, KB/MB/GB of 1000) or 1Gbit, 800Mbit/s, 10Gbps (bits); 0, none or "
            "unlimited for no cap; auto for the default (a share of the interface's speed)")
    return int(number)


def _rate_of(text: str) -> int | float | None:
    m = _SIZE_RE.match(text)
    if m is not None and m[2] in _BITS:
        return float(m[1]) * _BITS[m[2]] / 8
    return _size_of(text)
