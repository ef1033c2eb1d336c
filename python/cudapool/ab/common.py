"""What the A/B command and its simulated form share: the command line's errors and ranges,
the allocators it names and how it is split from the script's, the children's environment, the
table, the search for the largest batch, the progress line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .. import _config, ab

#: The exit status of a bad command line.
EXIT_USAGE = 2
#: The rows of the table when --allocators is not given.
DEFAULT_ALLOCATORS = "builtin,expandable,async,cudapool"
#: --find-max-batch's range when --max-batch-range is not given.
DEFAULT_RANGE = (1, 4096)


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


def arg_value(args: Sequence[str], name: str) -> Optional[int]:
    """The integer the option ``name`` has in ``args`` ("NAME V" or "NAME=V"; the last wins),
    or None where it is absent or not an integer."""
    found: Optional[str] = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a[len(name) + 1 :]
    try:
        return None if found is None else int(found)
    except ValueError:
        return None


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


# -- the allocators and the command line -------------------------------------------------------

#: What the built-in rows set in PYTORCH_CUDA_ALLOC_CONF.
TORCH_CONF = {"builtin": None, "expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}


class Allocator(NamedTuple):
    """One row: its label, PYTORCH_CUDA_ALLOC_CONF for torch's allocator (None: unset), and the
    cudapool configuration text ("" for the default policy; None: not cudapool)."""

    label: str
    torch_conf: Optional[str]
    cudapool_conf: Optional[str]


def parse_variant(text: str) -> str:
    """The configuration text ("key:value,...") of a "KEY=VAL[;KEY=VAL...]" variant, checked
    as ``cudapool.enable()`` would (a policy= entry included). UsageError naming a bad key."""
    options: Dict[str, str] = {}
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise UsageError(f"bad cudapool variant entry {item!r}: write KEY=VALUE (entries separated by ';')")
        if key in options:
            raise UsageError(f"cudapool variant sets {key!r} twice")
        options[key] = value
    if not options:
        raise UsageError("empty cudapool variant: write cudapool:KEY=VALUE[;KEY=VALUE...]")
    try:
        entries = _config.merge(None, options, use_policy=True)
        _config.check(entries)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return ",".join(f"{key}:{value}" for key, value in options.items())


def parse_allocators(text: str) -> List[Allocator]:
    """The rows of ``--allocators``: comma-separated names; a cudapool variant's own entries
    are separated by ';' (so its commas never split the list: "cudapool:a=1;b=2")."""
    out: List[Allocator] = []
    names = [name.strip() for name in text.split(",")]
    if not any(names):
        raise UsageError("--allocators is empty")
    for name in names:
        if not name:
            raise UsageError(f"--allocators {text!r} has an empty entry")
        kind, sep, rest = name.partition(":")
        if kind in TORCH_CONF and not sep:
            alloc = Allocator(name, TORCH_CONF[kind], None)
        elif kind == "cudapool":
            alloc = Allocator(name, None, parse_variant(rest) if sep else "")
        elif kind == "planned" and not sep:  # cudapool's planned policy (the step plan)
            alloc = Allocator(name, None, "policy:planned")
        else:
            raise UsageError(
                f"unknown allocator {name!r} (known: builtin, expandable, async, cudapool, planned, "
                "cudapool:KEY=VAL[;KEY=VAL])"
            )
        if any(a.label == alloc.label for a in out):
            raise UsageError(f"allocator {name!r} is listed twice")
        out.append(alloc)
    return out


def split_and_parse(argv: Sequence[str], parser: argparse.ArgumentParser) -> Tuple[argparse.Namespace, List[str]]:
    """The options before ``--`` parsed by ``parser``, and the script and its arguments after
    it. ``--help`` without ``--`` prints the help and exits 0; UsageError when it is bad."""
    argv = list(argv)
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            parser.print_help()
            raise SystemExit(0)
        raise UsageError(f"put -- before the script: {parser.usage}")
    cut = argv.index("--")
    own, rest = argv[:cut], argv[cut + 1 :]
    try:
        ns = parser.parse_args(_join_option_values(own))
    except SystemExit as exc:
        if exc.code == 0:
            raise
        raise UsageError("bad options (see above)") from None
    return ns, rest


def _join_option_values(own: List[str]) -> List[str]:
    """ "--find-max-batch --batch-size" as "--find-max-batch=--batch-size": its value is an
    option name, which argparse would otherwise take for an option of its own."""
    out: List[str] = []
    i = 0
    while i < len(own):
        if own[i] == "--find-max-batch" and i + 1 < len(own):
            out.append(f"--find-max-batch={own[i + 1]}")
            i += 2
            continue
        out.append(own[i])
        i += 1
    return out


# -- the children -------------------------------------------------------------------------------


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(ab.__file__)))


def with_package_on_path(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` with this cudapool's folder first on PYTHONPATH: a child imports this package."""
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


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


def predict_max(
    ok: Callable[[int], bool],
    need: Callable[[int], Optional[int]],
    room: int,
    lo: int,
    hi: int,
    step: Optional[int] = None,
    guesses: int = 4,
    second: Optional[int] = None,
    prefetch: Optional[Callable[[Sequence[int]], None]] = None,
) -> Tuple[Optional[int], str]:
    """The largest v in lo..hi with ok(v), found by prediction where memory is close to affine
    in v: ``need(v)`` (the memory v needs; None where unknown) at two values fixes a line, the
    line crossing ``room`` predicts the answer, and ok at the prediction and one step above it
    confirms it; a prediction that misses makes the next from the two values nearest the answer
    (a secant), at most ``guesses`` of them; then :func:`bisect_max` between the values known to
    pass and to fail. The line starts from ``start`` (``second``: a value measured already, the
    script's own; else ``lo``) and four times it: small values fall into other size classes of
    an allocator, so the line is drawn where the values are larger. The answer to within
    ``step`` (default 1: exact), and how it was found: "predicted" or "bisection". (None, ...)
    if not ok(lo). ``prefetch(values)``, when given, is told the values about to be tried
    together (a prediction and the value above it), so that it can trace them side by side."""
    s = max(1, step or 1)
    good: Optional[int] = None
    bad: Optional[int] = None
    known: Dict[int, int] = {}

    measured: List[int] = []

    def needed(v: int) -> Optional[int]:
        if v not in known:
            m = need(v)
            if m is None:
                return None
            known[v] = m
        return known[v]

    def measure(v: int) -> bool:
        nonlocal good, bad
        passed = ok(v)
        measured.append(v)
        if passed:
            good = v if good is None else max(good, v)
        else:
            bad = v if bad is None else min(bad, v)
        return passed

    start = second if second is not None and lo <= second <= hi else lo
    if not measure(start):
        if start == lo or not measure(lo):
            return None, "predicted"
    elif start < hi:
        measure(min(hi, max(4 * start, start + 3 * s)))
    assert good is not None
    for _ in range(guesses):
        if bad is not None and bad - good <= s:
            return good, "predicted"
        if good >= hi:
            return hi, "predicted"
        middle = good if bad is None else (good + bad) / 2
        # the line through the two values nearest the answer whose needs rise with them (needs
        # cost replays: computed only for the values tried as a pair)
        ranked = sorted(set(measured), key=lambda v: abs(v - middle))
        pair = None
        for i, p in enumerate(ranked):
            for q in ranked[i + 1 :]:
                mp, mq = needed(p), needed(q)
                if mp is not None and mq is not None and (mq - mp) * (q - p) > 0:
                    pair = ((p, mp), (q, mq))
                    break
            if pair is not None:
                break
        if pair is None:
            break
        (v1, m1), (v2, m2) = pair
        guess = int(v1 + (room - m1) * (v2 - v1) / (m2 - m1))
        guess = max(good, min(guess, (bad - 1) if bad is not None else hi))
        if guess == good:  # the line says good is the answer: one step above confirms it
            if good + s > hi or not measure(min(hi, good + s)):
                return good, "predicted"
            continue
        if prefetch is not None:
            prefetch([guess, min(hi, guess + s)])
        if measure(guess) and (guess + s > hi or not measure(min(hi, guess + s))):
            return guess, "predicted"
    if bad is not None and bad - good <= s:
        return good, "predicted"
    # Not affine enough: bisection from what is known.
    top = hi if bad is None else bad
    return bisect_max(lambda v: v <= good or (v < top and ok(v)), good, top, step=step), "bisection"


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
