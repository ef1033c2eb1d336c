"""The command line: ``python -m cudapool run SCRIPT [ARGS...]``, ``python -m cudapool info``,
``python -m cudapool replay TRACE``, ``python -m cudapool plot SNAPSHOT_OR_TRACE -o PNG`` and ``python -m cudapool ab [OPTIONS] -- SCRIPT [ARGS...]``.

run   enable cudapool (configuration from CUDAPOOL_CONF), run SCRIPT as __main__ with ARGS,
      then print the memory summary of every device that has a pool to stderr (under
      torchrun, WORLD_SIZE > 1: one table of every rank's statistics, on rank 0 only). When
      out of memory ended the script, the out-of-memory report with its computed suggestion
      is printed too. The exit status is the script's.
info  what cudapool would run with here: its version and configuration, torch, the CUDA
      driver, and the allocator hooks this torch offers. Never initialises CUDA.
replay
      replay an allocation trace (.cptrace, or a torch memory snapshot pickle) through the
      pool on a simulated device and report peak memory, utilization, fragmentation and
      speed (see cudapool.lab.replay). Errors in the input exit with status 2.
      --snapshot-at-peak PATH also writes the pool's snapshot at its peak.
plot  draw a memory snapshot pickle, or a trace replayed to its peak, as a PNG: a segment map
      and a timeline (see cudapool.lab.plot; needs matplotlib). Bad input exits with status 2.
ab    run SCRIPT unchanged once per allocator (built-in, expandable segments, cudaMallocAsync,
      cudapool and its variants) and repeat, each in a fresh process, and print their wall
      time, peak memory, utilization, device allocations and out of memory side by side (see
      cudapool.ab.command). A bad command line exits with status 2, before anything runs.
      ab --simulate [--gpu NAME_OR_BYTES]: no GPU needed; SCRIPT traced once on a fake GPU and
      replayed under each allocator: predicted peak memory, fits or not, the smallest GPU it
      fits on, device time (see cudapool.ab.simulate).
"""

import argparse
import json
import os
import runpy
import sys
import traceback
from typing import List, Optional

EXIT_USAGE = 2


def _err(message: str) -> None:
    print(f"cudapool: {message}", file=sys.stderr)


def _no_gpu() -> Optional[str]:
    """Why this machine has no CUDA GPU for cudapool (None: it has one)."""
    from cudapool import _C

    info = _C.cuda_info()
    if info.get("available") and info.get("device_count", 0) > 0:
        return None
    return str(info.get("error") or "no CUDA device").removeprefix("cudapool: ")


def _simulate_hint(script: str, args: List[str]) -> str:
    import shlex

    return f"to predict its GPU memory here, without a GPU: {shlex.join(['python', '-m', 'cudapool', 'ab', '--simulate', '--', script, *args])}"


def _print_summaries(hint: str = "") -> None:
    import cudapool
    from cudapool import _C

    devices = _C.device_pools()
    if not devices:
        why = _no_gpu()
        if why is not None:
            _err(f"no device pool was created: this machine has no CUDA GPU ({why}){'; ' + hint if hint else ''}")
        else:
            _err("no device pool was created (nothing was allocated on a GPU through cudapool)")
        return
    for device in devices:
        sys.stderr.write(cudapool.memory_summary(device))
    sys.stderr.flush()


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _print_all_ranks_summary() -> None:
    """Under torchrun (WORLD_SIZE > 1): gather every rank's statistics and print the
    all-ranks table once, on rank 0. A collective: every rank gets here at its script's end.
    When the script has torn its process group down (or never made one), a gloo group is
    made for the gathering from torchrun's environment, and torn down after."""
    import datetime

    import torch.distributed as dist

    import cudapool

    made = False
    if not dist.is_initialized():
        # torchrun's store, under a prefix of our own: the keys the script's own (destroyed)
        # group left there must not meet this group's.
        timeout = datetime.timedelta(seconds=120)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore("cudapool-all-ranks/", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        made = True
    try:
        rank = dist.get_rank()
        text = cudapool.memory_summary(all_ranks=True)
    finally:
        if made:
            dist.destroy_process_group()
    if rank == 0:
        sys.stderr.write(text)
        sys.stderr.flush()


def _print_oom(exc: BaseException) -> None:
    """When out of memory ended the script: the report with the computed suggestion."""
    from cudapool import _C, oom

    chain: List[BaseException] = []
    seen: Optional[BaseException] = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if not any(str(e).startswith("CUDA out of memory") for e in chain):
        return
    for device in _C.device_pools():
        report = oom.analyse(_C.device_pool(device), cache_key=device)
        if report is not None:
            sys.stderr.write(f"cudapool: device {device}: " + oom.format_oom(report))


def cmd_run(script: str, args: List[str]) -> int:
    import cudapool
    from cudapool.ab.child import exit_code

    if not os.path.isfile(script):
        _err(f"cannot run {script!r}: no such file")
        return EXIT_USAGE
    no_gpu = _no_gpu()
    if no_gpu is not None:
        # The script runs as it would without cudapool (on the CPU, or failing where it needs
        # CUDA); what a user without a GPU wants is the prediction, so say where it is.
        _err(
            f"this machine has no CUDA GPU ({no_gpu}): the script runs without cudapool's pool; {_simulate_hint(script, args)}"
        )
    try:
        cudapool.enable()
    except ValueError as exc:
        _err(f"bad configuration: {exc}")
        return EXIT_USAGE
    except (RuntimeError, ImportError) as exc:
        _err(f"cannot enable cudapool: {exc}")
        return 1

    script_dir = os.path.dirname(os.path.abspath(script))
    saved_argv, saved_path0 = sys.argv, (sys.path[0] if sys.path else None)
    sys.argv = [script, *args]
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.append(script_dir)
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 130
    except BaseException as exc:  # the script failed: report it as Python would, then summarise
        traceback.print_exc()
        status = 1
        try:
            _print_oom(exc)
        except Exception as why:  # never hide the script's status behind a report failure
            _err(f"cannot explain the out of memory: {why}")
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        sys.stdout.flush()
        try:
            if _world_size() > 1:
                _print_all_ranks_summary()
            else:
                _print_summaries(_simulate_hint(script, args))
        except Exception as exc:  # never hide the script's status behind a summary failure
            _err(f"cannot print the memory summary: {exc}")
    return status


def cmd_info() -> int:
    from cudapool import _C, _config, _torch
    from cudapool._version import __version__

    print(f"cudapool {__version__}")
    env_text = os.environ.get(_config.ENV_VAR)
    status = 0
    try:
        effective = _config.effective(_config.resolve({}, use_policy=True))
        source = f"{_config.ENV_VAR}={env_text!r}" if env_text else "the default policy"
        print(f"configuration ({source}): {effective}")
    except ValueError as exc:
        print(f"configuration: INVALID: {exc}")
        status = EXIT_USAGE

    try:
        import torch
    except Exception as exc:  # not installed, or broken
        print(f"torch: not importable ({exc.__class__.__name__}: {exc})")
        torch = None
    if torch is not None:
        cuda_build = hasattr(torch._C, "_cuda_customAllocator")
        build = f"CUDA build (CUDA {torch.version.cuda})" if cuda_build else "CPU-only build"
        print(f"torch: {torch.__version__}, {build}")
        if cuda_build:
            path = _bridge_status()
            print(f"allocator path of cudapool.enable(): {path}")
            if path.startswith("pluggable"):  # the hooks matter only on that path
                offered = _torch.torch_hooks_offered()
                ours = [h for h in offered if h in _torch.HOOK_NAMES]
                others = [h for h in offered if h not in _torch.HOOK_NAMES]
                print("pluggable allocator hooks offered: " + (", ".join(offered) or "none"))
                print("  set by cudapool.enable(): " + (", ".join(ours) or "none"))
                print("  left unset: " + (", ".join(others) or "none"))
                if "record_stream" not in offered:
                    print("  warning: no record_stream hook: cross-stream tensor use is unsafe")
        print(f"ab --simulate (no GPU needed): {_simulate_engine()}")

    info = _C.cuda_info()
    if info.get("available"):
        version = int(info.get("driver_version", 0))
        names = ", ".join(f"{i}: {name}" for i, name in enumerate(info.get("devices", [])))
        print(f"CUDA driver: available, version {version // 1000}.{(version % 1000) // 10}")
        print(f"CUDA devices: {info.get('device_count', 0)} ({names})")
        wanted = status == 0 and ("expandable_segments:True" in effective or "page_stitching:True" in effective)
        stitching = "page_stitching:True" in effective
        for device, (supported, why) in enumerate(info.get("page_mapped", [])):
            print(f"device {device} pool: {_pool_kind(wanted, supported, why, stitching)}")
    else:
        error = info.get("error") or "no CUDA device"
        print(f"CUDA driver: not available ({error})")
    return status


def _simulate_engine() -> str:
    """Which fake GPU ``ab --simulate`` uses here, and why, for `info`."""
    from cudapool.fakegpu.native import why_unavailable

    why = why_unavailable()
    if why is None:
        from cudapool import _torch_fakecuda

        return (
            f"the native engine (cudapool._torch_fakecuda, built for torch {_torch_fakecuda.torch_version}: torch's "
            "own CUDA paths, fast)"
        )
    return f"the python engine (torch's fake tensors, about 25 times slower): the native one cannot run: {why}"


def _bridge_status() -> str:
    """Which way enable() makes cudapool torch's allocator, and why, for `info`."""
    from cudapool import _torch, _torch_libraries

    if _torch.enabled():
        return str(_torch.allocator_path())
    lib, why = _torch_libraries.load_bridge()
    if lib is not None:
        return f"bridge (torch's own allocator interface: {_torch_libraries.torch_bridge_library_path()})"
    if not why:
        return f"pluggable ({_torch_libraries.BRIDGE_ENV}=0 asks for torch's CUDAPluggableAllocator)"
    return f"pluggable, the fallback: {why}"


def _pool_kind(wanted: bool, supported: bool, why: str, stitching: bool = False) -> str:
    """Which kind of segments a device's pool uses, and why, for `info`."""
    if not wanted:
        return "plain segments (expandable_segments and page_stitching are off)" + (
            "" if supported else f"; page-mapped memory: {why}"
        )
    key = "page_stitching:True" if stitching else "expandable_segments:True"
    if supported:
        what = "page-mapped segments with stitched ranges" if stitching else "page-mapped segments"
        return f"{what} ({key}; the device supports page-mapped memory)"
    return f"plain segments: {key}, but {why}"


def cmd_replay(ns: argparse.Namespace) -> int:
    import pickle

    from cudapool._units import parse_size
    from cudapool.lab import capacity as cap_mod
    from cudapool.lab import peak_snapshot, replay_report
    from cudapool.lab import replay as rp
    from cudapool.lab.trace import load

    path = ns.trace
    if not os.path.isfile(path):
        _err(f"cannot replay {path!r}: no such file")
        return EXIT_USAGE
    try:
        capacity = parse_size(ns.capacity) if ns.capacity is not None else None
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, not {ns.capacity!r}")
        rp.config_text(ns.policy, ns.config)  # an unknown policy or a bad config: before loading
    except ValueError as exc:
        _err(str(exc))
        return EXIT_USAGE
    try:
        trace = load(path)
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        message = str(exc)
        _err(f"cannot read {message}" if message.startswith(path) else f"cannot read {path}: {message}")
        return EXIT_USAGE
    try:
        result = rp.replay(
            trace,
            policy=ns.policy,
            config=ns.config,
            capacity=capacity,
            device=ns.device,
            progress=not ns.no_progress,
            window_start=not ns.empty_start,
            lag=ns.lag,
            releases=not ns.ignore_releases,
        )
        if ns.min_capacity:
            if capacity is not None:
                _err("--min-capacity finds the capacity itself: give --capacity or --min-capacity, not both")
                return EXIT_USAGE
            found = cap_mod.min_capacity(
                trace,
                policy=ns.policy,
                config=ns.config,
                device=ns.device,
                unlimited=result,
                progress=None if ns.no_progress or ns.json == "-" else sys.stderr,
                window_start=not ns.empty_start,
                lag=ns.lag,
                releases=not ns.ignore_releases,
            )
            at = found["at_min"]
            result["min_capacity"] = found["min_capacity"]
            result["min_capacity_ratio"] = found["ratio"]
            result["min_capacity_tries"] = found["tries"]
            result["at_min_capacity"] = {k: at[k] for k in cap_mod.AT_MIN_KEYS if k in at}
    except ValueError as exc:  # a device the trace does not have
        _err(str(exc))
        return EXIT_USAGE
    except rp.ReplayError as exc:
        _err(str(exc))
        return 1
    if ns.snapshot_at_peak:
        try:
            from cudapool import snapshots as snap_mod

            snap_mod.dump(
                peak_snapshot.snapshot_at_peak(trace, ns.policy, ns.config, capacity, ns.device), ns.snapshot_at_peak
            )
        except OSError as exc:
            _err(f"cannot write {ns.snapshot_at_peak}: {exc}")
            return EXIT_USAGE
    if ns.json == "-":
        print(json.dumps(result, indent=1))
        return 0
    sys.stdout.write(replay_report.format_report(result, title=f"{'trace':<16}{path}"))
    if ns.json:
        try:
            with open(ns.json, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
        except OSError as exc:
            _err(f"cannot write {ns.json!r}: {exc}")
            return EXIT_USAGE
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cudapool", description="cudapool: a stream-aware caching GPU memory allocator for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a script with cudapool enabled, then print the memory summary to stderr",
        description="Enable cudapool (configuration from CUDAPOOL_CONF), run SCRIPT as "
        "__main__ with ARGS, then print the memory summary of every device that has a pool "
        "to stderr. Exits with the script's status.",
    )
    run.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments")
    commands.add_parser(
        "ab",
        add_help=False,
        help="A/B: run a script under several allocators, each in a fresh process, and compare "
        "memory and time side by side; with --simulate, predicted without a GPU (python -m cudapool ab --help)",
    )
    commands.add_parser(
        "info",
        help="print cudapool's version and configuration, torch, the CUDA driver",
        description="Print cudapool's version and configuration (CUDAPOOL_CONF), torch's "
        "version and build, the CUDA driver and devices, and the pluggable allocator hooks "
        "torch offers. Never initialises CUDA.",
    )
    from cudapool.policies import DEFAULT_POLICY, POLICIES

    replay = commands.add_parser(
        "replay",
        help="replay an allocation trace on a simulated device and report memory and speed",
        description="Replay TRACE (a .cptrace file, or a torch memory snapshot pickle from "
        "torch.cuda.memory._dump_snapshot) through cudapool's pool on a simulated device, on "
        "the CPU, and report peak allocated and reserved memory, utilization, fragmentation, "
        "device allocations, speed, and where it ran out of memory if it did. A trace with "
        "several devices is replayed one pool per device.",
    )
    replay.add_argument("trace", metavar="TRACE", help="the trace file")
    replay.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"allocation policy: {', '.join(sorted(POLICIES))} (default: {DEFAULT_POLICY}); "
        "'builtin' follows PyTorch's built-in caching allocator",
    )
    replay.add_argument(
        "--capacity",
        metavar="BYTES",
        help="device memory: bytes or with a unit, e.g. 80GB (10^9), 16GiB (2^30), 512MiB (default: unlimited)",
    )
    replay.add_argument("--config", metavar="STR", help="configuration on top of the policy's: 'key:value,...'")
    replay.add_argument(
        "--lag",
        type=int,
        metavar="N",
        help="launches a stream of the simulated device may run behind the replay before its oldest "
        "completes (0: always idle; default: nothing runs until a call waits for the device)",
    )
    replay.add_argument("--device", type=int, metavar="N", help="replay only device N's events")
    replay.add_argument(
        "--min-capacity",
        action="store_true",
        help="also find the smallest device memory the trace runs on without running out of memory "
        "(bisection to 1 %% of peak allocated, the pool's whole out-of-memory ladder at each try); "
        "JSON key min_capacity",
    )
    replay.add_argument(
        "--ignore-releases",
        action="store_true",
        help="leave out the trace's recorded releases (a snapshot's segment_free/segment_unmap: empty_cache "
        "or the built-in allocator's out-of-memory retry), which are otherwise replayed as an empty_cache",
    )
    replay.add_argument(
        "--json", metavar="PATH", help="also write the result as JSON to PATH ('-': only JSON, to stdout)"
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    replay.add_argument(
        "--empty-start",
        action="store_true",
        help="start from an empty pool even when the trace is a window that began with memory live "
        "(a torch snapshot's history); its peak is then not comparable with the recorded run's",
    )
    replay.add_argument(
        "--snapshot-at-peak",
        metavar="PATH",
        help="also write the memory snapshot (memory_viz pickle) of the pool at its peak of reserved memory "
        "(python -m cudapool plot PATH draws it)",
    )
    plot = commands.add_parser(
        "plot",
        help="draw a memory snapshot (or a trace's, at its peak): segment map and timeline",
        description="Draw a memory snapshot pickle (cudapool.dump_snapshot, torch's _dump_snapshot, "
        "replay --snapshot-at-peak) as a PNG: one bar per segment with its blocks coloured by state, and "
        "allocated/reserved memory over the history. A trace (.cptrace) is replayed on a simulated device "
        "and drawn at its peak. Needs matplotlib.",
    )
    plot.add_argument("input", metavar="SNAPSHOT_OR_TRACE", help="a snapshot pickle or a .cptrace trace")
    plot.add_argument("-o", "--output", metavar="PNG", required=True, help="the image to write")
    plot.add_argument("--title", help="the figure's title (default: names the input)")
    plot.add_argument("--size", default="1200x900", metavar="WxH", help="image size in pixels (default 1200x900)")
    plot.add_argument("--policy", default="cudapool", help="a trace's replay policy (default cudapool)")
    plot.add_argument("--config", metavar="STR", help="a trace's replay configuration on top of the policy's")
    return parser


def cmd_plot(ns: argparse.Namespace) -> int:
    from cudapool import snapshots as snap_mod
    from cudapool.lab import plot as plot_mod

    path = ns.input
    if not os.path.isfile(path):
        _err(f"cannot plot {path!r}: no such file")
        return EXIT_USAGE
    try:
        w, h = (int(v) for v in ns.size.lower().split("x"))
    except ValueError:
        _err(f"--size must be WIDTHxHEIGHT in pixels, not {ns.size!r}")
        return EXIT_USAGE
    title = ns.title
    if path.endswith(".cptrace"):
        from cudapool.lab import peak_snapshot

        try:
            snap = peak_snapshot.snapshot_at_peak(path, ns.policy, ns.config)
        except ValueError as exc:
            _err(f"cannot replay {path}: {exc}")
            return EXIT_USAGE
        title = title or f"{os.path.basename(path)} at its peak (replayed on a simulated device)"
    else:
        try:
            snap = snap_mod.load(path)
        except snap_mod.SnapshotError as exc:
            _err(str(exc))
            return EXIT_USAGE
        title = title or os.path.basename(path)
    try:
        drawn = plot_mod.render(snap, ns.output, title=title, width_px=w, height_px=h)
    except (plot_mod.PlotError, ValueError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        _err(f"cannot write {ns.output}: {exc}")
        return EXIT_USAGE
    print(f"{ns.output}: {drawn['bars']} segments, {drawn['trace_points']} history records")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["ab"]:  # its own parser: everything after -- belongs to the script
        own = args[1 : args.index("--")] if "--" in args else args[1:]
        if "--simulate" in own:  # without a GPU: traced on a fake one, predicted by replay
            from cudapool.ab import simulate

            return simulate.main(args[1:])
        from cudapool.ab import command as _ab

        return _ab.main(args[1:])
    parser = build_parser()
    ns = parser.parse_args(args)
    if ns.command == "run":
        return cmd_run(ns.script, ns.args)
    if ns.command == "info":
        return cmd_info()
    if ns.command == "replay":
        return cmd_replay(ns)
    if ns.command == "plot":
        return cmd_plot(ns)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
