"""Byte-based progress lines on stderr (rate and ETA), quiet enough for CI logs.

A line at most every `every` seconds and one at the end; no carriage-return redraws, so logs
captured from a pipe stay readable.
"""

from __future__ import annotations

import sys
import time


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


class Progress:
    def __init__(self, label: str, total: int, every: float = 5.0, stream=None):
        self.label, self.total, self.every = label, max(1, total), every
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._print(now)

    def finish(self) -> float:
        now = time.monotonic()
        self._print(now, final=True)
        return now - self.start

    def _print(self, now: float, final: bool = False) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if final:
            tail = f"done in {elapsed:.1f}s"
        else:
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            tail = f"ETA {eta:.0f}s"
        print(f"{self.label}: {100 * self.done / self.total:3.0f}% {human(self.done)}/{human(self.total)} "
              f"{human(rate)}/s {tail}", file=self.stream, flush=True)
