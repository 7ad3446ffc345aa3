"""Text from untrusted files made safe to show: the one escaping rule of the table and the HTML page.

Names and messages come from checkpoints anyone may have written. Every character that changes how the text
around it is laid out or read rather than showing itself is printed as an escape (``\\x1b``, ``\\u202e``):
C0/C1 controls (terminal escape sequences, a carriage return that overwrites a line), format characters
(category Cf: the bidirectional marks, overrides and isolates that reorder a name, zero-width joiners, the
Arabic letter mark U+061C, soft hyphens), the line and paragraph separators U+2028/U+2029 (categories Zl, Zp:
a new line in a table cell) and lone surrogates (unencodable).
"""

from __future__ import annotations

import unicodedata
from typing import Any

from ckptaudit.findings import safe_str

__all__ = ["clean"]

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _escape(ch: str) -> str:
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def clean(value: Any) -> str:
    """``value`` as text safe to print on a terminal or put in a page: the characters of the categories above
    escaped, everything else unchanged."""
    text = safe_str(value)  # never raises: a 5,001-digit int key is described, not written out
    if text.isprintable():  # False for every escaped category (and for spaces other than " "): the fast path
        return text
    return "".join(_escape(ch) for ch in text)
