"""Untrusted values as text, whatever their type and size: the one formatter of keys and values from checkpoints.

A checkpoint's keys and values are data anyone may have written: a dict key that is a 5,001-digit int (``str()``
raises ``ValueError`` past Python's int-to-text limit, 4,300 digits), a tuple holding one, a string of a million
characters. Every name, message, JSON document and page that shows such a value goes through :func:`safe_str`
(or :func:`safe_repr`): it never raises and its text is bounded. Escaping the characters that change how text
is laid out is the renderers' job (:func:`ckptaudit.report.text.clean`, which calls :func:`safe_str` first).

Foundation: imports nothing of ours, so readers, layouts and the report share it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_INT_BITS", "safe_repr", "safe_str"]

MAX_INT_BITS = 9_000
"""Ints up to this many bits (about 2,700 digits, under Python's 4,300-digit limit) are written out; larger ones
are described by their size (``<int of 16,612 bits>``)."""


def _int_text(value: int) -> str:
    if value.bit_length() <= MAX_INT_BITS:
        return int.__repr__(value)
    sign = "-" if value < 0 else ""
    return f"<{sign}int of {value.bit_length():,} bits>"


def _bounded(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    keep = max(limit - 24, 8)
    return f"{text[:keep]}...(+{len(text) - keep:,} chars)"


def _fallback(value: Any) -> str:
    kind = type(value).__name__
    try:
        n = len(value)
    except Exception:  # noqa: BLE001 - any object: only its type is shown
        return f"<{kind}>"
    return f"<{kind} of {n} items>" if type(n) is int else f"<{kind}>"


def safe_str(value: Any, limit: int | None = None) -> str:
    """``str(value)`` that never raises: an int too large to write out is described by its size, any other
    value whose ``str()`` fails by its type; text longer than ``limit`` characters is cut (and says how much)."""
    kind = type(value)
    if kind is str:
        return _bounded(value, limit)
    if kind is int:
        return _bounded(_int_text(value), limit)
    if kind in (bool, float, type(None)):
        return str(value)
    if kind in (tuple, list) and len(value) <= 64:
        inner = ", ".join(safe_repr(v, limit) for v in value)
        text = f"({inner},)" if kind is tuple and len(value) == 1 else f"({inner})" if kind is tuple else f"[{inner}]"
        return _bounded(text, limit)
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - ValueError (int digits), RecursionError, a type's own failure
        return _fallback(value)
    return _bounded(text, limit) if type(text) is str else _fallback(value)


def safe_repr(value: Any, limit: int | None = None) -> str:
    """``repr(value)`` that never raises, bounded as :func:`safe_str` bounds it (strings quoted)."""
    kind = type(value)
    if kind is str:
        return _bounded(repr(value), limit)
    if kind is int or kind in (tuple, list) or kind in (bool, float, type(None)):
        return safe_str(value, limit)
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - as in safe_str
        return _fallback(value)
    return _bounded(text, limit) if type(text) is str else _fallback(value)
