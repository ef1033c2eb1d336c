"""The memory summary table, in the layout of ``torch.cuda.memory_summary()``.

Same 75-column box, same rows and columns, same number formatting, so that anyone who reads
torch's summary reads ours, and text tools that parse it keep working. Only the title line
differs: it names cudapool. Needs neither torch nor a GPU: it formats a stats dict under
torch's key names (``cudapool.memory_stats()``, ``cudapool.sim.Pool.memory_stats()``).
"""

from typing import Any, Callable, List, Mapping, Sequence, Tuple

from ._units import format_bytes, scaled

__all__ = ["format_summary", "format_all_ranks", "format_regions", "DEFAULT_TITLE", "RANK_ROWS"]

DEFAULT_TITLE = "cudapool CUDA memory summary"

WIDTH = 75

# Rows with a value per pool: (stats family, row label, formatter kind).
_POOLED_ROWS: Sequence[Tuple[str, str, str]] = (
    ("allocated_bytes", "Allocated memory", "bytes"),
    ("active_bytes", "Active memory", "bytes"),
    ("requested_bytes", "Requested memory", "bytes"),
    ("reserved_bytes", "GPU reserved memory", "bytes"),
    ("inactive_split_bytes", "Non-releasable memory", "bytes"),
    ("allocation", "Allocations", "count"),
    ("active", "Active allocs", "count"),
    ("segment", "GPU reserved segments", "count"),
    ("inactive_split", "Non-releasable allocs", "count"),
)
_POOL_SUBROWS: Sequence[Tuple[str, str]] = (
    ("large_pool", "      from large pool"),
    ("small_pool", "      from small pool"),
)
# Rows without a per-pool breakdown.
_PLAIN_ROWS: Sequence[Tuple[str, str, str]] = (
    ("oversize_allocations", "Oversize allocations", "count"),
    ("oversize_segments", "Oversize GPU segments", "count"),
)
_METRICS = ("current", "peak", "allocated", "freed")

_COUNT_UNITS = (" ", "K", "M")


def _fmt_bytes(value: int, reference: int) -> str:
    return format_bytes(value, largest="PiB", reference=reference)


def _fmt_count(value: int, reference: int) -> str:
    number, unit = scaled(value, reference, 1000, 750 * 1000, _COUNT_UNITS)
    return f"{number:7d} {unit} "


_FORMATTERS: Mapping[str, Callable[[int, int], str]] = {"bytes": _fmt_bytes, "count": _fmt_count}


def _row(label: str, cells: Sequence[str]) -> str:
    return f" {label:<21} | " + " | ".join(cells) + " "


def _title_line(title: str, device: int) -> str:
    text = f"{title}, device ID {device}"
    indent = 18  # where torch's own title starts
    if indent + len(text) + 1 > WIDTH:
        indent = max(1, (WIDTH - len(text)) // 2)
    return (" " * indent + text).ljust(WIDTH)


def _value(stats: Mapping[str, int], key: str) -> int:
    try:
        return int(stats[key])
    except KeyError:
        raise KeyError(f"memory stats lack {key!r}") from None


def format_summary(stats: Mapping[str, int], device: int, abbreviated: bool = False, title: str = DEFAULT_TITLE) -> str:
    """The summary table of ``stats`` (a flat dict under torch's key names) for ``device``.

    ``abbreviated`` leaves out the "from large pool" / "from small pool" rows. Within a row,
    every cell picks its unit from the value of the same column in the row's first line
    (the "all" line), as torch does, so that a row's pool lines share the total's unit.
    """
    rule = "-" * WIDTH
    frame = "=" * WIDTH
    ooms = _value(stats, "num_ooms")
    retries = _value(stats, "num_alloc_retries")
    lines: List[str] = [
        frame,
        _title_line(title, device),
        rule,
        f"{'':12}CUDA OOMs: {ooms:<12d} | {'':7}cudaMalloc retries: {retries:<8d}  ",
        frame,
        _row("       Metric", ("Cur Usage ", "Peak Usage", "Tot Alloc ", "Tot Freed ")),
    ]
    for family, label, kind in _POOLED_ROWS:
        fmt = _FORMATTERS[kind]
        lines.append(rule)
        subrows = [("all", label)]
        if not abbreviated:
            subrows.extend(_POOL_SUBROWS)
        references = [_value(stats, f"{family}.all.{m}") for m in _METRICS]
        for pool, sublabel in subrows:
            values = [_value(stats, f"{family}.{pool}.{m}") for m in _METRICS]
            lines.append(_row(sublabel, [fmt(v, r) for v, r in zip(values, references)]))
    for family, label, kind in _PLAIN_ROWS:
        fmt = _FORMATTERS[kind]
        lines.append(rule)
        values = [_value(stats, f"{family}.{m}") for m in _METRICS]
        lines.append(_row(label, [fmt(v, v) for v in values]))
    lines.append(frame)
    return "".join(f"|{line}|\n" for line in lines)


# The all-ranks table: (stats key, row label, formatter kind), one row each.
RANK_ROWS: Sequence[Tuple[str, str, str]] = (
    ("allocated_bytes.all.current", "Allocated memory", "bytes"),
    ("allocated_bytes.all.peak", "Allocated memory, peak", "bytes"),
    ("active_bytes.all.current", "Active memory", "bytes"),
    ("active_bytes.all.peak", "Active memory, peak", "bytes"),
    ("requested_bytes.all.current", "Requested memory", "bytes"),
    ("requested_bytes.all.peak", "Requested memory, peak", "bytes"),
    ("reserved_bytes.all.current", "GPU reserved memory", "bytes"),
    ("reserved_bytes.all.peak", "GPU reserved mem., peak", "bytes"),
    ("inactive_split_bytes.all.current", "Non-releasable memory", "bytes"),
    ("inactive_split_bytes.all.peak", "Non-releasable, peak", "bytes"),
    ("allocation.all.current", "Allocations", "count"),
    ("allocation.all.peak", "Allocations, peak", "count"),
    ("segment.all.current", "GPU reserved segments", "count"),
    ("segment.all.peak", "Reserved segments, peak", "count"),
    ("oversize_allocations.current", "Oversize allocations", "count"),
    ("oversize_segments.current", "Oversize GPU segments", "count"),
    ("num_alloc_retries", "cudaMalloc retries", "count"),
    ("num_ooms", "CUDA OOMs", "count"),
    ("num_device_alloc", "Device allocations", "count"),
    ("num_device_free", "Device frees", "count"),
)


def _rank_cell(kind: str, value: float) -> str:
    if kind == "bytes":
        return format_bytes(int(round(value)), largest="PiB")
    return f"{value:.1f}" if value != int(value) else f"{int(value)}"


def format_all_ranks(per_rank: Sequence[Mapping[str, Any]], title: str = DEFAULT_TITLE) -> str:
    """One table over every rank of a distributed job: per statistic (:data:`RANK_ROWS`) its
    minimum, maximum and mean over the ranks, and the worst rank (the one with the maximum;
    the lowest rank among equals).

    ``per_rank``: one mapping per rank with ``rank``, ``device`` (its index), ``device_name``
    and ``stats`` (a flat dict under torch's key names), in any order.
    """
    if not per_rank:
        raise ValueError("no ranks to summarise")
    ranks = sorted(per_rank, key=lambda r: int(r["rank"]))
    names = sorted({str(r.get("device_name", "?")) for r in ranks})
    devices = sorted({int(r.get("device", 0)) for r in ranks})
    rule = "-" * WIDTH
    frame = "=" * WIDTH
    head = f"{title}, all {len(ranks)} ranks"
    lines: List[str] = [
        frame,
        f" {head}".ljust(WIDTH),
        f" devices: {', '.join(map(str, devices))} ({'; '.join(names)})"[:WIDTH].ljust(WIDTH),
        frame,
        f" {'Metric':<24}| {'Min':>11} | {'Max':>11} | {'Mean':>11} | {'Worst':>5} ".ljust(WIDTH),
        rule,
    ]
    for key, label, kind in RANK_ROWS:
        values = [(int(r["stats"].get(key, 0)), int(r["rank"])) for r in ranks]
        low = min(v for v, _ in values)
        high = max(v for v, _ in values)
        mean = sum(v for v, _ in values) / len(values)
        worst = min(rank for v, rank in values if v == high)
        cells = [_rank_cell(kind, x) for x in (low, high, mean)]
        lines.append(f" {label:<24}| {cells[0]:>11} | {cells[1]:>11} | {cells[2]:>11} | {worst:>5} ".ljust(WIDTH))
    lines.append(frame)
    return "".join(f"|{line}|\n" for line in lines)


def format_regions(regions: Sequence[Mapping[str, Any]], device: int) -> str:
    """The regions of one device's pool (``Pool.regions()`` rows) as a table in the summary's
    box: per region its state, live, reserved, paused and backed-up bytes. "" when there is
    none."""
    if not regions:
        return ""
    rule = "-" * WIDTH
    frame = "=" * WIDTH
    lines: List[str] = [
        f" Regions of device {device} (cudapool.region; pause and resume)".ljust(WIDTH),
        rule,
        f" {'Region':<18}|{'State':^8}|{'Live':>10} |{'Reserved':>10} |{'Paused':>10} |{'Backup':>9} ",
        rule,
    ]
    for r in regions:
        name = str(r["tag"])
        if len(name) > 17:
            name = name[:16] + "…"
        state = "paused" if r["paused"] else "active"
        cells = [
            format_bytes(int(r[k]), largest="PiB").strip() for k in ("live_bytes", "reserved_bytes", "paused_bytes")
        ]
        backup = format_bytes(int(r["backup_bytes"]), largest="PiB").strip()
        lines.append(f" {name:<17} |{state:^8}|{cells[0]:>10} |{cells[1]:>10} |{cells[2]:>10} |{backup:>9} ")
    lines.append(frame)
    return "".join(f"|{line.ljust(WIDTH)[:WIDTH]}|\n" for line in lines)
