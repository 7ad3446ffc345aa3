"""ZeRO's partition arithmetic for :mod:`ckptaudit.formats.deepspeed.reader`: every parameter's fp32 master and moments
rebuilt from the data-parallel ranks' flat partitions (ZeRO-1/2 ``single_partition_of_fp32_groups``, ZeRO-3
``fp32_flat_groups``) as lazy :class:`TensorData` whose pieces point into those partitions, the way DeepSpeed's
``deepspeed/utils/zero_to_fp32.py`` does, and the frozen parameters' fragments likewise.

Pure: the trees come from the caller; nothing is read or materialised here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ckptaudit.findings import text
from ckptaudit.formats.base import Part, Unreadable
from ckptaudit.formats.io.tensors import Piece, TensorData

_MAX_RANK_DIMS = 32
_MAX_NUMEL = 1 << 62
"""More elements than any tensor holds: a shape past this is refused before any arithmetic uses it."""
MAX_EMPTY_PARAMS = 1024
"""Parameters with no elements read per checkpoint at most. A real model has a few; each costs a name and a
memoised shape in ``param_shapes`` (about 20 bytes) but becomes a master, its moments and their records, with
no partition bytes behind them: past this, the layout is refused, so the work stays bounded by the bytes read."""


class ZeroLayoutError(ValueError):
    """The files' own bookkeeping does not add up (damaged or hand-edited): the masters cannot be rebuilt."""


class ZeroLimitError(ZeroLayoutError):
    """The layout asks for more work than its bytes pay for (a reader's safety limit, not proof of damage)."""


def count_empty(shapes: Iterable[tuple[int, ...]], already: int, what: str) -> int:
    """``already`` plus the shapes with no elements; :class:`ZeroLimitError` as soon as the count passes
    :data:`MAX_EMPTY_PARAMS` (the rest is not looked at)."""
    total = already
    for s in shapes:
        total += 0 in s
        if total > MAX_EMPTY_PARAMS:
            raise ZeroLimitError(f"{what} declares more than {MAX_EMPTY_PARAMS} parameters that hold no elements, "
                              "more than a model has (each a few bytes of pickle, and a master and moments to "
                              "audit): refused as the reader's safety limit")
    return total


def part_tree(part: Part | None) -> dict[str, Any] | None:
    return part.tree if part is not None and isinstance(part.tree, dict) else None


def add_optimizer(tree: dict[str, Any], state: dict[str, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Merge one tensor-parallel rank's optimizer state (names already prefixed) into the tree's."""
    if not isinstance(tree["optimizer"], dict):
        tree["optimizer"] = {"state": {}, "param_groups": []}
    tree["optimizer"]["state"].update(state)
    tree["optimizer"]["param_groups"].extend(groups)


def _show(value: Any) -> str:
    """A short text of a value read from a pickle (never fails: huge integers, long lists)."""
    if isinstance(value, tuple | list):
        items = [text(v) if isinstance(v, int | float) else type(v).__name__ for v in value[:8]]
        return "[" + ", ".join(items) + (", ..." if len(value) > 8 else "") + "]"
    return text(value) if isinstance(value, int | float) else type(value).__name__


def shape_of(value: Any) -> tuple[int, ...]:
    """A parameter shape from ``param_shapes``, checked in integers before any arithmetic uses it."""
    if not isinstance(value, tuple | list) or len(value) > _MAX_RANK_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_NUMEL for d in value):
        raise ZeroLayoutError(f"parameter shape {_show(value)} is not a tuple of at most {_MAX_RANK_DIMS} "
                           f"non-negative ints below 2**62")
    numel = 1
    for d in value:
        numel *= d
        if numel > _MAX_NUMEL:
            raise ZeroLayoutError(f"parameter shape {_show(value)} has more than 2**62 elements")
    return tuple(value)


def _flat(value: Any, what: str) -> TensorData:
    """A saved flat partition: a 1-D tensor in one contiguous piece."""
    if not isinstance(value, TensorData):
        raise ZeroLayoutError(f"{what} is {'unreadable' if isinstance(value, Unreadable) else 'not a tensor'}")
    if len(value.shape) != 1 or len(value.pieces) != 1 or not value.pieces[0].is_contiguous():
        raise ZeroLayoutError(f"{what} is not a flat contiguous tensor (shape {list(value.shape)})")
    return value


# A segment: elements [src_start, src_start + length) of the flat ``src`` hold elements
# [logical_start, logical_start + length) of the parameter (row-major).
_Segment = tuple[TensorData, int, int, int]
# The same with the source named by its rank: (rank, src_start, logical_start, length).
_Cut = tuple[int, int, int, int]


def _cut(bounds: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[list[_Cut]]:
    """Each ``[lo, hi)`` of ``ranges`` (sorted, disjoint) cut along the ranks' partitions, rank ``r`` holding
    ``[bounds[r], bounds[r + 1])`` of the concatenation: one sweep, so the work is linear in parameters + ranks
    (a parameter visits only the ranks it lies in, and the rank pointer never moves back)."""
    out: list[list[_Cut]] = []
    ranks = len(bounds) - 1
    r = 0
    for lo, hi in ranges:
        cut: list[_Cut] = []
        if hi > lo:
            while r < ranks and bounds[r + 1] <= lo:
                r += 1
            k = r
            while k < ranks:
                start, end = bounds[k], bounds[k + 1]
                if start >= hi:
                    break
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    cut.append((k, a - start, a - lo, b - a))
                k += 1
        out.append(cut)
    return out


def _assemble(shape: tuple[int, ...], segments: list[_Segment]) -> TensorData:
    """A lazy tensor of ``shape`` made of rectangular pieces of the flat partitions (nothing is read)."""
    numel = math.prod(shape)
    if sum(s[3] for s in segments) != numel:
        raise ZeroLayoutError(f"partitions hold {sum(s[3] for s in segments)} elements of a parameter with {numel}")
    dtype = segments[0][0].dtype if segments else None
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    pieces: list[Piece] = []
    for src, src_start, logical_start, length in segments:
        if src.dtype != dtype:
            raise ZeroLayoutError("the partitions of one parameter have different dtypes")
        if src_start < 0 or src_start + length > src.numel:
            raise ZeroLayoutError(f"a slice [{src_start}, {src_start + length}) exceeds its partition's "
                               f"{src.numel} elements")
        p0 = src.pieces[0]
        for offsets, sizes in _blocks(shape, logical_start, length):
            first = sum(o * s for o, s in zip(offsets, strides, strict=True))
            pieces.append(Piece(p0.file, p0.data_offset, p0.storage_offset + src_start + (first - logical_start),
                                sizes, strides, offsets))
    if dtype is None:
        raise ZeroLayoutError("a parameter with no elements has no partition to take its dtype from")
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
        if isinstance(ps, list) and len(ps) == 1 and isinstance(ps[0], int):  # a dict or list: unhashable
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


def _per_element(entries: list[dict[str, Any]], fits: Callable[[TensorData, TensorData], bool],
                 flats: list[TensorData]) -> dict[str, list[TensorData] | None]:
    """The per-element optimizer state of one flat group (``exp_avg``, ``exp_avg_sq``: a 1-D tensor in rank 0's
    entry), each name mapped to every rank's flat tensor, checked once per group (``fits(tensor, that rank's
    partition)``), or to ``None`` when they do not line up with the partitions (the state is then left out)."""
    out: dict[str, list[TensorData] | None] = {}
    for sname, value in entries[0].items():
        if not (isinstance(value, TensorData) and len(value.shape) == 1):
            continue
        srcs = [e.get(sname) for e in entries]
        ok = all(isinstance(s, TensorData) and len(s.shape) == 1 and fits(s, f)
                 for s, f in zip(srcs, flats, strict=True))
        try:
            out[str(sname)] = [_flat(s, str(sname)) for s in srcs] if ok else None
        except ZeroLayoutError:
            out[str(sname)] = None
    return out


def _attach(shape: tuple[int, ...], numel: int, entry0: dict[str, Any],
            moments: dict[str, list[TensorData] | None],
            segments: Callable[[list[TensorData]], list[_Segment]]) -> dict[str, Any]:
    """The optimizer state of one parameter: per-element state cut like the master (an empty tensor of the
    parameter's shape for a parameter with no elements), scalars from rank 0."""
    state: dict[str, Any] = {}
    for sname, value in entry0.items():
        key = str(sname)
        if key in moments:
            srcs = moments[key]
            if srcs is not None:
                state[key] = _assemble(shape, segments(srcs)) if numel else TensorData(srcs[0].dtype, shape, ())
        elif isinstance(value, TensorData | Unreadable) or not isinstance(value, dict | list):
            state[key] = value
    return state


def _paddings(raw: Any, group: int, params: int) -> list[int]:
    """``param_alignment_paddings`` of one group as DeepSpeed's ``zero_to_fp32`` reads it: absent, no padding;
    present, one non-negative int per parameter, else the layout is refused (as ``zero_to_fp32`` refuses it)."""
    if raw is None:
        return [0] * params
    pads = raw[group] if isinstance(raw, list) and group < len(raw) else None
    if not isinstance(pads, list) or len(pads) != params:
        raise ZeroLayoutError(f"param_alignment_paddings of group {group} holds "
                           f"{len(pads) if isinstance(pads, list) else 'no list of'} entries for {params} "
                           "parameters")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX_NUMEL for x in pads):
        raise ZeroLayoutError(f"param_alignment_paddings of group {group} holds a value that is not a small "
                           "non-negative int")
    return pads


def zero12(name_prefix: str, groups: list[list[tuple[str, tuple[int, ...]]]], states: list[dict[str, Any]],
            tree: dict[str, Any]) -> None:
    """ZeRO-1/2: per group, the ranks' saved partitions concatenated are the group's flat buffer (padding
    dropped); parameters follow in ``param_shapes`` order, each followed by its alignment padding. Work: one
    sweep over the parameters and the ranks' boundaries per group (:func:`_cut`)."""
    parts: list[Any] = [s.get("single_partition_of_fp32_groups") for s in states]
    if not all(isinstance(p, list) and len(p) == len(groups) for p in parts):
        raise ZeroLayoutError(f"single_partition_of_fp32_groups does not hold {len(groups)} group(s) on every rank")
    raw_paddings = states[0].get("param_alignment_paddings")
    state_tree: dict[str, dict[str, Any]] = {}
    for g, params in enumerate(groups):
        flats = [_flat(p[g], f"rank {r}'s partition of group {g}") for r, p in enumerate(parts)]
        bounds = [0]
        for f in flats:
            bounds.append(bounds[-1] + f.numel)
        pads = _paddings(raw_paddings, g, len(params))
        ranges: list[tuple[int, int]] = []
        offset = 0
        for (name, shape), pad in zip(params, pads, strict=True):
            numel = math.prod(shape)
            if offset + numel > bounds[-1]:
                raise ZeroLayoutError(f"{name} would end at element {offset + numel} of group {g}, whose partitions "
                                   f"hold {bounds[-1]}")
            ranges.append((offset, offset + numel))
            offset += numel + pad
        align = 2 * len(states)
        if -(-offset // align) != -(-bounds[-1] // align):
            raise ZeroLayoutError(f"group {g}'s parameters use {offset} elements, its partitions hold {bounds[-1]}")
        entries = [_base_state(s, "base_optimizer_state", g) for s in states]
        # The moments keep the partition padding the saved masters drop (last rank: longer by the pad).
        moments = _per_element(entries, lambda t, f: t.numel >= f.numel, flats)
        for (name, shape), (lo, hi), cut in zip(params, ranges, _cut(bounds, ranges), strict=True):
            fqn = name_prefix + name

            def segments(srcs: list[TensorData], cut: list[_Cut] = cut) -> list[_Segment]:
                return [(srcs[r], a, b, n) for r, a, b, n in cut]

            tree["fp32_masters"][fqn] = (_assemble(shape, segments(flats)) if hi > lo else
                                         TensorData(flats[0].dtype, shape, ()))
            state_tree[fqn] = _attach(shape, hi - lo, entries[0], moments, segments)
    add_optimizer(tree, state_tree, _param_groups(states[0], "base_optimizer_state",
                                                   [[name_prefix + n for n, _ in ps] for ps in groups]))


def zero3(name_prefix: str, groups: list[list[tuple[str, tuple[int, ...]]]], states: list[dict[str, Any]],
           tree: dict[str, Any]) -> None:
    """ZeRO-3: in each group's flat partition every parameter takes ``ceil(numel / world)`` elements per rank;
    rank r's slice holds elements ``[r * part, (r + 1) * part)`` of the parameter, the last one padded. Work:
    per parameter, the ranks that hold its elements (each holds ``part`` elements of every rank's partition)."""
    world = len(states)
    flats_all: list[Any] = [s.get("fp32_flat_groups") for s in states]
    if not all(isinstance(f, list) and len(f) == len(groups) for f in flats_all):
        raise ZeroLayoutError(f"fp32_flat_groups does not hold {len(groups)} group(s) on every rank")
    state_tree: dict[str, dict[str, Any]] = {}
    for g, params in enumerate(groups):
        flats = [_flat(f[g], f"rank {r}'s flat group {g}") for r, f in enumerate(flats_all)]
        if len({f.numel for f in flats}) != 1:
            raise ZeroLayoutError(f"the ranks' flat partitions of group {g} differ in length "
                               f"({', '.join(str(f.numel) for f in flats[:8])}{', ...' if world > 8 else ''})")
        entries = [_base_state(s, "optimizer_state_dict", g) for s in states]
        moments = _per_element(entries, lambda t, f: t.shape == f.shape, flats)
        offset = 0
        for name, shape in params:
            numel = math.prod(shape)
            part = -(-numel // world)  # ceil in integers: a float overflows on a huge declared shape
            if offset + part > flats[0].numel:
                raise ZeroLayoutError(f"{name} would end at element {offset + part} of group {g}, whose partitions "
                                   f"hold {flats[0].numel} per rank")
            # Only the first ceil(numel / part) ranks hold elements of it; the rest hold its padding.
            cut = [(r, offset, r * part, min(part, numel - r * part)) for r in range(-(-numel // part) if part else 0)]

            def segments(srcs: list[TensorData], cut: list[_Cut] = cut) -> list[_Segment]:
                return [(srcs[r], a, b, n) for r, a, b, n in cut]

            fqn = name_prefix + name
            tree["fp32_masters"][fqn] = (_assemble(shape, segments(flats)) if numel else
                                         TensorData(flats[0].dtype, shape, ()))
            state_tree[fqn] = _attach(shape, numel, entries[0], moments, segments)
            offset += part
        if offset != flats[0].numel:
            raise ZeroLayoutError(f"group {g}'s parameters use {offset} elements per rank, its partitions hold "
                               f"{flats[0].numel}")
    add_optimizer(tree, state_tree, _param_groups(states[0], "optimizer_state_dict",
                                                   [[name_prefix + n for n, _ in ps] for ps in groups]))


def zero12_frozen(name_prefix: str, rank0: dict[str, Any], tree: dict[str, Any]) -> None:
    """ZeRO-1/2 frozen parameters: saved whole in ``frozen_param_fragments`` (no optimizer state, no master)."""
    frags = rank0.get("frozen_param_fragments")
    if isinstance(frags, dict):
        for name, value in frags.items():
            if isinstance(name, str) and isinstance(value, TensorData | Unreadable):
                tree["frozen"][name_prefix + name] = value


def zero3_frozen(name_prefix: str, rank0: dict[str, Any], model_parts: dict[int, Part | None], world: int,
                  tree: dict[str, Any], empty: int = 0) -> None:
    """ZeRO-3 frozen parameters: every rank's model states holds its slice in ``frozen_param_fragments`` (DeepSpeed's
    ``zero_to_fp32`` takes one from every rank: a rank without it fails the parameter). ``empty``: the trainable
    parameters with no elements already read (:data:`MAX_EMPTY_PARAMS` counts both)."""
    shapes = rank0.get("frozen_param_shapes")
    if not isinstance(shapes, dict) or not shapes:
        return
    maps = []
    for dp in range(world):
        t = part_tree(model_parts.get(dp))
        frags = t.get("frozen_param_fragments") if t is not None else None
        maps.append(frags if isinstance(frags, dict) else {})
    checked = {name: shape_of(raw) for name, raw in shapes.items() if isinstance(name, str)}
    count_empty(checked.values(), empty, "frozen_param_shapes (with param_shapes)")
    for name, shape in checked.items():
        numel = math.prod(shape)
        part = -(-numel // world)
        segments: list[_Segment] = []
        for r, frags in enumerate(maps):  # stops at the first rank without its fragment
            f = frags.get(name)
            n = min(part, numel - r * part)
            if not (isinstance(f, TensorData) and len(f.shape) == 1 and f.numel >= n):
                tree["frozen"][name_prefix + name] = Unreadable(
                    f"ZeRO-3 frozen parameter {name}: a rank's fragment is missing or unreadable")
                break
            if n > 0:
                segments.append((_flat(f, name), 0, r * part, n))
        else:
            tree["frozen"][name_prefix + name] = _assemble(shape, segments)
