"""Reading JSON from an untrusted checkpoint: bounded size, nesting and number of containers, checked before parsing.

``json.loads`` of hostile text can recurse past Python's stack (``[[[[...``), build gigabytes from megabytes
(``[{},{},{},...]``: 3 bytes of text make a 64-byte dict) or fail on a 5000-digit integer. Every JSON file
ckptaudit reads from a checkpoint (``manifest.json``, ``trainer_state.json``, shard indexes, the safetensors
header, other ``*.json``) goes through :func:`loads_limited` or :func:`read_json_limited`: size and containers
are bounded before parsing, nesting while and after parsing, and every failure is a :class:`JsonLimitError` or
``ValueError`` naming the file and the limit, never a traceback.
"""

from __future__ import annotations

import json
from typing import Any

from ckptaudit.formats.object_tree import check_tree
from ckptaudit.formats.safeio import read_limited

__all__ = ["MAX_JSON_CONTAINERS", "MAX_JSON_DEPTH", "JsonLimitError", "loads_limited", "read_json_limited"]

MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays (real checkpoint files: under 10)."""
MAX_JSON_CONTAINERS = 1_000_000
"""Most objects and arrays in one file, counted before parsing as the ``{`` and ``[`` bytes (an upper bound:
brackets inside strings count too). A 200k-tensor manifest has about 200k; ``trainer_state.json`` of a long run
about 100k. ``[{},{},...]`` would otherwise build 64 bytes of dict from each 3 bytes of text."""


class JsonLimitError(ValueError):
    """JSON text nested deeper, or holding more containers, than the reader's limits."""


def loads_limited(raw: bytes | str, what: str, *, max_depth: int = MAX_JSON_DEPTH,
                  max_containers: int = MAX_JSON_CONTAINERS, unique_keys: bool = False,
                  parse_int: Any = None) -> Any:
    """``json.loads(raw)`` within the limits: the containers are counted before parsing (in C, by
    ``bytes.count``), a nesting deeper than Python's recursion limit stops the parser cleanly, and the parsed
    tree's depth is checked after. Raises :class:`JsonLimitError` past a limit and ``ValueError`` for text that is
    not JSON (bad UTF-8, integers beyond Python's digit limit), each naming ``what``. ``unique_keys``: an object
    that names one key twice is not valid (``json.loads`` would keep the last silently). ``parse_int``: as
    ``json.loads``'s."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    containers = data.count(b"{") + data.count(b"[")
    if containers > max_containers:
        raise JsonLimitError(f"{what} holds up to {containers} objects and arrays, more than the reader's limit "
                             f"of {max_containers}")
    try:
        value = json.loads(data, object_pairs_hook=_unique if unique_keys else None, parse_int=parse_int)
    except RecursionError:
        raise JsonLimitError(f"{what} nests deeper than the reader's limit of {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the int digit limit
        raise ValueError(f"{what} is not valid JSON ({exc})") from None
    problem = check_tree(value, max_depth=max_depth)
    if problem is not None:
        raise JsonLimitError(f"{what}: {problem}")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {dup!r} appears twice in one object")
    return out


def read_json_limited(path: str, max_bytes: int, what: str, *, max_depth: int = MAX_JSON_DEPTH,
                      max_containers: int = MAX_JSON_CONTAINERS) -> Any:
    """The parsed JSON of a regular file of at most ``max_bytes`` (opened without blocking, size checked first,
    see :func:`~ckptaudit.formats.safeio.read_limited`), within :func:`loads_limited`'s limits."""
    return loads_limited(read_limited(path, max_bytes, what), what, max_depth=max_depth,
                         max_containers=max_containers)
