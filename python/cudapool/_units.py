"""Byte counts for people: the package's one byte formatter, and the unit picking of the
memory summary table (shared with its counts)."""

from typing import Optional, Sequence, Tuple

__all__ = ["format_bytes", "scaled"]

#: Binary units, smallest first.
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


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
