"""One status per matched pair of entries, and where a mismatched optimizer moment really came from.

Tensors are read once, both sides together in equal-length chunks, and each chunk does all its work while
it is in cache: the content hash of both sides (xxh3-128, as the audit computes it) and the element-wise
:class:`~ckptaudit.comparing.elementwise.Classifier`. The hash is the cheap test for the common case: when the
first chunk is bitwise equal, the rest is only hashed and the digests decide ``identical``. A pair found
*different* is measured (:class:`~ckptaudit.comparing.elementwise.DiffAccumulator`) from that chunk on, in the
same pass. Rare cases read again: digests that differ after an equal first chunk, a preferred hypothesis
failing late, the chunks before a pair turned out different. Plain values (scheduler fields, step counters,
RNG tuples, optimizer hyperparameters) are compared directly.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

import numpy as np
import xxhash

from ckptaudit.auditing.scan import scalar_value
from ckptaudit.auditing.tensor_scan import MAPPED_CHUNK_BYTES, hash_tensor
from ckptaudit.comparing.elementwise import Classifier, DiffAccumulator, DiffStats, Pool, compare_streams, paired_chunks
from ckptaudit.comparing.matching import Entry
from ckptaudit.formats.base import Unreadable
from ckptaudit.formats.io.leased import MIN_MAPPED_BYTES
from ckptaudit.formats.io.tensors import FileMaps, TensorData, iter_chunks, row_major_runs

__all__ = ["STATUSES", "Pair", "classify", "classify_tensors", "compare_values", "find_moment_sources", "hash_entry",
           "is_moment"]

STATUSES = ("identical", "equal-values", "bf16-rounded", "fp16-rounded", "different", "shape-mismatch",
            "missing", "extra", "unread")
"""Every status a pair can have (``missing``: only in the reference; ``extra``: only in the candidate)."""

@dataclass
class Pair:
    key: tuple[str, ...]
    ref: Entry | None
    cand: Entry | None
    status: str
    rounding: str | None = None
    """For ``*-rounded``: ``round-to-nearest-even``, ``round-toward-zero`` or ``stochastic-or-other``."""
    stats: DiffStats | None = None
    """For ``different`` tensors."""
    source: tuple[Entry, str] | None = None
    """For a ``different`` optimizer moment: the reference entry it equals (another parameter's), and how."""
    note: str = ""

    @property
    def entry(self) -> Entry:
        e = self.cand or self.ref
        assert e is not None
        return e


def is_moment(e: Entry) -> bool:
    """An element-wise optimizer state tensor (not a step counter)."""
    return e.component == "optimizer" and e.kind == "tensor" and e.data is not None and len(e.shape) >= 1 and (
        e.role != "step")


def _stream(r: TensorData, c: TensorData, rmaps: FileMaps, cmaps: FileMaps,
            chunk_bytes: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    # Equal element counts per chunk on both sides, so that re-chunking rarely splits a chunk.
    elems = max(1, chunk_bytes // max(r.dtype.itemsize, c.dtype.itemsize))
    return paired_chunks(iter_chunks(r, rmaps, elems * r.dtype.itemsize),
                         iter_chunks(c, cmaps, elems * c.dtype.itemsize))


def classify_tensors(r: TensorData, c: TensorData, rmaps: FileMaps, cmaps: FileMaps, chunk_bytes: int,
                     *, measure: bool = True, pool: Pool | None = None) -> tuple[str, str | None, DiffStats | None]:
    """(status, rounding, stats) of two readable tensors of the same shape, without hashing. Raises
    ``ValueError``/``OSError`` when the data cannot be read. ``measure=False``: no statistics for a
    *different* pair (one pass, stops at the first chunk that rules everything out)."""
    return compare_streams(lambda: _stream(r, c, rmaps, cmaps, chunk_bytes), r.dtype, c.dtype, measure=measure,
                           pool=pool)


def hash_entry(e: Entry, maps: FileMaps, chunk_bytes: int) -> None:
    """Set ``e.hash`` (a tensor no other checkpoint's tensor is paired with). Raises ``ValueError``/``OSError``."""
    if e.data is None:
        return
    e.hash = hash_tensor(e.data, maps, chunk_bytes)
    e.hashed = True


def _first_pair(r: TensorData, c: TensorData, rmaps: FileMaps, cmaps: FileMaps, chunk_bytes: int,
                pool: Pool) -> tuple[np.ndarray, np.ndarray] | None:
    """The first pair :func:`_stream` yields, read into two of ``pool``'s arrays (a fresh chunk buffer per tensor
    and side costs a page fault per 4 KiB), where both tensors are one contiguous piece (then that pair is the
    first ``chunk_bytes // itemsize`` elements of each); ``None`` otherwise. Raises ``ValueError`` / ``OSError``
    as :func:`iter_chunks` does."""
    pieces = r.whole_piece(), c.whole_piece()
    if any(p is None or not p.is_contiguous() for p in pieces) or not r.numel or r.numel != c.numel:
        return None
    n = min(max(1, chunk_bytes // max(r.dtype.itemsize, c.dtype.itemsize)), r.numel)
    out = []
    for side, (data, piece, maps) in enumerate(((r, pieces[0], rmaps), (c, pieces[1], cmaps))):
        assert piece is not None
        arr = pool.get(f"first-{side}", np.dtype(data.dtype.numpy), n)
        pos = piece.data_offset + piece.storage_offset * data.dtype.itemsize
        got = maps.read_into(piece.file, arr.data.cast("B"), pos)
        if got != arr.nbytes:  # iter_chunks' message
            raise ValueError(f"{piece.file}: {got} of {arr.nbytes} bytes at offset {pos}: the file ends early "
                             "(truncated, or changed while being read)")
        out.append(arr)
    return out[0], out[1]


def _windows(maps: FileMaps, run: tuple[str, int, int], step: int,
             buf: memoryview) -> Generator[memoryview, None, None]:
    """One run of a tensor's bytes, in order: its first chunk (``step`` bytes), then windows of
    :data:`~ckptaudit.auditing.tensor_scan.MAPPED_CHUNK_BYTES`, each a view of the file's leased map (handed back
    when the next is asked for, or when the generator is closed), or, where the map cannot serve it (a small
    tensor, no lease), ``step`` bytes read into ``buf``. Raises ``ValueError`` / ``OSError`` as :func:`iter_chunks`."""
    path, pos, remaining = run
    leased = maps.leased(path) if remaining >= MIN_MAPPED_BYTES else None
    window = max(1, MAPPED_CHUNK_BYTES // step) * step
    n = step  # the first chunk alone: a pair whose first chunks differ maps no more than that
    while remaining:
        n = min(n, remaining)
        view = leased.view(pos, n) if leased is not None else None
        if leased is not None and view is not None:
            try:
                yield view
            finally:
                leased.done(view, pos)
        else:
            n = min(step, remaining)
            raw = buf[:n]
            got = maps.read_into(path, raw, pos)
            if got != n:  # iter_chunks' message
                raise ValueError(f"{path}: {got} of {n} bytes at offset {pos}: the file ends early "
                                 "(truncated, or changed while being read)")
            yield raw
        pos += n
        remaining -= n
        n = window


def _local_runs(r: TensorData, c: TensorData, rmaps: FileMaps,
                cmaps: FileMaps) -> tuple[tuple[str, int, int], tuple[str, int, int]] | None:
    """The one run of bytes of each of two tensors of one dtype and size, each in a local file whose map can be
    leased (every single-process save); ``None`` otherwise (shards, strides, behind a URL, mapped reads off)."""
    if r.dtype.name != c.dtype.name or r.nbytes != c.nbytes or not r.nbytes:
        return None
    rruns, cruns = row_major_runs(r), row_major_runs(c)
    if rruns is None or cruns is None or len(rruns) != 1 or len(cruns) != 1:
        return None
    if rmaps.leased(rruns[0][0]) is None or cmaps.leased(cruns[0][0]) is None:
        return None
    return rruns[0], cruns[0]


def _hash_both(runs: tuple[tuple[str, int, int], tuple[str, int, int]], itemsize: int, rmaps: FileMaps,
               cmaps: FileMaps, chunk_bytes: int, pool: Pool) -> tuple[str, str] | None:
    """Both sides of a pair of :func:`_local_runs` in one pass, hashed as the audit hashes them (xxh3-128 of the
    bytes in order: :func:`~ckptaudit.auditing.tensor_scan.hash_tensor`'s digests), window by window, each where
    it lies in the page cache, the two sides in turn. The first chunk of each (``chunk_bytes``) is hashed first,
    and its digests decide the route as a bitwise comparison of the two chunks would: ``None`` when they differ
    (nothing more is read: the pair is classified), else both digests. Raises ``ValueError`` / ``OSError``."""
    step = max(1, chunk_bytes // itemsize) * itemsize
    rw = _windows(rmaps, runs[0], step, pool.get("raw-ref", np.uint8, step).data.cast("B"))
    cw = _windows(cmaps, runs[1], step, pool.get("raw-cand", np.uint8, step).data.cast("B"))
    rh, ch = xxhash.xxh3_128(), xxhash.xxh3_128()
    try:
        rh.update(next(rw))
        ch.update(next(cw))
        if rh.intdigest() != ch.intdigest():  # the first chunks differ
            return None
        for a, b in zip_longest(rw, cw):
            if a is not None:
                rh.update(a)
            if b is not None:
                ch.update(b)
    finally:
        rw.close()  # hands back a view still held
        cw.close()
    return rh.hexdigest(), ch.hexdigest()


def _fused(r: TensorData, c: TensorData, rmaps: FileMaps, cmaps: FileMaps, chunk_bytes: int,
           pool: Pool) -> tuple[str, str | None, DiffStats | None, str | None, str | None]:
    """One pass over both tensors. Returns (status, rounding, stats, ref hash, cand hash).

    The first chunk decides the route. Bitwise equal: each side is then hashed whole, as the audit hashes it
    (:func:`~ckptaudit.auditing.tensor_scan.hash_tensor`: its bytes where they lie in the page cache), and equal
    digests mean ``identical`` -- the common case of a faithful copy costs one hash pass per side. Where both
    tensors are one local run of bytes of one dtype, that is one pass over both, the first chunk's digests
    deciding the route (:func:`_hash_both`: no copy, no second look at the first chunk). Otherwise the
    rest is classified without hashing (the digests would not change the verdict; they are ``None``), and a
    pair that turns out *different* is measured from that chunk on in the same pass.
    """
    runs = _local_runs(r, c, rmaps, cmaps)
    both = None if runs is None else _hash_both(runs, r.dtype.itemsize, rmaps, cmaps, chunk_bytes, pool)
    if both is not None:
        ref_hash, cand_hash = both
        if ref_hash == cand_hash:
            return "identical", None, None, ref_hash, cand_hash
        # Equal first chunks, different digests: classify from the start (rare).
        status, rounding, stats = classify_tensors(r, c, rmaps, cmaps, chunk_bytes, pool=pool)
        return status, rounding, stats, ref_hash, cand_hash
    # First chunks that differ (runs found) are classified from the start, without a probe.
    first = _first_pair(r, c, rmaps, cmaps, chunk_bytes, pool) if runs is None else None
    if first is not None:
        probe = Classifier(r.dtype, c.dtype, pool=pool)
        if probe.update(*first) and probe.bitwise:  # the route the loop's first chunk would take: hash only
            ref_hash, cand_hash = hash_tensor(r, rmaps, chunk_bytes), hash_tensor(c, cmaps, chunk_bytes)
            if ref_hash == cand_hash:
                return "identical", None, None, ref_hash, cand_hash
            status, rounding, stats = classify_tensors(r, c, rmaps, cmaps, chunk_bytes, pool=pool)
            return status, rounding, stats, ref_hash, cand_hash
    cl = Classifier(r.dtype, c.dtype, pool=pool)  # from the start (again, after a probe that was not equal)
    acc: DiffAccumulator | None = None
    mode = "classify"  # -> "hash-only" (first chunk bitwise equal), "measure" (different), "again" (restart)
    first_measured = 0
    for i, (a, b) in enumerate(_stream(r, c, rmaps, cmaps, chunk_bytes)):
        if mode == "classify":
            alive = cl.update(a, b)
            if i == 0 and cl.bitwise and alive:
                # Each side hashed whole, as the audit hashes it (its bytes where they lie in the page cache):
                # no pairing of chunks, no copy; the first chunk is read once more.
                mode = "hash-only"
                break
            elif cl.restart:
                mode = "again"
            elif not alive:
                mode, first_measured = "measure", i
                acc = DiffAccumulator(r.dtype, c.dtype, pool=pool)
                acc.update(a, b)
        elif mode == "measure" and acc is not None:
            acc.update(a, b)
        else:  # "again": a preferred hypothesis failed after the first chunk; read again below
            break
    if mode == "hash-only":
        ref_hash, cand_hash = hash_tensor(r, rmaps, chunk_bytes), hash_tensor(c, cmaps, chunk_bytes)
        if ref_hash == cand_hash:
            return "identical", None, None, ref_hash, cand_hash
        # Equal first chunk, different digests: classify from the start (rare).
        status, rounding, stats = classify_tensors(r, c, rmaps, cmaps, chunk_bytes, pool=pool)
        return status, rounding, stats, ref_hash, cand_hash
    if mode == "classify":
        cl.finish()
        verdict = None if cl.restart else cl.verdict()
        if verdict is not None:
            return verdict[0], verdict[1], None, None, None
    if mode == "measure" and acc is not None:
        for j, (a, b) in enumerate(_stream(r, c, rmaps, cmaps, chunk_bytes)):
            if j >= first_measured:
                break
            acc.update(a, b)
        return "different", None, acc.result(), None, None
    status, rounding, stats = classify_tensors(r, c, rmaps, cmaps, chunk_bytes, pool=pool)
    return status, rounding, stats, None, None


def classify(key: tuple[str, ...], re: Entry | None, ce: Entry | None, ref: FileMaps, cand: FileMaps,
             chunk_bytes: int, pool: Pool | None = None) -> Pair:
    """The status of one matched pair."""
    if re is None:
        assert ce is not None
        return Pair(key, None, ce, "extra")
    if ce is None:
        return Pair(key, re, None, "missing")
    if re.kind == "value" and ce.kind == "value":
        return Pair(key, re, ce, compare_values(re.value, ce.value))
    if re.kind != ce.kind:
        return _tensor_vs_value(key, re, ce, ref, cand)
    if re.data is None or ce.data is None:
        return Pair(key, re, ce, "unread", note=re.unreadable or ce.unreadable)
    if re.data.shape != ce.data.shape:
        note = "same element count, other shape" if re.data.numel == ce.data.numel else ""
        return Pair(key, re, ce, "shape-mismatch", note=note)
    try:
        status, rounding, stats, re.hash, ce.hash = _fused(re.data, ce.data, ref, cand, chunk_bytes,
                                                           pool or Pool())
        re.hashed = ce.hashed = True
    except (ValueError, OSError) as exc:
        return Pair(key, re, ce, "unread", note=f"cannot read: {exc}")
    return Pair(key, re, ce, status, rounding, stats)


def _tensor_vs_value(key: tuple[str, ...], re: Entry, ce: Entry, ref: FileMaps, cand: FileMaps) -> Pair:
    # A step counter saved as a 0-d tensor on one side and as a Python number on the other.
    t, side = (re, ref) if re.kind == "tensor" else (ce, cand)
    v = ce.value if re.kind == "tensor" else re.value
    if t.data is not None and t.data.numel == 1 and isinstance(v, int | float) and not isinstance(v, bool):
        x = scalar_value(t.data, side)
        if x is not None:
            same = x == v or (math.isnan(x) and isinstance(v, float) and math.isnan(v))
            return Pair(key, re, ce, "equal-values" if same else "different", note="tensor vs plain value")
    return Pair(key, re, ce, "different", note="tensor vs plain value")


def compare_values(a: Any, b: Any) -> str:
    """``identical`` (same type, same value), ``equal-values`` (e.g. 6 vs 6.0), ``unread`` or ``different``."""
    if isinstance(a, Unreadable) or isinstance(b, Unreadable):
        return "unread"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return "different"
        if a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
            return "identical"
        try:
            return "equal-values" if np.array_equal(a, b) else "different"
        except TypeError:
            return "different"
    if type(a) is type(b):
        if isinstance(a, float) and math.isnan(a) and math.isnan(b):
            return "identical"
        try:
            return "identical" if bool(a == b) else "different"
        except Exception:  # noqa: BLE001 - an exotic __eq__ on a restricted-unpickled value
            return "different"
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return "equal-values" if a == b else "different"
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):  # DCP round trips turn tuples into lists
        return "equal-values" if list(a) == list(b) else "different"
    return "different"


def find_moment_sources(pairs: list[Pair], ref_entries: list[Entry], ref: FileMaps, cand: FileMaps, chunk_bytes: int,
                        *, max_value_checks: int = 256, pool: Pool | None = None) -> None:
    """For every ``different`` optimizer moment of the candidate, look for the reference moment (same state
    name, same shape, another parameter) it equals: hashes first, then values (equal, or rounded to 16 bits).

    Sets :attr:`Pair.source`. Value checks stop at the first chunk that differs, and at most
    ``max_value_checks`` are made per state name and shape (a model with thousands of same-shape layers whose
    moments all differ is another state, not a permutation).
    """
    by_shape: dict[tuple[str, tuple[int, ...]], list[Entry]] = {}
    # Equal hashes by (state name, shape, dtype, hash), each list holding at most two parameters: a lookup per
    # moment, never a scan of every same-shape moment (thousands of same-shape layers made that quadratic).
    by_hash: dict[tuple[Any, ...], list[Entry]] = {}
    for e in ref_entries:
        if is_moment(e) and e.data is not None:
            by_shape.setdefault((e.role, e.data.shape), []).append(e)
            if e.hash is not None:
                same = by_hash.setdefault((e.role, e.data.shape, e.dtype, e.hash), [])
                if len(same) < 2 and all(o.param != e.param for o in same):
                    same.append(e)
    budget: dict[tuple[str, tuple[int, ...]], int] = {}
    for p in pairs:
        ce = p.cand
        if p.status != "different" or ce is None or not is_moment(ce) or ce.data is None:
            continue
        group_key = (ce.role, ce.data.shape)
        hit = next((e for e in by_hash.get((ce.role, ce.data.shape, ce.dtype, ce.hash), ())
                    if e.param != ce.param), None) if ce.hash is not None else None
        if hit is not None:
            p.source = (hit, "identical")
            continue
        if budget.get(group_key, 0) >= max_value_checks:
            continue  # the value checks of this state name and shape are spent: no scan of its moments either
        others = (e for e in by_shape.get(group_key, []) if e.param != ce.param)
        for e in others:
            if budget.get(group_key, 0) >= max_value_checks:
                break
            budget[group_key] = budget.get(group_key, 0) + 1
            assert e.data is not None
            try:
                status, rounding, _ = classify_tensors(e.data, ce.data, ref, cand, chunk_bytes,
                                                       measure=False, pool=pool)
            except (ValueError, OSError):
                continue
            if status != "different":
                p.source = (e, status if rounding is None else f"{status} ({rounding})")
                break
