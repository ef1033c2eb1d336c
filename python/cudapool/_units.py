"""Byte counts for people and from people: the package's one byte formatter, the unit picking
of the memory summary table (shared with its counts), and the one parser of sizes with units."""

import re
from decimal import Decimal, InvalidOperation
from typing import Optional, Sequence, Tuple, Union

__all__ = ["GIB", "MIB", "format_bytes", "mib_text", "parse_size", "scaled", "unit_of"]

#: Binary units, smallest first.
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
MIB = 1 << 20
GIB = 1 << 30


def scaled(value: int, reference: int, base: int, threshold: int, units: Sequence[str]) -> Tuple[int, str]:
    """``value`` in the unit that suits ``reference``: move one unit up for as long as the
    reference, in the current unit, is at least ``threshold`` (and a larger unit exists).

    The value is divided with floor division at each step; the reference with true
    division, so beyond 2**53 it is a rounded float, as in torch's table: both tables pick
    the same unit for the same numbers, huge ones included."""
    unit = 0
    ref: float = reference
    while unit + 1 < len(units) and ref >= threshold:
        unit += 1
        value //= base
        ref = ref / base
    return value, units[unit]


def format_bytes(n: Optional[int], largest: str = "TiB", reference: Optional[int] = None) -> str:
    """``n`` bytes as text, in binary units up to ``largest``.

    Without ``reference``: "512 B", "1.50 KiB", "12.34 GiB" (the largest unit of which
    ``abs(n)`` is at least 1, two decimals); "-" for None.

    With ``reference``: a cell of the memory summary table, as torch's ``_format_size``
    writes it: the whole number of units (floor division) right-aligned in 6 columns, then the
    unit in 3 ("B  "); the unit is the smallest of which ``reference`` (the row's total) is
    below 768 Ki (786,432), as :func:`scaled` picks it."""
    if n is None:
        return "-"
    units = BYTE_UNITS[: BYTE_UNITS.index(largest) + 1]
    if reference is not None:
        number, unit = scaled(n, reference, 1024, 768 * 1024, units)
        return f"{number:6d} {unit:<3}"
    value = float(n)
    for unit in units:
        if abs(value) < 1024 or unit == largest:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def unit_of(n: int) -> Tuple[int, str]:
    """The unit :func:`format_bytes` writes ``n`` in, as (bytes in that unit, its name)."""
    unit = format_bytes(n).split()[-1]
    return 1 << (10 * BYTE_UNITS.index(unit)), unit


def mib_text(n: int) -> str:
    """``n`` bytes as an exact number of MiB, as a configuration takes it ("0.5", "20")."""
    return format((Decimal(n) / Decimal(MIB)).normalize(), "f")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: Union[str, int]) -> int:
    """Bytes from ``"80GB"`` (10^9), ``"16GiB"`` (2^30), ``"512MiB"``, ``"1.5G"`` (a bare
    K/M/G/T is binary), ``"123"``; case does not matter. A fraction of a byte is dropped.
    ValueError for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"negative size {text}")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"bad size {text!r} (expected bytes, or a number with a unit: KB/MB/GB/TB "
            f"for powers of 10, KiB/MiB/GiB/TiB for powers of 2)"
        )
    try:
        value = Decimal(m.group(1)) * _UNITS[unit]
    except InvalidOperation:
        raise ValueError(f"bad size {text!r}") from None
    return int(value)
