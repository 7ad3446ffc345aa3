"""Helpers shared by the benchmark scripts (run as ``python bench/<script>.py``, so this is importable)."""

from __future__ import annotations

import threading


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ``RssAnon``...) in bytes; 0 if absent."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """Samples ``RssAnon`` in a background thread; ``peak`` is the largest value seen."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.peak = proc_status("RssAnon")
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status("RssAnon"))
            self._stop.wait(self._every)

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status("RssAnon"))
