"""What the A/B command and its simulated form share: the command line's errors and ranges,
the table, the search for the largest batch, the progress line."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, List, Optional, Sequence, Tuple


class UsageError(ValueError):
    """A bad command line: reported with status 2 before anything runs."""


def parse_range(text: str) -> Tuple[int, int]:
    lo_text, sep, hi_text = text.partition(":")
    try:
        lo, hi = int(lo_text), int(hi_text)
    except ValueError:
        raise UsageError(f"--max-batch-range {text!r}: write LO:HI, two integers") from None
    if not sep or not 1 <= lo <= hi:
        raise UsageError(f"--max-batch-range {text!r}: need 1 <= LO <= HI")
    return lo, hi


def with_arg(args: Sequence[str], name: str, value: int) -> List[str]:
    """``args`` with the option ``name`` set to ``value``: every "NAME V" and "NAME=V" replaced,
    or "NAME VALUE" appended when it is absent."""
    out: List[str] = []
    found = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == name and i + 1 < len(args):
            out += [name, str(value)]
            found = True
            i += 2
            continue
        if a.startswith(name + "="):
            out.append(f"{name}={value}")
            found = True
        else:
            out.append(a)
        i += 1
    if not found:
        out += [name, str(value)]
    return out


# -- one run ------------------------------------------------------------------------------------


def format_table(cells: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = []
    for n, r in enumerate(cells):
        parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def rich_available() -> bool:
    try:
        import rich.console  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
        import rich.table  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except Exception:
        return False
    return True


def print_rich(cells: List[List[str]]) -> None:
    from rich.console import Console  # type: ignore[import-not-found, unused-ignore]
    from rich.table import Table  # type: ignore[import-not-found, unused-ignore]

    t = Table()
    for i, h in enumerate(cells[0]):
        t.add_column(h, justify="left" if i == 0 else "right")
    for r in cells[1:]:
        t.add_row(*r)
    Console().print(t)


def bisect_max(
    ok: Callable[[int], bool], lo: int, hi: int, step: Optional[int] = None, rel: float = 0.0
) -> Optional[int]:
    """The largest v in lo..hi with ok(v), assuming ok holds up to some value and fails above:
    ok(lo), then doubling up to the first failure (or hi), then bisection. None if not ok(lo).
    The bisection stops once the value known to pass and the one known to fail are at most
    ``step`` apart, or ``rel`` x the passing value (the passing one is returned: the answer
    is then within that much below the exact one); by default it runs to the exact integer."""
    if not ok(lo):
        return None
    good, bad = lo, None
    while bad is None:
        if good >= hi:
            return hi
        v = min(max(2 * good, good + 1), hi)
        if ok(v):
            good = v
        else:
            bad = v
    while bad - good > max(1, step or 1, int(rel * good)):
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def safe_label(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def progress_printer(prefix: str = "cudapool ab: ") -> Callable[[str], None]:
    tty = sys.stderr.isatty()

    def progress(line: str) -> None:
        if tty:
            sys.stderr.write("\r\033[K" + prefix + line)
            if not line.endswith("..."):
                sys.stderr.write("\n")
        else:
            sys.stderr.write(prefix + line + "\n")
        sys.stderr.flush()

    return progress


def write_json(path: str, result: object, who: str) -> bool:
    """Write ``result`` to ``path`` (folders made); False, with one line on stderr, when it
    cannot be written."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    except OSError as exc:
        print(f"{who}: cannot write {path!r}: {exc}", file=sys.stderr)
        return False
    return True
