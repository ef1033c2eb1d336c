"""What the pool's device calls cost: microseconds per call of each kind, and the arithmetic.

    from cudapool import device_costs
    costs = device_costs.load("build/device-call-costs.json")   # or device_costs.default()
    ms = device_costs.estimate_ms(calls, call_bytes, costs)

A replay counts the calls its pool makes to the simulated device, per kind (the names of
``cudapool._C.Pool.backend_calls()``), and the bytes those calls name
(``backend_bytes()``). A call of kind ``k`` naming ``b`` bytes is modelled as costing
``us + us_per_gib * b / 2**30`` microseconds; the sum over the calls is therefore
``calls * us + bytes / 2**30 * us_per_gib`` per kind, and only totals are needed.

The default table (:data:`DEFAULT_COSTS`) is what could be found in public figures; every
entry says where its numbers come from, and ``estimate: True`` marks those that no published
figure backs. The model ignores what a call waits for: ``release`` (cudaFree) and
``event_synchronize`` wait for the device to finish its queued work, which no trace records.
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

__all__ = ["DEFAULT_COSTS", "KINDS", "GIB", "default", "merge", "load", "estimate_ms", "estimate_us_by_kind"]

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
)

_PR_172056 = (
    "pytorch/pytorch PR #172056 (nsys profile of expandable segments at several chunk sizes: the "
    "time in cuMemCreate/cuMemSetAccess/cuMemUnmap/cuMemRelease falls as chunks grow, i.e. it is "
    "mostly per call)"
)
_PR_96995 = (
    "pytorch/pytorch PR #96995, CUDACachingAllocator.cpp notes: mapping cost is proportional to "
    "the number of physical chunks (ten 2 MiB pages map 10x slower than one 20 MiB one), and "
    "changing mappings involves synchronous work with the GPU"
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
        "source": "cudaFree synchronizes the device (CUDA runtime API notes); the wait for "
        "queued work is not modelled; call cost and per-GiB part: estimate",
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
        "source": "cudaEventSynchronize on a completed event; the wait for queued work is not modelled: estimate",
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
        "us": 10.0,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cuMemAddressReserve: no published figure (address space only, no memory): estimate",
    },
    "va_free": {
        "us": 10.0,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cuMemAddressFree: no published figure: estimate",
    },
    "page_create": {
        "us": 25.0,
        "us_per_gib": 60.0,
        "estimate": True,
        "source": f"cuMemCreate: {_PR_172056}; per-call and per-GiB split: estimate",
    },
    "page_release": {
        "us": 15.0,
        "us_per_gib": 30.0,
        "estimate": True,
        "source": f"cuMemRelease: {_PR_172056}; per-call and per-GiB split: estimate",
    },
    "page_map": {
        "us": 3.0,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": f"cuMemMap: {_PR_96995}; per-call figure: estimate",
    },
    "page_unmap": {
        "us": 30.0,
        "us_per_gib": 20.0,
        "estimate": True,
        "source": f"cuMemUnmap: {_PR_172056}; {_PR_96995}; figures: estimate",
    },
    "page_set_access": {
        "us": 20.0,
        "us_per_gib": 40.0,
        "estimate": True,
        "source": f"cuMemSetAccess: {_PR_172056}; per-call and per-GiB split: estimate",
    },
    "stream_capturing": {
        "us": 0.5,
        "us_per_gib": 0.0,
        "estimate": True,
        "source": "cuStreamIsCapturing: a host-side query of the stream's state, asked only where an event "
        "call or a release would follow; no published figure: estimate, as event_query",
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
