#!/usr/bin/env python3
"""Measure what each device call of cudapool's CUDA backend costs on this GPU.

    python3 benchmarks/device_call_costs.py [--json PATH] [--reps N] [--sizes-mib 2,20,200,1024]

The calls are the CUDA driver entries cudapool's CUDA backend makes (csrc/backend/cuda.c and
cuda_vmm.c), called here through ctypes on libcuda, one kind at a time, each timed on the
host with perf_counter_ns around the call itself (median of --reps):

- reserve / release: cuMemAlloc_v2 / cuMemFree_v2, at each size of --sizes-mib;
- event_create / event_destroy / event_record / event_query / event_synchronize:
  cuEventCreate (CU_EVENT_DISABLE_TIMING), cuEventDestroy_v2, cuEventRecord on the null
  stream of an idle device, cuEventQuery, cuEventSynchronize of a completed event;
- mem_info: cuMemGetInfo_v2; vmm_granularity: cuMemGetAllocationGranularity;
- va_reserve / va_free: cuMemAddressReserve / cuMemAddressFree;
- page_create, page_map, page_set_access, page_unmap, page_release: cuMemCreate, cuMemMap,
  cuMemSetAccess, cuMemUnmap, cuMemRelease of one page of each size (a multiple of the
  granularity).

Each kind measured at several sizes is fitted to us + us_per_gib x GiB (least squares,
clamped at 0); the others get us_per_gib 0. Prints a table and writes the JSON that
cudapool.lab.device_costs.load (and replay_all.py --device-costs, and
replay(costs=...)) read: ``{"device", "driver", "reps", "costs": {kind: {"us", "us_per_gib",
"source", "samples": {"<bytes>": us}}}}``.

Without torch or a CUDA GPU it prints "no CUDA GPU: skipped" and exits 0 (writing
{"skipped": reason} to --json). Exits 1 when a driver call fails.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_common import skipped_without_gpu, write_json  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SIZES_MIB = (2, 20, 200, 1024)

CU_EVENT_DISABLE_TIMING = 2
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class Driver:
    """The driver entries, each raising RuntimeError naming itself on a failure."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUresult {rc}")


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1000.0


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def fit(samples: Dict[int, float]) -> Dict[str, float]:
    """us + us_per_gib x GiB through the samples (bytes -> us), least squares, clamped at 0."""
    xs = [b / GiB for b in samples]
    ys = list(samples.values())
    if len(xs) < 2:
        return {"us": max(ys[0] if ys else 0.0, 0.0), "us_per_gib": 0.0}
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    slope = max(slope, 0.0)
    return {"us": max(my - slope * mx, 0.0), "us_per_gib": slope}


def measure(reps: int, sizes: List[int]) -> Dict[str, Any]:
    cu = Driver()
    cu("cuInit", 0)
    dev = ctypes.c_int()
    cu("cuDeviceGet", ctypes.byref(dev), 0)
    name = ctypes.create_string_buffer(256)
    cu("cuDeviceGetName", name, 256, dev)
    version = ctypes.c_int()
    cu("cuDriverGetVersion", ctypes.byref(version))
    ctx = ctypes.c_void_p()
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    cu("cuCtxSetCurrent", ctx)
    cu("cuCtxSynchronize")
    samples: Dict[str, Dict[int, List[float]]] = {}

    def add(kind: str, size: int, us: float) -> None:
        samples.setdefault(kind, {}).setdefault(size, []).append(us)

    # plain segments
    for size in sizes:
        for _ in range(reps):
            ptr = ctypes.c_uint64()
            add("reserve", size, timed(lambda: cu("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))))
            add("release", size, timed(lambda: cu("cuMemFree_v2", ptr)))
    # events (idle device: the record completes at once)
    for _ in range(reps * 10):
        ev = ctypes.c_void_p()
        add("event_create", 0, timed(lambda: cu("cuEventCreate", ctypes.byref(ev), CU_EVENT_DISABLE_TIMING)))
        add("event_record", 0, timed(lambda: cu("cuEventRecord", ev, None)))
        cu("cuCtxSynchronize")
        add("event_query", 0, timed(lambda: cu("cuEventQuery", ev)))
        add("event_synchronize", 0, timed(lambda: cu("cuEventSynchronize", ev)))
        add("event_destroy", 0, timed(lambda: cu("cuEventDestroy_v2", ev)))
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    for _ in range(reps * 10):
        add("mem_info", 0, timed(lambda: cu("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))))
    # page-mapped memory
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev.value)
    gran = ctypes.c_size_t()
    for _ in range(reps * 10):
        add(
            "vmm_granularity",
            0,
            timed(
                lambda: cu(
                    "cuMemGetAllocationGranularity",
                    ctypes.byref(gran),
                    ctypes.byref(prop),
                    CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            ),
        )
    access = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev.value), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    for size in sizes:
        size = max(gran.value, (size + gran.value - 1) // gran.value * gran.value)
        for _ in range(reps):
            va = ctypes.c_uint64()
            handle = ctypes.c_uint64()
            add(
                "va_reserve",
                size,
                timed(lambda: cu("cuMemAddressReserve", ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                 ctypes.c_uint64(0), ctypes.c_uint64(0))),
            )  # fmt: skip
            add(
                "page_create",
                size,
                timed(lambda: cu("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                 ctypes.c_uint64(0))),
            )  # fmt: skip
            add(
                "page_map",
                size,
                timed(
                    lambda: cu("cuMemMap", va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
                ),
            )
            add(
                "page_set_access",
                size,
                timed(
                    lambda: cu("cuMemSetAccess", va, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
                ),
            )
            add("page_unmap", size, timed(lambda: cu("cuMemUnmap", va, ctypes.c_size_t(size))))
            add("page_release", size, timed(lambda: cu("cuMemRelease", handle)))
            add("va_free", size, timed(lambda: cu("cuMemAddressFree", va, ctypes.c_size_t(size))))
    cu("cuDevicePrimaryCtxRelease_v2", dev)

    costs: Dict[str, Any] = {}
    for kind, by_size in samples.items():
        med = {size: median(xs) for size, xs in by_size.items()}
        sized = len(med) > 1 and kind not in ("va_reserve", "va_free")
        row = fit(med) if sized else {"us": median([x for xs in by_size.values() for x in xs]), "us_per_gib": 0.0}
        row["source"] = f"measured on {name.value.decode()} (driver {version.value}), median of {reps} calls" + (
            " per size, fitted to us + us_per_gib x GiB" if sized else ""
        )
        row["samples"] = {str(size): round(us, 3) for size, us in sorted(med.items())}
        costs[kind] = row
    return {"device": name.value.decode(), "driver": version.value, "reps": reps, "costs": costs}


def format_table(result: Dict[str, Any]) -> str:
    lines = ["| call | us per call | us per GiB | medians by size (us) |", "|---|---|---|---|"]
    for kind, row in result["costs"].items():
        meds = ", ".join(
            (f"{int(b) // MiB} MiB: {us:.1f}" if int(b) else f"{us:.2f}") for b, us in row["samples"].items()
        )
        lines.append(f"| {kind} | {row['us']:.2f} | {row['us_per_gib']:.1f} | {meds} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Measure the cost of each device call of cudapool's CUDA backend.")
    parser.add_argument("--json", metavar="PATH", help="write the costs there (cudapool.lab.device_costs reads it)")
    parser.add_argument("--reps", type=int, default=20, help="calls per kind and size (default 20)")
    parser.add_argument(
        "--sizes-mib",
        default=",".join(map(str, DEFAULT_SIZES_MIB)),
        help="sizes of the allocation and mapping calls, MiB (default 2,20,200,1024)",
    )
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) * MiB for x in args.sizes_mib.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--sizes-mib: not a list of integers: {args.sizes_mib!r}")
    if args.reps < 1 or not sizes or min(sizes) <= 0:
        parser.error("--reps and every size must be positive")
    if skipped_without_gpu("device_call_costs", args.json):
        return 0
    try:
        result = measure(args.reps, sizes)
    except (OSError, RuntimeError, AttributeError) as exc:
        print(f"device_call_costs: {exc}", file=sys.stderr)
        write_json(args.json, {"error": str(exc)})
        return 1
    print(f"device call costs on {result['device']} (driver {result['driver']}), {args.reps} calls per kind and size\n")
    print(format_table(result))
    write_json(args.json, result)
    if args.json:
        print(f"\njson: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
