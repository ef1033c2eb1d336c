"""What the pool's device calls cost: microseconds per call of each kind, and the arithmetic.

    from cudapool.lab import device_costs
    costs = device_costs.load("build/device-call-costs.json")   # or device_costs.default()
    ms = device_costs.estimate_ms(calls, call_bytes, costs)

A replay counts the calls its pool makes to the simulated device, per kind (the names of
``cudapool._C.Pool.backend_calls()``), and the bytes those calls name
(``backend_bytes()``). A call of kind ``k`` naming ``b`` bytes is modelled as costing
``us + us_per_gib * b / 2**30`` microseconds; the sum over the calls is therefore
``calls * us + bytes / 2**30 * us_per_gib`` per kind, and only totals are needed.

The default table (:data:`DEFAULT_COSTS`) is what could be found in public figures; every
entry says where its numbers come from, and ``estimate: True`` marks those that no published
figure backs. The page-mapped calls take the one public per-call benchmark of the CUDA VMM
calls found (the kvcached project's ``benchmarks/bench_vmm``: one thread on an A100, 4096
calls of one 2 MiB page each) for cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and
cuMemAddressReserve; cuMemRelease and cuMemAddressFree, which it does not time, stay estimates.

Calls that wait for the device: the kinds of :data:`SYNC_KINDS` (``release``,
``event_synchronize``, ``page_unmap``, ``page_set_access``) are counted as calls that wait for
the work queued on the device. The wait itself depends on the kernels in flight, which no trace
records, so it is not in the microsecond figure; instead :func:`sync_calls` counts those calls
and a replay reports the count (``sync_calls``, ``sync_calls_after_warmup``) beside the
estimate, so that a reader sees how often the host waits, not only for how long it calls.
(For cudaFree and cudaEventSynchronize the wait is documented; cuMemUnmap and cuMemSetAccess
are documented as synchronous "for most use cases", which does not promise a wait for kernels
in flight: they are counted as calls that may wait.)

On a GPU, ``benchmarks/device_call_costs.py`` measures each kind through cudapool's CUDA
backend and writes a JSON file that :func:`load` reads::

    {"costs": {"reserve": {"us": 31.0, "us_per_gib": 120.0, "source": "measured ..."}, ...},
     "device": "...", ...}

Kinds the file leaves out keep the default; an unknown kind or a negative figure is a
ValueError.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Union

__all__ = [
    "DEFAULT_COSTS",
    "KINDS",
    "SYNC_KINDS",
    "GIB",
    "default",
    "merge",
    "load",
    "estimate_ms",
    "estimate_us_by_kind",
    "sync_calls",
]

GIB = 1 << 30

#: The call kinds, in the simulated device's order (CP_SIM_CALLS in csrc/backend/sim.h).
KINDS = (
    "reserve",
    "release",
    "event_create",
    "event_destroy",
    "event_record",
    "event_query",
    "event_synchronize",
    "mem_info",
    "vmm_granularity",
    "va_reserve",
    "va_free",
    "page_create",
    "page_release",
    "page_map",
    "page_unmap",
    "page_set_access",
    "stream_capturing",
    "host_alloc",
    "host_free",
    "copy_to_host",
    "copy_to_device",
)

#: The kinds whose calls wait for the work queued on the device (see the module notes).
SYNC_KINDS = ("release", "event_synchronize", "page_unmap", "page_set_access")
"""The call kinds counted as waiting for the device, each for its own reason:

- ``release`` (cudaFree): the CUDA runtime documents that it synchronizes the device, the
  current context and its peers, before the memory is given back (only memory from
  cudaMallocAsync is exempt); the pool's plain segments are given back this way;
- ``event_synchronize`` (cudaEventSynchronize): blocks the host until the work queued on the
  event's stream before it has run; the pool calls it before it unmaps a stream's pages, and
  on the way to out of memory for freed blocks whose streams may still be using them;
- ``page_unmap`` (cuMemUnmap) and ``page_set_access`` (cuMemSetAccess): the CUDA driver API
  reference marks both as exhibiting synchronous behaviour "for most use cases"; PyTorch's
  Note [Expandable Segments] adds that changing mappings "appears to involve at least some
  synchronous actions with the GPU". The reference does not promise that they wait for
  kernels in flight, so these two are the calls that *may* wait: counted, to be safe, as
  waiting.

None of the waits is in the microsecond figures of :data:`DEFAULT_COSTS` (what a call waits
for depends on the kernels queued, which no trace records); :func:`sync_calls` counts the
calls instead.
"""

_KVCACHED = (
    "the kvcached project's benchmarks/bench_vmm (ovg-project/kvcached; its README's sample output on "
    "an A100: one thread, 4096 calls, one 2 MiB page per call)"
)
_NOTE_ES = (
    "PyTorch's Note [Expandable Segments] (c10/cuda/CUDACachingAllocator.cpp, from pytorch/pytorch PR "
    "#96995): the cost to map/unmap memory is proportional to the number of physical chunks (mapping "
    "ten separately allocated 2 MiB pages takes 10x the time of one 20 MiB allocation), and changing "
    "mappings appears to involve some synchronous actions with the GPU"
)
_PR_172056 = (
    "pytorch/pytorch PR #172056 (nsys profile of expandable segments at several chunk sizes: the "
    "time in cuMemCreate/cuMemSetAccess/cuMemUnmap/cuMemRelease falls as chunks grow, i.e. it is "
    "mostly per call)"
)

#: Microseconds per call (``us``) and per GiB the call names (``us_per_gib``), with sources.
DEFAULT_COSTS: Dict[str, Dict[str, Any]] = {
    "reserve": {
        "us": 30.0,
        "us_per_gib": 100.0,
        "estimate": True,
        "source": "cudaMalloc: tens of microseconds per call is the common published order "
        "(CUDA best-practice guides, RMM's motivation); the per-GiB part (the driver backing "
        "pages) has no published figure: estimate",
    },
    "release": {
        "us": 50.0,
        "us_per_gib": 50.0,
        "estimate": True,
        "source": "cudaFree: synchronizes the device (CUDA runtime API notes), a call of SYNC_KINDS; the "
        "wait for queued work is not in the figure; call cost and per-GiB part: estimate",
    },
    "event_create": {
        "us": 0.15,
        "us_per_gib": 0.0,
        "estimate": False,
        "source": "cudaEventCreateWithFlags(cudaEventDisableTiming): ~150 ns, the driver pools events",
    },
    "event_destroy": {
        "us": 0.15,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cudaEventDestroy: no published figure; taken equal to event_create: estimate",
    },
    "event_record": {
        "us": 0.5,
        "us_per_gib": 0.0,
        "estimate": False,
        "source": "cudaEventRecord with timing disabled: ~0.5 us",
    },
    "event_query": {
        "us": 0.5,
        "us_per_gib": 0.0,
        "estimate": False,
        "source": "cudaEventQuery with timing disabled: ~0.5 us",
    },
    "event_synchronize": {
        "us": 5.0,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cudaEventSynchronize on a completed event, a call of SYNC_KINDS; the wait for queued "
        "work is not in the figure: estimate",
    },
    "mem_info": {
        "us": 5.0,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cudaMemGetInfo: no published figure: estimate",
    },
    "vmm_granularity": {
        "us": 1.0,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cuMemGetAllocationGranularity: no published figure: estimate",
    },
    "va_reserve": {
        "us": 19.0,
        "us_per_gib": 0.0,
        "estimate": False,
        "source": f"cuMemAddressReserve: 19 us for one call reserving 8 GiB, {_KVCACHED} (a single "
        "sample); address space only, no memory behind it, so all of it is taken per call",
    },
    "va_free": {
        "us": 10.0,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cuMemAddressFree: no published figure (bench_vmm does not time it): estimate",
    },
    "page_create": {
        "us": 191.0,
        "us_per_gib": 1024.0,
        "estimate": False,
        "source": f"cuMemCreate: mean 193 us per 2 MiB page (p50 195, p90 339, p99 381, max 493), "
        f"{_KVCACHED}; the mean, not the p99, as the estimate sums many calls. Split into 191 us per "
        "call + 2 us per 2 MiB page (1,024 us per GiB), a judgement: were all of it per byte "
        "(193 us / 2 MiB = 98,800 us per GiB), ten 2 MiB pages would cost what one 20 MiB chunk "
        f"costs, which {_NOTE_ES} contradicts, and {_PR_172056}; with this split ten pages cost 9.1x one "
        "20 MiB chunk. The per-byte share: estimate",
    },
    "page_release": {
        "us": 15.0,
        "us_per_gib": 30.0,
        "estimate": True,
        "source": f"cuMemRelease: not timed by bench_vmm; {_PR_172056}; per-call and per-GiB figures: estimate",
    },
    "page_map": {
        "us": 1.5,
        "us_per_gib": 0.0,
        "estimate": False,
        "source": f"cuMemMap: mean 1.45 us per 2 MiB page (p99 5, max 105; the timer counts whole "
        f"microseconds, p50 0), {_KVCACHED}; all of it per call, by {_NOTE_ES}",
    },
    "page_unmap": {
        "us": 26.0,
        "us_per_gib": 0.0,
        "estimate": False,
        "source": f"cuMemUnmap: mean 25.63 us per 2 MiB page (p99 39, max 126), {_KVCACHED}; all of it per "
        f"call, by {_NOTE_ES}; the driver reference: synchronous for most use cases, a call of SYNC_KINDS "
        "(the wait is not in the figure)",
    },
    "page_set_access": {
        "us": 36.0,
        "us_per_gib": 0.0,
        "estimate": False,
        "source": f"cuMemSetAccess: mean 35.99 us per 2 MiB page (p99 54, max 169), {_KVCACHED}; all of it "
        f"per call, by {_NOTE_ES}; the driver reference: synchronous for most use cases, a call of "
        "SYNC_KINDS (the wait is not in the figure)",
    },
    "stream_capturing": {
        "us": 0.5,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cuStreamIsCapturing: a host-side query of the stream's state, asked only where an event "
        "call or a release would follow; no published figure: estimate, as event_query",
    },
    # A paused region's backup (Note [Copies for a backup] in csrc/base/backend.h); a replay never
    # makes these calls.
    "host_alloc": {
        "us": 100.0,
        "us_per_gib": 250_000.0,
        "estimate": True,
        "source": "cuMemAllocHost: page-locking host memory grows with its size (the CUDA best-practice "
        "guide calls pinned allocation a heavyweight operation); no published per-GiB figure: estimate",
    },
    "host_free": {
        "us": 50.0,
        "us_per_gib": 50_000.0,
        "estimate": True,
        "source": "cuMemFreeHost: no published figure: estimate",
    },
    "copy_to_host": {
        "us": 10.0,
        "us_per_gib": 21_500.0,
        "estimate": True,
        "source": "cuMemcpyDtoH to pinned memory: the host link's bandwidth, taken as 50 GB/s (PCIe 5.0 x16 "
        "is 64 GB/s per direction nominal); no measurement here: estimate",
    },
    "copy_to_device": {
        "us": 10.0,
        "us_per_gib": 21_500.0,
        "estimate": True,
        "source": "cuMemcpyHtoD from pinned memory: as copy_to_host: estimate",
    },
}

CostTable = Dict[str, Dict[str, Any]]


def default() -> CostTable:
    """A copy of :data:`DEFAULT_COSTS`."""
    return {k: dict(v) for k, v in DEFAULT_COSTS.items()}


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise ValueError(f"{where}: expected a number >= 0, not {value!r}")
    return float(value)


def merge(overrides: Mapping[str, Any], base: Optional[CostTable] = None, origin: str = "costs") -> CostTable:
    """``base`` (default: the default table) with the kinds of ``overrides`` on top; an
    override may give ``us``, ``us_per_gib`` or both (a bare number is ``us``)."""
    table = default() if base is None else {k: dict(v) for k, v in base.items()}
    for kind, entry in overrides.items():
        if kind not in table:
            raise ValueError(f"{origin}: unknown call kind {kind!r} (known: {', '.join(KINDS)})")
        if not isinstance(entry, Mapping):
            entry = {"us": entry}
        unknown = set(entry) - {"us", "us_per_gib", "source", "estimate", "samples", "sizes"}
        if unknown:
            raise ValueError(f"{origin}: {kind}: unknown field(s) {', '.join(sorted(unknown))}")
        row = table[kind]
        for field in ("us", "us_per_gib"):
            if field in entry:
                row[field] = _number(entry[field], f"{origin}: {kind}.{field}")
        row["source"] = str(entry.get("source", f"{origin}"))
        row["estimate"] = bool(entry.get("estimate", False))
    return table


def load(source: Union[str, "os.PathLike[str]", Mapping[str, Any], None]) -> CostTable:
    """The cost table: the default one (None), or the default with the ``costs`` of a JSON file
    (a path) or of a dict like it on top. ValueError for a file that is not such JSON."""
    if source is None:
        return default()
    if isinstance(source, Mapping):
        data: Any = source
        origin = "costs"
    else:
        origin = os.fspath(source)
        with open(origin, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{origin}: not JSON: {exc}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("costs"), Mapping):
        raise ValueError(f"{origin}: expected an object with a 'costs' object")
    return merge(data["costs"], origin=origin)


def estimate_us_by_kind(
    calls: Mapping[str, int], call_bytes: Optional[Mapping[str, int]] = None, costs: Optional[CostTable] = None
) -> Dict[str, float]:
    """Microseconds per kind: calls x us + bytes / GiB x us_per_gib. A kind the table does
    not know is a ValueError; one with no calls costs 0."""
    table = default() if costs is None else costs
    out: Dict[str, float] = {}
    for kind, n in calls.items():
        if kind not in table:
            raise ValueError(f"no cost for call kind {kind!r}")
        b = (call_bytes or {}).get(kind, 0)
        row = table[kind]
        out[kind] = n * float(row["us"]) + b / GIB * float(row.get("us_per_gib", 0.0))
    return out


def estimate_ms(
    calls: Mapping[str, int], call_bytes: Optional[Mapping[str, int]] = None, costs: Optional[CostTable] = None
) -> float:
    """Estimated milliseconds the calls take: the sum of :func:`estimate_us_by_kind`, / 1000."""
    return sum(estimate_us_by_kind(calls, call_bytes, costs).values()) / 1000.0


def sync_calls(calls: Mapping[str, int]) -> int:
    """How many of ``calls`` (per kind, as ``backend_calls()`` gives them) wait for the work
    queued on the device: the sum over the kinds of :data:`SYNC_KINDS` (a kind absent from
    ``calls`` counts 0)."""
    return sum(int(calls.get(kind, 0)) for kind in SYNC_KINDS)
