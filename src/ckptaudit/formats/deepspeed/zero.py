"""ZeRO's partition arithmetic for :mod:`ckptaudit.formats.deepspeed.reader`: every parameter's fp32 master and moments
rebuilt from the data-parallel ranks' flat partitions (ZeRO-1/2 ``single_partition_of_fp32_groups``, ZeRO-3
``fp32_flat_groups``) as lazy :class:`TensorData` whose pieces point into those partitions, the way DeepSpeed's
``deepspeed/utils/zero_to_fp32.py`` does, and the frozen parameters' fragments likewise.

Pure: the trees come from the caller; nothing is read or materialised here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ckptaudit.formats.base import Part, Unreadable
from ckptaudit.formats.io.tensors import Piece, TensorData

_MAX_RANK_DIMS = 32


class _LayoutError(ValueError):
    """The files' own bookkeeping does not add up (damaged or hand-edited): the masters cannot be rebuilt."""


def _tree(part: Part | None) -> dict[str, Any] | None:
    return part.tree if part is not None and isinstance(part.tree, dict) else None


def _add_optimizer(tree: dict[str, Any], state: dict[str, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Merge one tensor-parallel rank's optimizer state (names already prefixed) into the tree's."""
    if not isinstance(tree["optimizer"], dict):
        tree["optimizer"] = {"state": {}, "param_groups": []}
    tree["optimizer"]["state"].update(state)
    tree["optimizer"]["param_groups"].extend(groups)


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > _MAX_RANK_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in value):
        raise _LayoutError(f"parameter shape {value!r} is not a tuple of non-negative ints")
    return tuple(value)


def _flat(value: Any, what: str) -> TensorData:
    """A saved flat partition: a 1-D tensor in one contiguous piece."""
    if not isinstance(value, TensorData):
        raise _LayoutError(f"{what} is {'unreadable' if isinstance(value, Unreadable) else 'not a tensor'}")
    if len(value.shape) != 1 or len(value.pieces) != 1 or not value.pieces[0].is_contiguous():
        raise _LayoutError(f"{what} is not a flat contiguous tensor (shape {list(value.shape)})")
    return value


# A segment: elements [src_start, src_start + length) of the flat ``src`` hold elements
# [logical_start, logical_start + length) of the parameter (row-major).
_Segment = tuple[TensorData, int, int, int]


def _assemble(shape: tuple[int, ...], segments: list[_Segment]) -> TensorData:
    """A lazy tensor of ``shape`` made of rectangular pieces of the flat partitions (nothing is read)."""
    numel = math.prod(shape)
    if sum(s[3] for s in segments) != numel:
        raise _LayoutError(f"partitions hold {sum(s[3] for s in segments)} elements of a parameter with {numel}")
    dtype = segments[0][0].dtype if segments else None
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    pieces: list[Piece] = []
    for src, src_start, logical_start, length in segments:
        if src.dtype != dtype:
            raise _LayoutError("the partitions of one parameter have different dtypes")
        if src_start < 0 or src_start + length > src.numel:
            raise _LayoutError(f"a slice [{src_start}, {src_start + length}) exceeds its partition's "
                               f"{src.numel} elements")
        p0 = src.pieces[0]
        for offsets, sizes in _blocks(shape, logical_start, length):
            first = sum(o * s for o, s in zip(offsets, strides, strict=True))
            pieces.append(Piece(p0.file, p0.data_offset, p0.storage_offset + src_start + (first - logical_start),
                                sizes, strides, offsets))
    if dtype is None:
        raise _LayoutError("a parameter with no elements has no partition to take its dtype from")
    return TensorData(dtype, shape, tuple(pieces))


def _blocks(shape: tuple[int, ...], start: int, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular blocks (offsets, sizes) covering the row-major element range ``[start, start + length)``."""
    if length <= 0:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (length,))]
    inner = math.prod(shape[1:])
    end = start + length
    row, col = divmod(start, inner)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if col:
        take = min(inner - col, length)
        out += [((row, *o), (1, *s)) for o, s in _blocks(shape[1:], col, take)]
        start += take
        row += 1
    full = (end - start) // inner
    if full > 0:
        out.append(((row, *(0 for _ in shape[1:])), (full, *shape[1:])))
        start += full * inner
        row += full
    if end > start:
        out += [((row, *o), (1, *s)) for o, s in _blocks(shape[1:], 0, end - start)]
    return out


def _base_state(osd: dict[str, Any], key: str, group: int) -> dict[str, Any]:
    """The base optimizer's state entry of flat group ``group`` (keyed by the group's one param index)."""
    base = osd.get(key)
    if not isinstance(base, dict):
        return {}
    state, groups = base.get("state"), base.get("param_groups")
    index: Any = group
    if isinstance(groups, list) and group < len(groups) and isinstance(groups[group], dict):
        ps = groups[group].get("params")
        if isinstance(ps, list) and len(ps) == 1:
            index = ps[0]
    entry = state.get(index) if isinstance(state, dict) else None
    return entry if isinstance(entry, dict) else {}


def _param_groups(osd: dict[str, Any], key: str, names: list[list[str]]) -> list[dict[str, Any]]:
    base = osd.get(key)
    raw = base.get("param_groups") if isinstance(base, dict) else None
    out = []
    for g, ns in enumerate(names):
        hyper = raw[g] if isinstance(raw, list) and g < len(raw) and isinstance(raw[g], dict) else {}
        out.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": list(ns)})
    return out


def _attach(name: str, shape: tuple[int, ...], numel: int, entries: list[dict[str, Any]],
            spans: Callable[[str, list[dict[str, Any]]], list[_Segment] | None]) -> dict[str, Any]:
    """The optimizer state of one parameter: per-element state rebuilt like the master, scalars from rank 0."""
    state: dict[str, Any] = {}
    for sname, value in entries[0].items():
        if isinstance(value, TensorData) and len(value.shape) == 1 and numel > 0:
            segments = spans(str(sname), entries)
            if segments is not None:
                state[str(sname)] = _assemble(shape, segments)
        elif isinstance(value, TensorData | Unreadable) or not isinstance(value, dict | list):
            state[str(sname)] = value
    return state


def _zero12(name_prefix: str, groups: list[list[tuple[str, tuple[int, ...]]]], states: list[dict[str, Any]],
            tree: dict[str, Any]) -> None:
    """ZeRO-1/2: per group, the ranks' saved partitions concatenated are the group's flat buffer (padding
    dropped); parameters follow in ``param_shapes`` order, each followed by its alignment padding."""
    parts: list[Any] = [s.get("single_partition_of_fp32_groups") for s in states]
    if not all(isinstance(p, list) and len(p) == len(groups) for p in parts):
        raise _LayoutError(f"single_partition_of_fp32_groups does not hold {len(groups)} group(s) on every rank")
    paddings = states[0].get("param_alignment_paddings")
    paddings = paddings if isinstance(paddings, list) else []
    state_tree: dict[str, dict[str, Any]] = {}
    for g, params in enumerate(groups):
        flats = [_flat(p[g], f"rank {r}'s partition of group {g}") for r, p in enumerate(parts)]
        bounds = [0]
        for f in flats:
            bounds.append(bounds[-1] + f.numel)
        pads = paddings[g] if g < len(paddings) else None
        if not (isinstance(pads, list) and len(pads) == len(params) and all(isinstance(x, int) for x in pads)):
            pads = [0] * len(params)
        entries = [_base_state(s, "base_optimizer_state", g) for s in states]

        def spans_of(lo: int, hi: int, sources: list[TensorData], bounds: list[int] = bounds) -> list[_Segment]:
            out: list[_Segment] = []
            for r, src in enumerate(sources):
                a, b = max(lo, bounds[r]), min(hi, bounds[r + 1])
                if a < b:
                    out.append((src, a - bounds[r], a - lo, b - a))
            return out

        offset = 0
        for (name, shape), pad in zip(params, pads, strict=True):
            numel = math.prod(shape)
            if offset + numel > bounds[-1]:
                raise _LayoutError(f"{name} would end at element {offset + numel} of group {g}, whose partitions "
                                   f"hold {bounds[-1]}")
            lo, hi = offset, offset + numel
            fqn = name_prefix + name
            tree["fp32_masters"][fqn] = (_assemble(shape, spans_of(lo, hi, flats)) if numel else
                                         TensorData(flats[0].dtype, shape, ()))

            def moment(sname: str, ents: list[dict[str, Any]], lo: int = lo, hi: int = hi,
                       flats: list[TensorData] = flats, spans_of: Any = spans_of) -> list[_Segment] | None:
                # The moments keep the partition padding the saved masters drop (last rank: longer by the pad).
                srcs = [e.get(sname) for e in ents]
                if not all(isinstance(s, TensorData) and len(s.shape) == 1 and s.numel >= f.numel
                           for s, f in zip(srcs, flats, strict=True)):
                    return None
                return spans_of(lo, hi, [_flat(s, sname) for s in srcs])  # type: ignore[no-any-return]

            state_tree[fqn] = _attach(fqn, shape, numel, entries, moment)
            offset = hi + max(0, pad)
        align = 2 * len(states)
        if align * math.ceil(offset / align) != align * math.ceil(bounds[-1] / align):
            raise _LayoutError(f"group {g}'s parameters use {offset} elements, its partitions hold {bounds[-1]}")
    _add_optimizer(tree, state_tree, _param_groups(states[0], "base_optimizer_state",
                                                   [[name_prefix + n for n, _ in ps] for ps in groups]))


def _zero3(name_prefix: str, groups: list[list[tuple[str, tuple[int, ...]]]], states: list[dict[str, Any]],
           tree: dict[str, Any]) -> None:
    """ZeRO-3: in each group's flat partition every parameter takes ``ceil(numel / world)`` elements per rank;
    rank r's slice holds elements ``[r * part, (r + 1) * part)`` of the parameter, the last one padded."""
    world = len(states)
    flats_all: list[Any] = [s.get("fp32_flat_groups") for s in states]
    if not all(isinstance(f, list) and len(f) == len(groups) for f in flats_all):
        raise _LayoutError(f"fp32_flat_groups does not hold {len(groups)} group(s) on every rank")
    state_tree: dict[str, dict[str, Any]] = {}
    for g, params in enumerate(groups):
        flats = [_flat(f[g], f"rank {r}'s flat group {g}") for r, f in enumerate(flats_all)]
        if len({f.numel for f in flats}) != 1:
            raise _LayoutError(f"the ranks' flat partitions of group {g} differ in length "
                               f"({', '.join(str(f.numel) for f in flats)})")
        entries = [_base_state(s, "optimizer_state_dict", g) for s in states]
        offset = 0
        for name, shape in params:
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if offset + part > flats[0].numel:
                raise _LayoutError(f"{name} would end at element {offset + part} of group {g}, whose partitions "
                                   f"hold {flats[0].numel} per rank")

            def spans(sources: list[TensorData], offset: int = offset, part: int = part,
                      numel: int = numel) -> list[_Segment]:
                out: list[_Segment] = []
                for r, src in enumerate(sources):
                    n = min(part, numel - r * part)
                    if n > 0:
                        out.append((src, offset, r * part, n))
                return out

            fqn = name_prefix + name
            tree["fp32_masters"][fqn] = (_assemble(shape, spans(flats)) if numel else
                                         TensorData(flats[0].dtype, shape, ()))

            def moment(sname: str, ents: list[dict[str, Any]], spans: Any = spans,
                       flats: list[TensorData] = flats) -> list[_Segment] | None:
                srcs = [e.get(sname) for e in ents]
                if not all(isinstance(s, TensorData) and s.shape == flats[0].shape for s in srcs):
                    return None
                return spans([_flat(s, sname) for s in srcs])  # type: ignore[no-any-return]

            state_tree[fqn] = _attach(fqn, shape, numel, entries, moment)
            offset += part
        if offset != flats[0].numel:
            raise _LayoutError(f"group {g}'s parameters use {offset} elements per rank, its partitions hold "
                               f"{flats[0].numel}")
    _add_optimizer(tree, state_tree, _param_groups(states[0], "optimizer_state_dict",
                                                   [[name_prefix + n for n, _ in ps] for ps in groups]))


def _zero12_frozen(name_prefix: str, rank0: dict[str, Any], tree: dict[str, Any]) -> None:
    """ZeRO-1/2 frozen parameters: saved whole in ``frozen_param_fragments`` (no optimizer state, no master)."""
    frags = rank0.get("frozen_param_fragments")
    if isinstance(frags, dict):
        for name, value in frags.items():
            if isinstance(name, str) and isinstance(value, TensorData | Unreadable):
                tree["frozen"][name_prefix + name] = value


def _zero3_frozen(name_prefix: str, rank0: dict[str, Any], model_parts: dict[int, Part | None], world: int,
                  tree: dict[str, Any]) -> None:
    """ZeRO-3 frozen parameters: every rank's model states holds its slice in ``frozen_param_fragments``."""
    shapes = rank0.get("frozen_param_shapes")
    if not isinstance(shapes, dict) or not shapes:
        return
    trees = [_tree(model_parts.get(dp)) for dp in range(world)]
    for name, raw in shapes.items():
        if not isinstance(name, str):
            continue
        shape = _shape(raw)
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        frags = [t.get("frozen_param_fragments", {}).get(name) if t is not None and
                 isinstance(t.get("frozen_param_fragments"), dict) else None for t in trees]
        if not all(isinstance(f, TensorData) and len(f.shape) == 1 and f.numel >= min(part, numel - r * part)
                   for r, f in enumerate(frags)):
            tree["frozen"][name_prefix + name] = Unreadable(
                f"ZeRO-3 frozen parameter {name}: a rank's fragment is missing or unreadable")
            continue
        segments: list[_Segment] = []
        for r, f in enumerate(frags):
            n = min(part, numel - r * part)
            if n > 0:
                assert isinstance(f, TensorData)
                segments.append((_flat(f, name), 0, r * part, n))
        tree["frozen"][name_prefix + name] = _assemble(shape, segments)
