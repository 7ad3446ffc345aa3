"""Helpers shared by the benchmark scripts (run as ``python bench/<script>.py``, so this is importable)."""

from __future__ import annotations


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ``RssAnon``...) in bytes; 0 if absent."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0
