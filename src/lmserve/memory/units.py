"""Byte quantities as people write them: ``parse_bytes("80GiB")`` and ``format_bytes(2**31) == "2.00 GiB"``.

``KiB/MiB/GiB/TiB`` are powers of 1024, ``KB/MB/GB/TB`` powers of 1000, and a bare ``K/M/G/T`` (as in ``80G``) is
binary, i.e. GiB, like Docker's ``--memory 80g``. Used by `lmserve memory`'s flags and report, and by the messages
that quote a size.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parse a byte quantity such as ``"80GiB"``, ``"80GB"``, ``"1.5GiB"``, ``"512KiB"`` or
    ``"100"`` (plain bytes) into an int.

    ``KiB/MiB/GiB/TiB`` are binary, ``KB/MB/GB/TB`` decimal, and a bare ``K/M/G/T`` is binary
    (``"80G"`` == ``"80GiB"``). Units are case-insensitive. Fractions of a byte are rounded down.
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid byte quantity {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid byte quantity {text!r}: must be >= 0")
        return text
    if not isinstance(text, str):
        raise ValueError(f"invalid byte quantity {text!r}: expected a string like '80GiB'")
    m = _BYTES_RE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"invalid byte quantity {text!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, or K/M/G/T meaning KiB/MiB/GiB/TiB)"
        )
    number, unit = m.groups()
    return math.floor(Fraction(number) * _UNITS[unit.lower()])


def format_bytes(n: int | float, *, binary: bool = True) -> str:
    """Human-readable size: ``format_bytes(2**31) == "2.00 GiB"``; ``binary=False`` gives
    decimal units (``"2.15 GB"``). Values under one unit print as whole bytes."""
    base = 1024 if binary else 1000
    units = ("KiB", "MiB", "GiB", "TiB", "PiB") if binary else ("KB", "MB", "GB", "TB", "PB")
    sign = "-" if n < 0 else ""
    value = abs(n)
    if value < base:
        return f"{sign}{value:g} B" if isinstance(value, float) else f"{sign}{value} B"
    scaled = value / base
    exponent = 0
    while scaled >= base and exponent < len(units) - 1:
        scaled /= base
        exponent += 1
    unit = units[exponent]
    return f"{sign}{scaled:.2f} {unit}"

