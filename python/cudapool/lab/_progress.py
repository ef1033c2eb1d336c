"""The progress bar of a long replay: one line on a stream, redrawn in place."""

from __future__ import annotations

import time
from typing import IO

__all__ = ["ProgressBar"]

#: Seconds between two redraws of the progress bar.
PROGRESS_INTERVAL_S = 0.1


def _fmt_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def _fmt_duration(s: float) -> str:
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class ProgressBar:
    """One line on ``stream``, redrawn in place: bar, percentage, events done, rate, ETA."""

    WIDTH = 30

    def __init__(self, total: int, label: str, stream: IO[str]) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream
        self.t0 = time.perf_counter()
        self.last_draw = 0.0
        self.done = 0

    def update(self, done: int, force: bool = False) -> None:
        self.done = done
        now = time.perf_counter()
        if not force and now - self.last_draw < PROGRESS_INTERVAL_S:
            return
        self.last_draw = now
        elapsed = now - self.t0
        frac = min(done / self.total, 1.0)
        filled = int(frac * self.WIDTH)
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else 0.0
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {frac * 100:5.1f}%  {_fmt_count(done)}/{_fmt_count(self.total)} events"
            f"  {_fmt_count(rate)} ev/s  ETA {_fmt_duration(eta)} "
        )
        self.stream.flush()

    def close(self) -> None:
        self.update(self.done, force=True)
        self.stream.write("\n")
        self.stream.flush()
