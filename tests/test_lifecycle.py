"""Threads, fork() and interpreter exit, through the entry points torch calls.

Every scenario runs in a fresh interpreter with a deadline: a deadlock fails the test (the
child is killed) instead of hanging the suite. The entry points are called through ctypes,
which releases the GIL for the call, so Python threads really run inside the pool at once.
Devices are simulated (no GPU needed).
"""

import subprocess
import textwrap

from scenario import ENTRY_POINTS, run_python

DEADLINE_S = 120

PRELUDE = (
    ENTRY_POINTS
    + """
import ctypes, os, sys, threading, time
import cudapool
from cudapool import _C

MiB = 1 << 20

def alloc(size, device=0, stream=0):
    out = ctypes.c_void_p()
    msg = ctypes.create_string_buffer(4096)
    rc = lib.cudapool_alloc_catching(size, device, stream, ctypes.byref(out), msg, len(msg))
    return (out.value if rc == 0 else None), rc, msg.value.decode()

def free(ptr, size, device=0, stream=0):
    lib.cudapool_free(ptr, size, device, stream)

def wait_child(pid, deadline_s=20.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "deadlocked"
"""
)


def run(body: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return run_python(code, timeout=timeout, python_args=["-W", "ignore::DeprecationWarning"])


def ok(body: str, timeout: float = DEADLINE_S) -> str:
    proc = run(body, timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


# -- Python threads ---------------------------------------------------------------------------


def test_python_threads_allocate_through_the_entry_points_at_once():
    out = ok(
        """
        _C.use_sim_devices(512 * MiB, count=2, auto_complete=False)
        THREADS, OPS = 8, 3000
        errors, done = [], []

        def worker(tid):
            import random
            rng = random.Random(tid)
            live = []
            try:
                for i in range(OPS):
                    if live and (len(live) > 16 or rng.random() < 0.45):
                        ptr, size, dev, stream = live.pop(rng.randrange(len(live)))
                        if rng.random() < 0.3:
                            lib.cudapool_record_stream(ptr, 1 + rng.randrange(4))
                        free(ptr, size, dev, stream)
                    else:
                        size = rng.choice([512, 3000, 200_000, 1 << 20, 3 * MiB, 12 * MiB])
                        dev, stream = rng.randrange(2), 1 + rng.randrange(4)
                        ptr, rc, msg = alloc(size, dev, stream)
                        if ptr is None:
                            if rc != 1:  # only out-of-memory is expected
                                errors.append((tid, rc, msg))
                            continue
                        ctypes.memset(ptr, tid, min(size, 4096))
                        live.append((ptr, size, dev, stream))
                    if i % 500 == 0:
                        lib.cudapool_empty_cache()
                        _testhooks.sim_complete_all(rng.randrange(2)) if _C.device_pools() else None
                for ptr, size, dev, stream in live:
                    free(ptr, size, dev, stream)
                done.append(tid)
            except BaseException as e:
                errors.append((tid, repr(e)))

        def reader():  # statistics and summaries while the workers run
            while len(done) + len(errors) < THREADS:
                for d in _C.device_pools():
                    _C.device_pool(d).stats()
                cudapool.memory_summary(0)
                time.sleep(0.001)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        threads.append(threading.Thread(target=reader))
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors
        for d in (0, 1):
            _testhooks.sim_complete_all(d)
            _C.device_pool(d).empty_cache()
            assert _C.device_pool(d).check() == 0, _C.device_pool(d).check_report()
            s = _C.device_pool(d).stats()
            assert s["allocated_bytes.all.current"] == 0 and s["allocation.all.current"] == 0, s
            assert s["reserved_bytes.all.current"] == 0, s
        allocs = sum(_C.device_pool(d).stats()["allocation.all.allocated"] for d in (0, 1))
        print("allocations", allocs)
        """
    )
    assert int(out.split("allocations")[1]) > 8 * 3000 // 3


# -- fork() -----------------------------------------------------------------------------------


def test_fork_while_another_thread_holds_the_pool_lock_does_not_deadlock_the_child():
    out = ok(
        """
        _C.use_sim_devices(256 * MiB, auto_complete=False)
        ptr, rc, msg = alloc(4 * MiB, 0, 1)
        assert rc == 0, msg
        lib.cudapool_record_stream(ptr, 2)
        _testhooks.sim_launch(0, 2, ptr, 4 * MiB)  # work on stream 2 uses it
        # The free records an event on stream 2 with the pool lock held; that call lasts 300 ms.
        _testhooks.sim_delay_nth(0, "event_record", 1, 300)
        t = threading.Thread(target=free, args=(ptr, 4 * MiB, 0, 1))
        t.start()
        while _testhooks.sim_delays_entered(0) == 0:
            time.sleep(0.001)
        forks = _testhooks.fork_count()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                p, rc, msg = alloc(1000, 0, 3)
                info = _C.device_pool(0).info()
                if p and info["pending_blocks"] == 1 and _C.device_pool(0).check() == 0:
                    free(p, 1000, 0, 3)
                    code = 0
            finally:
                os._exit(code)
        result = wait_child(pid)
        t.join()
        assert result == 0, result
        assert _testhooks.fork_count() == forks + 1
        _testhooks.sim_complete_all(0)
        _C.device_pool(0).empty_cache()
        assert _C.device_pool(0).check() == 0
        print("child", result)
        """
    )
    assert "child 0" in out


def test_forks_while_python_threads_allocate():
    out = ok(
        """
        _C.use_sim_devices(256 * MiB, count=2)
        stop = threading.Event()
        def worker(tid):
            import random
            rng = random.Random(tid)
            live = []
            while not stop.is_set():
                # at most 4 live per thread: the device never fills, so a failure is a bug
                if live and (len(live) >= 4 or rng.random() < 0.5):
                    free(*live.pop())
                else:
                    size, dev = rng.choice([700, 90_000, 2 * MiB, 11 * MiB]), rng.randrange(2)
                    ptr, rc, _ = alloc(size, dev, 1 + tid % 3)
                    if ptr:
                        live.append((ptr, size, dev, 1 + tid % 3))
            for item in live:
                free(*item)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads: t.start()
        results = []
        for _ in range(25):
            time.sleep(0.005)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = 0
                    for d in (0, 1):
                        p, rc, msg = alloc(5000, d, 7)
                        if p is None:
                            os.write(2, ("child: alloc on device %d: %s\\n" % (d, msg)).encode())
                            code = 2
                        elif _C.device_pool(d).check() != 0:
                            os.write(2, _C.device_pool(d).check_report().encode())
                            code = 3
                        else:
                            free(p, 5000, d, 7)
                finally:
                    os._exit(code)
            results.append(wait_child(pid))
        stop.set()
        for t in threads: t.join()
        assert results == [0] * 25, results
        for d in (0, 1):
            assert _C.device_pool(d).check() == 0
            assert _C.device_pool(d).stats()["allocated_bytes.all.current"] == 0
        print("forks", len(results))
        """
    )
    assert "forks 25" in out


# -- interpreter exit -------------------------------------------------------------------------


def test_exit_with_live_and_pending_allocations_is_clean_and_quick():
    proc = run(
        """
        _C.use_sim_devices(256 * MiB, count=2, auto_complete=False)
        kept = []
        for d in (0, 1):
            for size in (1000, 3 * MiB, 40 * MiB):
                ptr, rc, msg = alloc(size, d, 1)
                assert rc == 0, msg
                kept.append((ptr, size, d))
        lib.cudapool_record_stream(kept[1][0], 2)
        free(kept[1][0], kept[1][1], 0, 1)  # pending on stream 2 at exit
        # A daemon thread still allocating when the interpreter goes away.
        def spin():
            while True:
                p, rc, _ = alloc(4096, 0, 3)
                if p:
                    free(p, 4096, 0, 3)
        threading.Thread(target=spin, daemon=True).start()
        time.sleep(0.05)
        print("exiting with", _C.device_pool(0).info()["live_blocks"] + _C.device_pool(1).info()["live_blocks"], "live")
        """,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "exiting with" in proc.stdout


def test_frees_at_exit_after_the_driver_shut_down_are_quiet_and_harmless():
    proc = run(
        """
        _C.use_sim_devices(256 * MiB, auto_complete=False)

        class Tensor:  # frees itself when the interpreter tears its module down
            _write = os.write
            def __init__(self, size, stream, other_stream=None):
                self.size, self.stream = size, stream
                self.ptr, rc, msg = alloc(size, 0, stream)
                assert rc == 0, msg
                if other_stream is not None:
                    lib.cudapool_record_stream(self.ptr, other_stream)
            def __del__(self, free=free):
                free(self.ptr, self.size, 0, self.stream)
                self._write(1, b"freed %d\\n" % self.size)

        plain = Tensor(3 * MiB, 1)
        recorded = Tensor(5 * MiB, 1, other_stream=2)   # its free must record an event
        cudapool_keep = [Tensor(1000, 1, other_stream=3) for _ in range(10)]

        # Before exit a failing free says so on stderr...
        probe = Tensor(2000, 1, other_stream=2)
        _testhooks.sim_set_lost(0)
        del probe
        sys.stderr.flush()
        print("before-exit-report-printed")
        # ...at exit the driver is gone (every device call fails): frees stay quiet.
        """,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    # Exactly the one report from before exit, naming the lost device.
    assert len(lines) == 1, proc.stderr
    assert "cudapool: free(" in lines[0] and "device lost" in lines[0]
    assert "before-exit-report-printed" in proc.stdout
    # The twelve frees did run during teardown (and failed quietly, the device being gone).
    assert proc.stdout.count("freed ") == 13, proc.stdout


def test_shutdown_with_the_driver_gone_returns_every_host_byte_and_does_not_hang():
    out = ok(
        """
        _C.use_sim_devices(256 * MiB, auto_complete=False)
        for size in (1000, 3 * MiB, 30 * MiB):
            ptr, rc, msg = alloc(size, 0, 1)
            lib.cudapool_record_stream(ptr, 2)
            free(ptr, size, 0, 1)      # pending on stream 2
        ptr, rc, msg = alloc(7 * MiB, 0, 1)   # still live
        _testhooks.sim_set_lost(0)
        p, rc, msg = alloc(64 * MiB, 0, 1)    # needs a new segment: the device is gone
        assert p is None and rc != 0 and "device lost" in msg, (rc, msg)
        assert _C.device_pool(0).check() == 0
        t0 = time.monotonic()
        _C.shutdown()
        assert _C.device_pools() == []
        print("shutdown took %.3f s" % (time.monotonic() - t0))
        """,
        timeout=30,
    )
    assert "shutdown took" in out
