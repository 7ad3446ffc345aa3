"""Shard regions and the hashes taken over them, for live tensors and for saved ones alike.

A :class:`Region` says which elements of a parameter's full tensor one rank holds: a rectangular block
(FSDP2 and any DTensor with ``Shard``/``Replicate`` placements, a whole replica for plain modules and DDP) or a
range of the row-major flattening (FSDP1 with ``use_orig_params=True``, whose shards cut the flat parameter at
arbitrary elements). Every point of the probe hashes *the same region* of its tensor, so the three hashes of
one rank are comparable bit for bit:

- point 1: the rank's local shard itself (its elements are exactly the region);
- point 2: the region cut out of the full unsharded compute tensor;
- point 3: the region cut out of the saved tensor, streamed from its files in bounded chunks
  (:func:`hash_saved_region`), or out of an in-memory state dict (:func:`hash_tensor_region`).

The hash is :data:`ckptaudit.findings.HASH_ALGORITHM` (xxh3-128) over the region's elements' little-endian bytes
in row-major order, as :mod:`ckptaudit.auditing.tensor_scan` hashes whole tensors; a region covering the whole tensor hashes
to the audit's hash. The combined hash of a parameter is xxh3-128 over the per-rank digests in rank order
(:func:`combine`).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from ckptaudit.formats.io.tensors import DEFAULT_CHUNK_BYTES, FileMaps, Piece, TensorData, iter_chunks

__all__ = [
    "Region",
    "combine",
    "dtype_name",
    "hash_saved_region",
    "hash_tensor_region",
    "short_dtype",
]


@dataclass(frozen=True, slots=True)
class Region:
    """The elements of a full tensor one rank holds.

    A block ``offsets[i] : offsets[i] + sizes[i]`` in every dimension, or, when ``flat`` is set, the elements
    ``flat[0] : flat[1]`` of the row-major flattening (``offsets``/``sizes`` are then empty).
    """

    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    flat: tuple[int, int] | None = None

    @staticmethod
    def whole(shape: Sequence[int]) -> Region:
        return Region(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def numel(self) -> int:
        if self.flat is not None:
            return max(0, self.flat[1] - self.flat[0])
        return math.prod(self.sizes)

    def is_whole(self, shape: Sequence[int]) -> bool:
        if self.flat is not None:
            return self.flat == (0, math.prod(shape))
        return all(o == 0 for o in self.offsets) and tuple(self.sizes) == tuple(shape)

    def check(self, shape: Sequence[int]) -> str | None:
        """Why this region does not fit a tensor of ``shape``, or ``None`` when it does."""
        if self.flat is not None:
            lo, hi = self.flat
            if not 0 <= lo <= hi <= math.prod(shape):
                return f"flat range [{lo}, {hi}) outside a tensor of {math.prod(shape)} elements"
            return None
        if len(self.offsets) != len(shape) or len(self.sizes) != len(shape):
            return f"region of rank {len(self.sizes)} for a tensor of rank {len(shape)}"
        for o, s, n in zip(self.offsets, self.sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > n:
                return f"region at {list(self.offsets)} of size {list(self.sizes)} exceeds shape {list(shape)}"
        return None

    def describe(self) -> str:
        if self.flat is not None:
            return f"flat[{self.flat[0]}:{self.flat[1]}]"
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"

    def to_json(self) -> dict[str, Any]:
        if self.flat is not None:
            return {"flat": list(self.flat)}
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


def combine(digests: Sequence[str]) -> str:
    """The combined hash of a parameter: xxh3-128 over the per-rank digests (as bytes) in rank order."""
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32`` (the names :mod:`ckptaudit.formats` uses)."""
    return str(dtype).removeprefix("torch.")


_SHORT = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


def short_dtype(name: str) -> str:
    return _SHORT.get(name, name)


# ---------------------------------------------------------------------------------------------------------------
# Live tensors


def _tensor_chunks(t: torch.Tensor, region: Region, elems: int) -> Iterator[torch.Tensor]:
    """The region's elements of ``t`` in row-major order, as 1-D tensors of at most about ``elems`` elements."""
    t = t.detach()
    if region.flat is not None:
        flat = t.reshape(-1)[region.flat[0] : region.flat[1]]
        for i in range(0, flat.numel(), elems):
            yield flat[i : i + elems]
        return
    if t.dim() == 0:
        yield t.reshape(1)
        return
    sub = t[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes, strict=True))]
    if sub.numel() == 0:
        return
    if sub.is_contiguous():
        flat = sub.reshape(-1)
        for i in range(0, flat.numel(), elems):
            yield flat[i : i + elems]
        return
    row = max(1, math.prod(sub.shape[1:]))
    step = max(1, elems // row)
    for r in range(0, sub.shape[0], step):
        yield sub[r : r + step].reshape(-1)


def hash_tensor_region(t: torch.Tensor, region: Region | None = None, *, cast: torch.dtype | None = None,
                       via: torch.dtype | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """xxh3-128 of ``region`` of the plain tensor ``t`` (all of it when ``None``), optionally cast first.

    ``cast`` converts the elements before hashing; ``via`` rounds them through another dtype first (``via=bf16,
    cast=fp32``: the fp32 values a bf16 copy upcast back holds). Works chunk by chunk, so a cast or a copy to
    the CPU costs one chunk of memory, not the tensor.
    """
    if region is None:
        region = Region.whole(t.shape)
    elems = max(1, chunk_bytes // max(1, t.element_size()))
    h = xxhash.xxh3_128()
    for chunk in _tensor_chunks(t, region, elems):
        if via is not None:
            chunk = chunk.to(via)
        if cast is not None and chunk.dtype != cast:
            chunk = chunk.to(cast)
        _update(h, chunk.contiguous().cpu())
    return h.hexdigest()


def _update(h: Any, chunk: torch.Tensor) -> None:
    """Feed a contiguous CPU tensor's bytes to ``h`` without a copy.

    Not through ``tensor.numpy()``: that marks the storage non-resizable for good, and FSDP2 frees an
    unsharded parameter by resizing its storage to 0 after forward ("Trying to resize storage that is not
    resizable"). A ctypes view of the same bytes leaves the storage alone.
    """
    n = chunk.numel() * chunk.element_size()
    if n:
        h.update((ctypes.c_ubyte * n).from_address(chunk.data_ptr()))


# ---------------------------------------------------------------------------------------------------------------
# Saved tensors (lazy, from files)


def _sub_block(data: TensorData, offsets: Sequence[int], sizes: Sequence[int]) -> TensorData:
    """The block ``offsets:offsets+sizes`` of ``data`` as a lazy tensor of its own (pieces cut, nothing read)."""
    pieces: list[Piece] = []
    for p in data.pieces:
        lo = [max(b, po) for b, po in zip(offsets, p.offsets, strict=True)]
        hi = [min(b + s, po + ps) for b, s, po, ps in zip(offsets, sizes, p.offsets, p.sizes, strict=True)]
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        storage = p.storage_offset + sum((a - po) * st for a, po, st in zip(lo, p.offsets, p.stride, strict=True))
        pieces.append(Piece(p.file, p.data_offset, storage, tuple(b - a for a, b in zip(lo, hi, strict=True)),
                            p.stride, tuple(a - b for a, b in zip(lo, offsets, strict=True))))
    return TensorData(data.dtype, tuple(sizes), tuple(pieces))


def hash_saved_region(data: TensorData, maps: FileMaps, region: Region,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """xxh3-128 of ``region`` of a saved tensor, streamed from its files in bounded chunks.

    Only the pieces (shards) that overlap the region are read. Raises ``ValueError`` when the region does not fit
    the tensor or the pieces do not tile it, ``OSError`` when a file cannot be read.
    """
    err = region.check(data.shape)
    if err is not None:
        raise ValueError(err)
    h = xxhash.xxh3_128()
    if len(data.shape) == 0:
        if region.numel:
            for chunk in iter_chunks(data, maps, chunk_bytes):
                h.update(np.ascontiguousarray(chunk).data.cast("B"))
        return h.hexdigest()
    if region.flat is None:
        sub = data if region.is_whole(data.shape) else _sub_block(data, region.offsets, region.sizes)
        if sub.numel:
            for chunk in iter_chunks(sub, maps, chunk_bytes):
                h.update(np.ascontiguousarray(chunk).data.cast("B"))
        return h.hexdigest()
    start, stop = region.flat
    if stop <= start:
        return h.hexdigest()
    # A flat range: read only the rows it touches, then skip to its first element.
    row = max(1, math.prod(data.shape[1:]))
    r0, r1 = start // row, -(-stop // row)
    sub = _sub_block(data, (r0, *(0 for _ in data.shape[1:])), (r1 - r0, *data.shape[1:]))
    start, stop = start - r0 * row, stop - r0 * row
    pos = 0
    for chunk in iter_chunks(sub, maps, chunk_bytes):
        n = chunk.size
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            h.update(np.ascontiguousarray(chunk[lo - pos : hi - pos]).data.cast("B"))
        pos += n
        if pos >= stop:
            break
    return h.hexdigest()
