"""Allocation traces: the sequence of allocation events of one program.

A trace is a list of events, each ``(action, id, size, stream, device, time_ns)``:

- ``action``: ``ALLOC`` (0), ``FREE`` (1) or ``RELEASE`` (3: the program gave its cached
  memory back there, as ``torch.cuda.empty_cache()`` or the built-in allocator's
  out-of-memory retry do; id, size and stream 0; a replay calls empty_cache there);
- ``id``: names one allocation from its alloc to its free (an address or a counter; an id
  may be reused after its free);
- ``size``: requested bytes (on a free: the size of what is freed, or 0 when unknown);
- ``stream``: the stream the allocation is made on (0: the default stream);
- ``device``: the device index;
- ``time_ns``: when it happened, or -1 when unknown.

Events are kept as packed little-endian records of 40 bytes (the layout of the C replay's
``cp_trace_event_t``), so a trace of millions of events costs one ``bytes`` object and goes to
the C replay without a copy.

The file format (``.cptrace``, gzip-compressed): one line of JSON (the header: format name,
version, number of events, free-form ``meta``, and optionally ``builtin_reserved``, the
built-in allocator's reserved bytes as ``[[event_index, bytes], ...]`` when the trace came
from a real run that recorded it), then the records.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections import Counter

from . import torch_snapshot
from ._events import ALLOC, EVENT, FREE, RELEASE, Trace, TraceWriter

__all__ = [
    "ALLOC",
    "FREE",
    "RELEASE",
    "EVENT",
    "UNSEEN",
    "Trace",
    "TraceWriter",
    "device_counts",
    "device_data",
    "load",
    "rows_where",
    "save",
]

#: What a trace does not hold, written into every trace's meta["unseen"] by the tracers (the
#: first entry is left out when the cuBLAS workspace is modelled).
UNSEEN = (
    "cublas_workspace: per stream, allocated by torch through the caching allocator at the first"
    " BLAS operation and never freed; its size depends on the GPU and CUBLAS_WORKSPACE_CONFIG"
    " (Tracer(workspace_bytes=N) models it)",
    "kernel_scratch: staging of reductions other than sum/mean, sort and top-k, scans, cuDNN"
    " workspaces and reserve buffers, cuFFT plans: sizes depend on the kernel's launch configuration"
    " (the staging of sum/mean and index_put's sort are modelled, sized for Tracer(gpu=...))",
    "outside_dispatch: memory allocated without an ATen operation (custom extensions, NCCL, Triton"
    " autotuning, CUDA graph pools)",
)

FORMAT_NAME = "cudapool-trace"
FORMAT_VERSION = 1


def save(trace: Trace, path: "os.PathLike[str] | str") -> None:
    """Write ``trace`` to ``path`` in the .cptrace format (gzip)."""
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "events": len(trace),
        "meta": trace.meta,
        "builtin_reserved": trace.builtin_reserved,
    }
    with gzip.open(path, "wb", compresslevel=6) as f:
        f.write(json.dumps(header, separators=(",", ":")).encode("utf-8") + b"\n")
        f.write(trace.data)


def load(path: "os.PathLike[str] | str") -> Trace:
    """Read a trace: our .cptrace format, or a torch memory snapshot pickle
    (``torch.cuda.memory._dump_snapshot``), plain or gzipped (``.pickle.gz``), told apart by
    their first bytes."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as f:
                first = f.read(1)
        except (OSError, EOFError) as exc:
            raise ValueError(f"{path}: a gzip file that cannot be read ({exc})") from None
        if first == b"\x80":  # a gzipped torch snapshot (.pickle.gz)
            return torch_snapshot.load_snapshot(path)
        return _load_cptrace(path)
    return torch_snapshot.load_snapshot(path)  # a torch snapshot pickle


def _load_cptrace(path: "os.PathLike[str] | str") -> Trace:
    with gzip.open(path, "rb") as f:
        line = f.readline()
        try:
            header = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}: not a cudapool trace (bad header: {exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: not a cudapool trace (its header is a {type(header).__name__}, not an object)")
        if header.get("format") != FORMAT_NAME:
            raise ValueError(f"{path}: not a cudapool trace (format {header.get('format')!r})")
        if header.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: trace format version {header.get('version')!r} is not supported")
        data = f.read()
    n = header.get("events")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"{path}: the header's event count {n!r} is not a non-negative integer")
    if n is not None and len(data) != n * EVENT.size:
        raise ValueError(f"{path}: truncated trace: {len(data) / EVENT.size:g} of {n} events")
    meta, curve = header.get("meta"), header.get("builtin_reserved")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"{path}: the header's meta is a {type(meta).__name__}, not an object")
    if curve is not None and not (
        isinstance(curve, list)
        and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
            for p in curve
        )
    ):
        raise ValueError(f"{path}: the header's builtin_reserved is not a list of [event index, bytes] pairs")
    try:
        return Trace(data, meta=meta, builtin_reserved=curve)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


# -- one device's events, and events of one kind --------------------------------------------


def device_counts(data: bytes) -> Counter:
    """Events per device index, without unpacking every record in Python."""
    if not data:
        return Counter()
    if sys.byteorder == "little":
        # The device is the second 32-bit word of each 40-byte record.
        return Counter(memoryview(data).cast("i")[1 :: EVENT.size // 4])
    return Counter(e[1] for e in EVENT.iter_unpack(data))


def rows_where(data: bytes, field: str, value: int, equal: bool = True) -> bytes:
    """The records of ``data`` whose ``field`` ("action" or "device") is ``value`` (with
    ``equal=False``: is not), in order; numpy when it is there, else pure Python."""
    pos = {"action": 0, "device": 1}[field]
    try:
        import numpy as np
    except ImportError:
        size = EVENT.size
        return b"".join(
            data[i * size : (i + 1) * size] for i, e in enumerate(EVENT.iter_unpack(data)) if (e[pos] == value) == equal
        )
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, EVENT.size)
    column = rows[:, 0] if pos == 0 else rows[:, 4:8].copy().view("<i4").reshape(-1)
    return rows[(column == value) == equal].tobytes()


def device_data(data: bytes, device: int) -> bytes:
    """The records of ``device`` only, in order."""
    return rows_where(data, "device", device)
