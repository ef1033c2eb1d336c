"""python -m cudapool ab: the command line, and the orchestration with stand-in CPU scripts.

The stand-ins report their memory figures through cudapool.ab._report_memory (the hook a
script without a GPU uses in place of the allocator's statistics) and run out of memory by
raising what cudapool raises then without cudapool._torch_oom: a RuntimeError whose message
starts with "CUDA out of memory". They do not import torch (except where said), so each run
is a fresh Python process of a fraction of a second.
"""

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
from cudapool import ab
from cudapool.ab import command as _ab
from cudapool.ab import common

MiB = 1 << 20


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# A stand-in training script: --batch-size B, --steps N; "out of memory" above --limit; peak
# reserved depends on the allocator the run is under (ab.allocator()).
STAND_IN = """
    import argparse, sys, time
    import cudapool.ab as ab

    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=1 << 30)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--step-s", type=float, default=0.0)
    a = p.parse_args()
    factor = {"builtin": 1.25, "expandable": 1.10}.get(ab.allocator(), 1.02)
    if a.batch_size > a.limit:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (stand-in)")
    for i in range(a.steps):
        time.sleep(a.step_s * (5 if i < 2 else 1))
        ab.step()
    ab._report_memory(0, peak_allocated=a.batch_size * 32 * 2**20,
                      peak_reserved=int(a.batch_size * 32 * 2**20 * factor), device_allocs=a.batch_size)
    print("stand-in done under", ab.allocator())
"""


def run_ab(capsys, *argv):
    """_ab.main in this process: (status, stdout, stderr)."""
    status = _ab.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def load(path):
    with open(path) as f:
        return json.load(f)


# -- the command line ---------------------------------------------------------------------------


def test_allocator_list_and_variants():
    allocs = common.parse_allocators("builtin,expandable,async,cudapool,cudapool:max_split_size_mb=256;policy=builtin")
    assert [a.label for a in allocs] == [
        "builtin",
        "expandable",
        "async",
        "cudapool",
        "cudapool:max_split_size_mb=256;policy=builtin",
    ]
    assert allocs[0] == common.Allocator("builtin", None, None)
    assert allocs[1].torch_conf == "expandable_segments:True"
    assert allocs[2].torch_conf == "backend:cudaMallocAsync"
    assert allocs[3] == common.Allocator("cudapool", None, "")
    assert allocs[4].cudapool_conf == "max_split_size_mb:256,policy:builtin"
    assert common.parse_allocators("cudapool:policy=expandable")[0].cudapool_conf == "policy:expandable"


@pytest.mark.parametrize(
    "text, words",
    [
        ("cudapool:no_such_key=1", ["no_such_key"]),
        ("cudapool:max_split_size_mb=lots", ["max_split_size_mb"]),
        ("cudapool:policy=nope", ["policy", "nope"]),
        ("cudapool:max_split_size_mb", ["KEY=VALUE"]),
        ("cudapool:", ["empty"]),
        ("tcmalloc", ["unknown allocator", "tcmalloc"]),
        ("builtin,builtin", ["twice"]),
        ("builtin,,cudapool", ["empty entry"]),
        ("expandable:x=1", ["unknown allocator"]),
    ],
)
def test_bad_allocators_are_usage_errors(text, words):
    with pytest.raises(common.UsageError) as info:
        common.parse_allocators(text)
    for word in words:
        assert word in str(info.value)


def test_options_parse(tmp_path):
    script = write(tmp_path, "s.py", "pass\n")
    o = _ab.parse_args(
        ["--allocators", "builtin,cudapool", "--repeat", "3", "--timeout", "5", "--step-marker"]
        + ["--find-max-batch", "--batch-size", "--max-batch-range", "2:64", "--nproc-per-node", "2"]
        + ["--", script, "--batch-size", "4", "--", "x"]
    )
    assert [a.label for a in o.allocators] == ["builtin", "cudapool"]
    assert (o.repeat, o.timeout, o.step_marker, o.warmup_steps) == (3, 5.0, True, _ab.DEFAULT_WARMUP_STEPS)
    assert (o.find_max_batch, o.max_batch_range, o.nproc_per_node) == ("--batch-size", (2, 64), 2)
    assert (o.script, o.args) == (script, ["--batch-size", "4", "--", "x"])
    defaults = _ab.parse_args(["--", script])
    assert [a.label for a in defaults.allocators] == ["builtin", "expandable", "async", "cudapool"]
    assert defaults.max_batch_range == common.DEFAULT_RANGE and defaults.find_max_batch is None


@pytest.mark.parametrize(
    "argv, words",
    [
        (["SCRIPT"], ["put -- before the script"]),
        (["--repeat", "2", "SCRIPT"], ["put -- before the script"]),
        (["--"], ["no script"]),
        (["--", "/no/such/script.py"], ["no such file"]),
        (["--repeat", "0", "--", "SCRIPT"], ["--repeat"]),
        (["--timeout", "-1", "--", "SCRIPT"], ["--timeout"]),
        (["--find-max-batch", "--bs", "--max-batch-range", "9:3", "--", "SCRIPT"], ["LO <= HI"]),
        (["--find-max-batch", "--bs", "--max-batch-range", "a:b", "--", "SCRIPT"], ["LO:HI"]),
        (["--max-batch-range", "1:8", "--", "SCRIPT"], ["goes with --find-max-batch"]),
        (["--find-max-batch", "bs", "--", "SCRIPT"], ["name the script's option"]),
        (["--allocators", "cudapool:bogus=1", "--", "SCRIPT"], ["bogus"]),
        (["--nproc-per-node", "0", "--", "SCRIPT"], ["--nproc-per-node"]),
    ],
)
def test_bad_command_lines_exit_2_before_running(tmp_path, capsys, argv, words):
    marker = tmp_path / "ran"
    script = write(tmp_path, "s.py", f"open({str(marker)!r}, 'w').close()\n")
    argv = [script if a == "SCRIPT" else a for a in argv]
    status, out, err = run_ab(capsys, *argv)
    assert status == 2
    for word in words:
        assert word in err
    assert not marker.exists() and out == ""


def test_unknown_option_is_usage_error(tmp_path, capsys):
    script = write(tmp_path, "s.py", "pass\n")
    status, _, err = run_ab(capsys, "--no-such-option", "--", script)
    assert status == 2 and "unrecognized arguments" in err


def test_cli_entry_bad_key_and_help(tmp_path):
    script = write(tmp_path, "s.py", "pass\n")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in [common._package_root(), os.environ.get("PYTHONPATH")] if p)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "cudapool", "ab", "--allocators", "cudapool:max_split_sz=1", "--", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2 and "max_split_sz" in proc.stderr, proc.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "cudapool", "ab", "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert helped.returncode == 0 and "--find-max-batch" in helped.stdout and "-- SCRIPT" in helped.stdout
    top = subprocess.run([sys.executable, "-m", "cudapool", "--help"], capture_output=True, text=True, env=env)
    assert " ab " in top.stdout


def test_with_arg_replaces_or_appends():
    with_arg = common.with_arg
    assert with_arg(["--batch-size", "8", "--lr", "1"], "--batch-size", 32) == ["--batch-size", "32", "--lr", "1"]
    assert with_arg(["--batch-size=8"], "--batch-size", 3) == ["--batch-size=3"]
    assert with_arg(["--lr", "1"], "--batch-size", 5) == ["--lr", "1", "--batch-size", "5"]
    assert with_arg(["--batch-size-x", "1"], "--batch-size", 5) == ["--batch-size-x", "1", "--batch-size", "5"]


@pytest.mark.parametrize("lo, hi", [(1, 4096), (1, 1), (3, 100), (1, 37), (5, 6)])
def test_bisection_finds_the_threshold_exactly(lo, hi):
    for threshold in sorted({lo - 1, lo, lo + 1, (lo + hi) // 2, 37, hi - 1, hi, hi + 5}):
        if threshold < 0:
            continue
        probes = []

        def ok(v, threshold=threshold):
            probes.append(v)
            assert lo <= v <= hi
            return v <= threshold

        found = common.bisect_max(ok, lo, hi)
        expected = None if threshold < lo else min(threshold, hi)
        assert found == expected, (lo, hi, threshold, probes)
        assert len(probes) == len(set(probes)) and len(probes) <= 2 * (hi - lo).bit_length() + 2


def test_spread_and_summary():
    assert _ab.spread([]) is None
    assert _ab.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert _ab.spread([1.0, 4.0])["median"] == 2.5


def test_step_marker_is_a_no_op_outside_ab(monkeypatch):
    monkeypatch.setattr(ab, "_times", None)
    monkeypatch.delenv(ab.ENV_ALLOCATOR, raising=False)
    ab.step()
    assert ab._times is None and ab.allocator() is None
    import cudapool

    assert cudapool.ab.step is ab.step


# -- runs ---------------------------------------------------------------------------------------


def test_runs_side_by_side_table_and_json(tmp_path, capsys):
    script = write(tmp_path, "train.py", STAND_IN)
    out_json = tmp_path / "out" / "ab.json"
    status, out, err = run_ab(
        capsys, "--allocators", "builtin,expandable", "--json", str(out_json), "--", script, "--batch-size", "16"
    )
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == f"python -m cudapool ab -- {script} --batch-size 16"
    header = lines[3]
    for word in ("allocator", "status", "wall time", "peak allocated", "peak reserved", "utilization"):
        assert word in header
    assert "device allocs" in header and "OOM" in header and "exit" in header
    rows = {line.split()[0]: line for line in lines[5:7]}
    assert "512.00 MiB" in rows["builtin"] and "640.00 MiB" in rows["builtin"] and "80.0 %" in rows["builtin"]
    assert "563.20 MiB" in rows["expandable"] and "90.9 %" in rows["expandable"]
    assert rows["builtin"].split()[1] == "ok" and rows["builtin"].rstrip().endswith("no     0")
    assert "[1/2] builtin, run 1/1" in err and "[2/2] expandable, run 1/1: ok" in err

    data = load(out_json)
    assert [r["allocator"] for r in data["rows"]] == ["builtin", "expandable"]
    run = data["runs"][0]
    assert run["status"] == "ok" and run["exit_status"] == 0 and run["oom"] is False
    (rank,) = run["ranks"]
    assert rank["allocator"] == "builtin" and rank["argv"] == [script, "--batch-size", "16"]
    assert rank["memory"]["devices"]["0"]["peak_reserved"] == 640 * MiB
    assert "stand-in done under builtin" in run["stdout_tail"]
    assert data["rows"][1]["peak_reserved"] == {"median": 590558003, "min": 590558003, "max": 590558003, "n": 1}
    assert data["cells"][0][0] == "allocator"


def test_failures_are_rows_not_crashes(tmp_path, capsys):
    script = write(
        tmp_path,
        "fail.py",
        """
        import sys, time
        mode = sys.argv[1]
        if mode == "raise":
            raise ValueError("the stand-in broke")
        if mode == "exit":
            sys.exit(3)
        if mode == "hang":
            time.sleep(120)
        if mode == "oom-caught":
            try:
                raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
            except RuntimeError:
                sys.exit(1)
        """,
    )
    results = {}
    for mode in ("raise", "exit", "hang", "oom-caught", "fine"):
        out_json = tmp_path / f"{mode}.json"
        # Only the hang meets its timeout; the others get one far past their run (a guard), so
        # that a slow start on a busy machine does not turn them into timeouts.
        timeout = "1.5" if mode == "hang" else "300"
        status, out, err = run_ab(
            capsys, "--allocators", "builtin", "--timeout", timeout, "--json", str(out_json), "--", script, mode
        )
        assert status == 0, err
        results[mode] = (out, load(out_json))
    out, data = results["raise"]
    run = data["runs"][0]
    assert (run["status"], run["exit_status"], run["oom"]) == ("failed", 1, False)
    assert run["ranks"][0]["exception"] == "ValueError: the stand-in broke"
    assert "builtin: ValueError: the stand-in broke" in out and "failed" in out.splitlines()[5]
    assert "ValueError: the stand-in broke" in run["stderr_tail"]

    out, data = results["exit"]
    run = data["runs"][0]
    assert (run["status"], run["exit_status"]) == ("failed", 3)
    assert out.splitlines()[5].rstrip().endswith("no     3")

    out, data = results["hang"]
    run = data["runs"][0]
    assert (run["status"], run["timed_out"], run["exit_status"], run["ranks"]) == ("timeout", True, None, [])
    assert run["process_s"] < 120  # killed, not left to end its sleep
    assert "timeout" in out.splitlines()[5] and "no statistics" in out

    out, data = results["oom-caught"]
    assert data["runs"][0]["status"] == "oom" and data["runs"][0]["exit_status"] == 1
    assert "yes" in out.splitlines()[5].split()

    out, data = results["fine"]
    row = out.splitlines()[5]
    assert data["runs"][0]["status"] == "ok" and row.count("n/a") == 4
    assert "builtin: memory figures unavailable: the script did not use torch" in out


def test_timeout_kills_the_whole_process_group(tmp_path, capsys, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    script = write(
        tmp_path,
        "spawn.py",
        f"""
        import os, subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r} + ".tmp", "w").write(str(p.pid))
        os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
        time.sleep(120)
        """,
    )
    # The run's timeout counts from the moment the grandchild exists, however slowly the script
    # started: ab's wait for the run is held until the pid file is there.
    real_wait = subprocess.Popen.wait

    def wait_once_spawned(self, timeout=None):
        if timeout == 1.5:
            deadline = time.monotonic() + 120
            while not pid_file.exists() and self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_wait(self, timeout=timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", wait_once_spawned)
    status, _, err = run_ab(capsys, "--allocators", "builtin", "--timeout", "1.5", "--", script)
    assert status == 0, err
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 60  # the kill is sent before ab returns; reaping may lag
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            pytest.fail("the script's own child outlived the timeout")
        time.sleep(0.1)


def test_torch_out_of_memory_error_is_recognised(tmp_path, capsys):
    pytest.importorskip("torch")
    script = write(tmp_path, "oom.py", "import torch\nraise torch.OutOfMemoryError('CUDA out of memory (stand-in)')\n")
    out_json = tmp_path / "oom.json"
    status, out, _ = run_ab(capsys, "--allocators", "builtin", "--json", str(out_json), "--", script)
    assert status == 0
    run = load(out_json)["runs"][0]
    assert (run["status"], run["oom"], run["exit_status"]) == ("oom", True, 1)
    assert run["ranks"][0]["exception"].startswith("OutOfMemoryError: CUDA out of memory")
    assert run["ranks"][0]["memory"]["available"] is False  # no GPU here: CUDA was never used
    assert "oom" in out.splitlines()[5]


def test_medians_and_spread_over_repeats(tmp_path, capsys):
    counter = tmp_path / "n"
    script = write(
        tmp_path,
        "vary.py",
        f"""
        import os, time
        import cudapool.ab as ab
        path = {str(counter)!r}
        n = int(open(path).read()) + 1 if os.path.exists(path) else 1
        open(path, "w").write(str(n))
        ab._report_memory(0, peak_allocated=n * 2**20, peak_reserved=n * 2 * 2**20, device_allocs=10 * n)
        """,
    )
    out_json = tmp_path / "rep.json"
    status, out, _ = run_ab(capsys, "--allocators", "builtin", "--repeat", "3", "--json", str(out_json), "--", script)
    assert status == 0
    row = load(out_json)["rows"][0]
    assert row["runs"] == 3 and row["ok"] == 3
    assert row["peak_reserved"] == {"median": 4 * MiB, "min": 2 * MiB, "max": 6 * MiB, "n": 3}
    assert row["device_allocs"] == {"median": 20, "min": 10, "max": 30, "n": 3}
    assert row["utilization"]["median"] == 0.5
    line = out.splitlines()[5]
    assert "ok 3/3" in line and "4.00 (2.00–6.00) MiB" in line and "20 (10–30)" in line
    assert "medians (min–max)" in out.splitlines()[1]


def test_step_marker_median_and_warm_up(tmp_path, capsys):
    script = write(tmp_path, "train.py", STAND_IN)
    out_json = tmp_path / "steps.json"
    status, out, _ = run_ab(
        capsys,
        "--allocators",
        "builtin",
        "--step-marker",
        "--warmup-steps",
        "2",
        "--json",
        str(out_json),
        "--",
        script,
        "--steps",
        "8",
        "--step-s",
        "0.02",
    )
    assert status == 0
    run = load(out_json)["runs"][0]
    times = run["ranks"][0]["step_times"]
    assert len(times) == 8 and run["steps"] == 8
    assert min(times[:2]) >= 0.1  # the stand-in's warm-up steps are 5x slower
    assert min(times[2:]) >= 0.02  # a step is at least its sleep; a busy machine only adds
    assert run["step_median_s"] == statistics.median(times[2:])
    assert run["warmup_s"] == pytest.approx(sum(times[:2]))
    assert "step (median)" in out and "warm-up" in out and "the first 2 as warm-up" in out
    # without --step-marker, step() records nothing
    status, _, _ = run_ab(capsys, "--allocators", "builtin", "--json", str(out_json), "--", script, "--steps", "3")
    assert load(out_json)["runs"][0]["ranks"][0]["step_times"] is None


def test_find_max_batch_is_exact(tmp_path, capsys):
    script = write(tmp_path, "train.py", STAND_IN)
    out_json = tmp_path / "max.json"
    status, out, err = run_ab(
        capsys,
        "--allocators",
        "builtin,expandable",
        "--find-max-batch",
        "--batch-size",
        "--json",
        str(out_json),
        "--",
        script,
        "--batch-size",
        "4",
        "--limit",
        "37",
    )
    assert status == 0, err
    data = load(out_json)
    for label in ("builtin", "expandable"):
        found = data["max_batch"]["results"][label]
        assert found["max"] == 37 and found["range"] == [1, 4096]
        values = [p["value"] for p in found["probes"]]
        assert values[:7] == [1, 2, 4, 8, 16, 32, 64] and 38 in values and 37 in values
        assert all((p["status"] == "ok") == (p["value"] <= 37) for p in found["probes"])
        assert all(p["oom"] for p in found["probes"] if p["value"] > 37)
    assert "max --batch-size" in out.splitlines()[3]
    assert out.splitlines()[5].rstrip().endswith("37")
    assert "max --batch-size, builtin: --batch-size 38: oom" in err


def test_find_max_batch_range_edges(tmp_path, capsys):
    script = write(tmp_path, "train.py", STAND_IN)
    out_json = tmp_path / "edge.json"
    status, out, _ = run_ab(
        capsys,
        "--allocators",
        "builtin",
        "--find-max-batch",
        "--batch-size",
        "--max-batch-range",
        "8:20",
        "--json",
        str(out_json),
        "--",
        script,
        "--limit=5",
    )
    assert status == 0
    found = load(out_json)["max_batch"]["results"]["builtin"]
    assert found["max"] is None and [p["value"] for p in found["probes"]] == [8]
    assert "none ≥ 8" in out


def test_cudapool_variant_enables_in_the_child(tmp_path, capsys):
    pytest.importorskip("torch")
    script = write(
        tmp_path,
        "check.py",
        """
        import cudapool, cudapool.ab as ab
        from cudapool import _torch
        assert cudapool.enabled(), "not enabled"
        print("CONFIG", _torch.enabled_config())
        ab._report_memory(0, peak_allocated=1 << 20, peak_reserved=2 << 20)
        """,
    )
    out_json = tmp_path / "v.json"
    status, out, err = run_ab(
        capsys, "--allocators", "cudapool:max_split_size_mb=256", "--json", str(out_json), "--", script
    )
    assert status == 0, err
    run = load(out_json)["runs"][0]
    assert run["status"] == "ok", run["stderr_tail"]
    assert "max_split_size_mb:256" in run["ranks"][0]["config"]
    assert run["ranks"][0]["allocator"] == "cudapool:max_split_size_mb=256"


# -- torchrun -----------------------------------------------------------------------------------

DIST = """
    import os
    import torch
    import torch.distributed as dist
    import cudapool.ab as ab

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    assert t[0].item() == 3.0
    ab.step()
    ab._report_memory(0, peak_allocated=(rank + 1) * 2**20, peak_reserved=(rank + 1) * 4 * 2**20)
    dist.destroy_process_group()
"""


def test_torchrun_two_ranks_worst_rank_shown(tmp_path, capsys):
    pytest.importorskip("torch")
    script = write(tmp_path, "dist.py", DIST)
    out_json = tmp_path / "dist.json"
    status, out, err = run_ab(
        capsys,
        "--allocators",
        "builtin",
        "--nproc-per-node",
        "2",
        "--timeout",
        "300",  # a guard against a hang: two ranks start in seconds
        "--step-marker",
        "--json",
        str(out_json),
        "--",
        script,
    )
    assert status == 0, err
    run = load(out_json)["runs"][0]
    assert run["status"] != "timeout", run["stderr_tail"]
    if run["status"] != "ok" and not run["ranks"]:
        pytest.skip(f"torchrun cannot start here: {run.get('note') or run['stderr_tail'][-500:]}")
    assert run["status"] == "ok", run["stderr_tail"]
    assert [r["rank"] for r in run["ranks"]] == [0, 1] and all(r["world_size"] == 2 for r in run["ranks"])
    assert run["worst_rank"] == 1 and run["peak_reserved"] == 8 * MiB
    assert "torchrun --nproc-per-node 2" in out and "8.00 MiB" in out.splitlines()[5]
