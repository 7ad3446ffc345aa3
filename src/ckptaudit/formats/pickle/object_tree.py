"""Bounding a loaded object tree before anything walks it recursively: depth, cycles, expanded size."""

from __future__ import annotations

import sys
from typing import Any

from ckptaudit.formats.pickle.scan import MAX_DEPTH, MAX_NODES

__all__ = ["check_tree"]


_LEAF_TYPES = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None)})


def _unpickled_types() -> Any:
    """The unpickler's module (its ``Opaque`` and ``PickledRecord``), or ``None`` when it was never imported: then
    no such object exists, and a JSON tree (safetensors headers) is checked without importing it."""
    return sys.modules.get("ckptaudit.formats.pickle.unpickler")


def _children(value: Any, unpickled: Any) -> list[Any] | tuple[Any, ...] | None:
    """The sub-objects of a container (dataclass instances, such as DCP metadata, through their fields)."""
    if type(value) in _LEAF_TYPES:
        return None
    # The data itself (``dict.items(d)``), never a method a pickle could have shadowed (``d.items()``).
    if unpickled is not None:
        if isinstance(value, unpickled.Opaque):
            return [value.args, value.state]
        if isinstance(value, unpickled.PickledRecord):
            return unpickled.PickledRecord.values(value)
    if isinstance(value, dict):
        out = [x for kv in dict.items(value) for x in kv]
        if type(value) is not dict:
            out += list(dict.values(vars(value)))
        return out
    if isinstance(value, list | tuple):
        return value
    if isinstance(value, set | frozenset):
        return list(value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return list(dict.values(vars(value)))
    return None


def check_tree(obj: Any, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> str | None:
    """Why a loaded object tree is unsafe to walk recursively, or ``None``: cyclic, nested deeper than
    ``max_depth``, or more than ``max_nodes`` nodes once shared sub-trees are expanded (a pickle can share one
    list a billion times through its memo). Iterative; costs one visit per distinct object, not per path."""
    too_many = f"the loaded object tree has more than {max_nodes} nodes (shared sub-trees counted each time)"
    too_deep = f"the loaded object tree nests deeper than {max_depth} levels"
    unpickled = _unpickled_types()
    root = _children(obj, unpickled)
    if root is None:
        return None
    done: dict[int, tuple[int, int]] = {}  # id -> (nodes of the expanded sub-tree, height), once visited
    pending: dict[int, tuple[int, int, list[Any]]] = {}  # id -> (own nodes, own height, container children)
    on_path: set[int] = set()
    seen = 0
    todo: list[tuple[Any, Any, bool]] = [(obj, root, False)]
    while todo:
        node, children, finished = todo.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            n, h, containers = pending.pop(key)
            for c in containers:
                cn, ch = done[id(c)]
                n, h = n + cn, max(h, ch + 1)
            done[key] = (n, h)
            if n > max_nodes:
                return too_many
            if h > max_depth:
                return too_deep
            continue
        if key in done:  # a shared sub-tree, already measured
            continue
        if key in on_path:
            return "the loaded object tree contains itself (a cycle)"
        if len(on_path) >= max_depth:
            return too_deep
        seen += len(children) + 1
        if seen > max_nodes:
            return too_many
        on_path.add(key)
        todo.append((node, None, True))
        n, h, containers = 1, 1, []
        for c in children:
            if type(c) in _LEAF_TYPES:
                n += 1
                continue
            if id(c) in done:
                containers.append(c)
                continue
            grand = _children(c, unpickled)
            if grand is None:
                n += 1
            elif not grand:  # an empty container: counted here, no bookkeeping
                n, h = n + 1, max(h, 2)
            else:
                containers.append(c)
                todo.append((c, grand, False))
        pending[key] = (n, h, containers)
    return None
