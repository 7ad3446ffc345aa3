"""Lazy tensors: where a tensor's bytes lie in which file, and how to stream them in bounded chunks.

Readers never materialise a tensor. They describe it (:class:`Piece`, :class:`TensorData`) and the checks
stream its elements in row-major order through :func:`iter_chunks`, one chunk of at most ``chunk_bytes`` at a
time: contiguous pieces with positional reads into a reused buffer, strided ones from a read-only memory map.
The scan's own fast path (:func:`ckptaudit.auditing.tensor_scan.scan_tensor`) hashes whole chunks where they lie in the page
cache, under a read lease (:meth:`FileMaps.leased`, :mod:`ckptaudit.formats.io.leased`). Mapped pages already
scanned are dropped with ``madvise(MADV_DONTNEED)``, so resident memory stays bounded by the chunks, not by
the checkpoint.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptaudit.formats.io.leased import LeasedFile, mapped_reads_enabled
from ckptaudit.formats.io.safeio import FileIds, open_regular

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DTYPES", "SMALL_TENSOR_BYTES", "DType", "FileMaps", "Piece", "TensorData", "iter_chunks", "read_exact",
           "row_major_runs", "scratch_buffer", "small_read_plan", "tiling_error"]

DEFAULT_CHUNK_BYTES = 1 << 20
"""1 MiB: the chunk stays in cache between the hash and the OR-reduction that read it (measured: 4 MiB chunks
made the bf16-rounded case ~30% slower); the rare paths that build temporaries are capped or deferred."""


@dataclass(frozen=True, slots=True)
class DType:
    """A tensor element type as stored: its torch name, size and the NumPy type its raw bits are read as."""

    name: str
    """Torch's name without the prefix: ``float32``, ``bfloat16``, ``int64``, ..."""
    itemsize: int
    numpy: str
    """NumPy dtype of the raw elements (``bfloat16`` and float8 are read as unsigned ints of their width)."""
    is_float: bool


def _d(name: str, size: int, np_name: str, is_float: bool) -> tuple[str, DType]:
    return name, DType(name, size, np_name, is_float)


DTYPES: dict[str, DType] = dict(
    [
        _d("float64", 8, "<f8", True),
        _d("float32", 4, "<f4", True),
        _d("float16", 2, "<f2", True),
        _d("bfloat16", 2, "<u2", True),
        _d("float8_e4m3fn", 1, "u1", True),
        _d("float8_e5m2", 1, "u1", True),
        _d("float8_e4m3fnuz", 1, "u1", True),
        _d("float8_e5m2fnuz", 1, "u1", True),
        _d("complex64", 8, "<c8", True),
        _d("complex128", 16, "<c16", True),
        _d("int64", 8, "<i8", False),
        _d("int32", 4, "<i4", False),
        _d("int16", 2, "<i2", False),
        _d("int8", 1, "i1", False),
        _d("uint8", 1, "u1", False),
        _d("uint16", 2, "<u2", False),
        _d("uint32", 4, "<u4", False),
        _d("uint64", 8, "<u8", False),
        _d("bool", 1, "?", False),
    ]
)


@dataclass(frozen=True, slots=True)
class Piece:
    """A rectangular block of a logical tensor stored at one place of one file.

    The block covers ``offsets[i] : offsets[i] + sizes[i]`` of the logical tensor. Its elements are at
    ``data_offset + (storage_offset + sum(idx[i] * stride[i])) * itemsize`` in ``file``.
    """

    file: str
    """Absolute path."""
    data_offset: int
    storage_offset: int
    sizes: tuple[int, ...]
    stride: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.sizes), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True, slots=True)
class TensorData:
    """A logical tensor: dtype, shape, and the pieces (one per shard) that hold it."""

    dtype: DType
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    _coverage: list[str | None] = field(default_factory=list, init=False, repr=False, compare=False)
    """:meth:`coverage_error`'s answer, once decided (it is asked by the reader, the scan and every read)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def whole_piece(self) -> Piece | None:
        """The one piece that holds the whole tensor (every single-process save: no tiling to verify), or
        ``None`` (shards, whose tiling :meth:`coverage_error` judges)."""
        if len(self.pieces) != 1:
            return None
        p = self.pieces[0]
        if p.sizes == self.shape and len(p.offsets) == len(self.shape) and not any(p.offsets) and min(
                self.shape, default=0) >= 0:
            return p
        return None

    def row_slabs(self) -> list[Piece] | None:
        """The pieces in row-major order (sorted by their offsets) when each spans every dimension but the first
        (slabs of rows: DCP saves of FSDP and DDP), so that reading them one after the other reads the tensor
        in row-major order; ``None`` when pieces split a later dimension (they must be re-assembled). Whether
        the slabs tile the tensor is :meth:`coverage_error`'s question."""
        pieces = sorted(self.pieces, key=lambda p: p.offsets) if len(self.pieces) > 1 else list(self.pieces)
        if self.shape and not all(tuple(p.sizes[1:]) == self.shape[1:] for p in pieces):
            return None
        return pieces

    def coverage_error(self) -> str | None:
        """Why the pieces do not tile the tensor exactly, or ``None`` when they do. Decided once per tensor (the
        readers, the scan and the streaming reads all ask), in time linear in the pieces (:func:`tiling_error`)."""
        memo = self._coverage
        if not memo:
            memo.append(tiling_error(self.shape, self.pieces) if self.whole_piece() is None else None)
        return memo[0]


MAX_SPLIT_DIMS = 12
"""Most dimensions the pieces of one tensor may split (real shardings: 1 to 3) for :func:`tiling_error` to decide
whether they tile it; beyond, the tensor is refused (its check would cost 2**dims per piece)."""


def tiling_error(shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> str | None:
    """Why ``pieces`` (boxes ``offsets : offsets + sizes``) do not tile ``shape`` exactly, or ``None``.

    Every piece must lie inside the tensor and their volumes add up to its volume; then they tile it unless two
    overlap. Overlap is decided without comparing pieces pairwise (quadratic: a ``[1, N]`` tensor saved as N
    column chunks), by counting corners: a box's indicator is the signed sum of the orthants ``x >= c`` at its
    2**d corners (sign ``(-1)**(upper bounds taken)``), these orthants are linearly independent, so the boxes
    tile the tensor exactly iff their signed corner counts equal the tensor's own. Dimensions every piece spans
    whole are left out (d is the number of split dimensions), so the work is ``O(pieces * 2**d)``, with ``d`` at
    most :data:`MAX_SPLIT_DIMS`.
    """
    rank = len(shape)
    total = 0
    for p in pieces:
        if len(p.offsets) != rank or len(p.sizes) != rank:
            return f"a shard has rank {len(p.sizes)}, the tensor has rank {rank}"
        for o, s, n in zip(p.offsets, p.sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > n:
                return f"shard at offsets {list(p.offsets)} with sizes {list(p.sizes)} exceeds shape {list(shape)}"
        total += p.numel
    numel = math.prod(shape)
    if total != numel:
        return f"shards hold {total} elements, the tensor has {numel}"
    boxes = [p for p in pieces if p.numel]
    if len(boxes) <= 1:
        return None  # one box of the tensor's volume inside it is the tensor
    split = [d for d in range(rank) if any(p.offsets[d] or p.sizes[d] != shape[d] for p in boxes)]
    if len(split) > MAX_SPLIT_DIMS:
        return (f"its {len(boxes)} shards split {len(split)} dimensions; ckptaudit decides tilings of up to "
                f"{MAX_SPLIT_DIMS} split dimensions, so it cannot tell whether they restore the tensor")
    counts: dict[tuple[int, ...], int] = {}
    masks = range(1 << len(split))
    for p in boxes:
        lo = [p.offsets[d] for d in split]
        hi = [p.offsets[d] + p.sizes[d] for d in split]
        for mask in masks:
            corner = tuple(hi[i] if mask >> i & 1 else lo[i] for i in range(len(split)))
            sign = -1 if mask.bit_count() & 1 else 1
            counts[corner] = counts.get(corner, 0) + sign
    for mask in masks:  # the tensor's own corners, taken away: a tiling leaves nothing
        corner = tuple(shape[d] if mask >> i & 1 else 0 for i, d in enumerate(split))
        counts[corner] = counts.get(corner, 0) - (-1 if mask.bit_count() & 1 else 1)
    odd = next((c for c, n in counts.items() if n), None)
    if odd is None:
        return None
    at = [0] * rank
    for i, d in enumerate(split):
        at[d] = odd[i]
    return (f"shards overlap (and leave a hole elsewhere), e.g. at the corner {at}: the tensor cannot be restored "
            "from them")


class FileMaps:
    """Open files of a checkpoint being scanned: a descriptor for positional reads, a lease-guarded map to hash
    whole chunks from (:meth:`leased`) and, for the rare strided or re-assembled tensors, a read-only memory map;
    one of each per file, closed together.

    Owned by one reader session (``Checkpoint``). Opening is serialised by a lock, and positional reads
    (``os.preadv``) share a descriptor safely, so threads may scan different tensors at once. ``ids``: the
    version of each file the readers parsed (:class:`~ckptaudit.formats.io.safeio.FileIds`); every open here must
    find the same one, or raises :class:`~ckptaudit.formats.io.safeio.FileChanged` (local files: a remote file's
    stand-in is pinned by its ETag instead).
    """

    def __init__(self, ids: FileIds | None = None) -> None:
        self.ids = ids
        self._maps: dict[str, mmap.mmap] = {}
        self._files: dict[str, Any] = {}
        self._leased: dict[str, LeasedFile | None] = {}
        self._mapped_reads: bool | None = None
        self._lock = threading.Lock()
        self.remote: Any = None
        """For a checkpoint behind a URL: the :class:`~ckptaudit.formats.remote.objects.RemoteFiles` its stand-in files
        read their data from (ranged reads); ``None`` for local checkpoints."""

    def fd(self, path: str) -> int:
        """A descriptor of ``path`` for ``os.preadv`` (regular files only: a pipe swapped in must not block)."""
        fh = self._files.get(path)
        if fh is None:
            with self._lock:
                fh = self._files.get(path)
                if fh is None:
                    fh = open_regular(path, self._ids_of(path))
                    self._files[path] = fh
        return int(fh.fileno())

    def _ids_of(self, path: str) -> FileIds | None:
        return None if self.remote is not None and path in self.remote else self.ids

    def leased(self, path: str) -> LeasedFile | None:
        """The :class:`~ckptaudit.formats.io.leased.LeasedFile` of a local ``path`` (hashing its chunks in place,
        under a read lease), or ``None`` where chunks are read with :meth:`read_into` (remote files, mapped reads
        off or unavailable in this process)."""
        try:
            return self._leased[path]
        except KeyError:
            pass
        if self._mapped_reads is None:
            self._mapped_reads = mapped_reads_enabled()
        usable = self._mapped_reads and not (self.remote is not None and path in self.remote)
        fd = self.fd(path) if usable else -1
        with self._lock:  # one per file, whichever thread asks first: the lease count must be shared
            if path not in self._leased:
                self._leased[path] = LeasedFile(fd) if usable else None
            return self._leased[path]

    def mapped_chunks(self) -> int:
        """How many chunks were read through leased maps so far, all files together (tests and benchmarks)."""
        return sum(lf.mapped for lf in list(self._leased.values()) if lf is not None)

    def get(self, path: str) -> mmap.mmap | None:
        mm = self._maps.get(path)
        if mm is None:
            with self._lock:
                mm = self._maps.get(path)
                if mm is None:
                    with open_regular(path, self._ids_of(path)) as fh:  # a pipe swapped in must not block
                        if os.fstat(fh.fileno()).st_size == 0:
                            return None
                        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                    self._maps[path] = mm
        return mm

    def release(self, path: str, start: int, length: int) -> None:
        """Drop mapped pages of ``[start, start+length)`` from this process's resident set."""
        mm = self._maps.get(path)
        if mm is None or length <= 0 or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        lo = (start // page) * page
        hi = min(len(mm), start + length)
        if hi > lo:
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):  # best effort: the pages are reclaimable anyway
                pass

    def read_into(self, path: str, buf: memoryview, offset: int) -> int:
        """Positional read of ``len(buf)`` bytes at ``offset`` of ``path`` (remote files: one ranged read)."""
        if self.remote is not None and path in self.remote:
            return int(self.remote.read_into(path, buf, offset))
        return os.preadv(self.fd(path), [buf], offset)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        for lf in self._leased.values():
            if lf is not None:
                lf.close()
        self._leased.clear()
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a chunk view is still alive somewhere; the GC will unmap it
                pass
        self._maps.clear()

    def __enter__(self) -> FileMaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scratch_buffer(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> np.ndarray:
    """A reusable read buffer for :func:`iter_chunks` (``buffer=``): one per thread, reused across tensors.

    Reusing it saves, per tensor, the allocation and the first-touch page faults of a fresh chunk-sized array.
    16 bytes over ``chunk_bytes`` so that a chunk of any element size (up to complex128) fits.
    """
    import numpy  # here, not at import time: the start-up path imports no NumPy for small audits

    return numpy.empty(chunk_bytes + 16, dtype=numpy.uint8)


def iter_chunks(
    data: TensorData, maps: FileMaps, chunk_bytes: int = DEFAULT_CHUNK_BYTES, buffer: np.ndarray | None = None
) -> Iterator[np.ndarray]:
    """Yield the tensor's elements in row-major order as 1-D C-contiguous NumPy arrays of ``data.dtype.numpy``.

    Each array is valid only until the next one is requested (it may view a reused buffer). ``buffer``: a
    :func:`scratch_buffer` of at least ``chunk_bytes`` to read contiguous pieces into, instead of a new one per
    tensor; the caller must not use it for anything else while the iterator is alive.
    Raises ``ValueError`` when the pieces do not tile the tensor (see :meth:`TensorData.coverage_error`).
    """
    import numpy as np  # here, not at import time: a small audit may never need it (see small_read_plan)

    err = data.coverage_error()  # (no work for a whole piece)
    if err is not None:
        raise ValueError(err)
    if data.numel == 0:
        return
    npdt = np.dtype(data.dtype.numpy)
    per_chunk = max(1, chunk_bytes // npdt.itemsize)
    if buffer is not None and buffer.nbytes < per_chunk * npdt.itemsize:
        raise ValueError(f"scratch buffer of {buffer.nbytes} bytes is smaller than a chunk "
                         f"({per_chunk * npdt.itemsize} bytes): make it with scratch_buffer(chunk_bytes)")
    slabs = data.row_slabs()
    if slabs is not None:
        for p in slabs:
            yield from _piece_chunks(p, npdt, maps, per_chunk, buffer)
    else:
        yield from _assembled_chunks(data, sorted(data.pieces, key=lambda p: p.offsets), npdt, maps, per_chunk)


def _piece_array(p: Piece, npdt: np.dtype, maps: FileMaps) -> np.ndarray:
    """A strided NumPy view of one piece, straight on the memory map."""
    import numpy as np

    span = p.storage_offset + sum((s - 1) * st for s, st in zip(p.sizes, p.stride, strict=True)) + 1
    if maps.remote is not None and p.file in maps.remote and p.numel:
        # A stand-in file holds no tensor data: fetch this view's span into it before mapping it.
        maps.remote.stage_span(p.file, p.data_offset, span * npdt.itemsize)
    mm = maps.get(p.file)
    if p.numel == 0 or mm is None:
        return np.empty(p.sizes, dtype=npdt)
    base = np.frombuffer(mm, dtype=npdt, count=span, offset=p.data_offset)
    view = np.lib.stride_tricks.as_strided(
        base[p.storage_offset :],
        shape=p.sizes,
        strides=tuple(st * npdt.itemsize for st in p.stride),
        writeable=False,
    )
    return view


def _piece_chunks(p: Piece, npdt: np.dtype, maps: FileMaps, per_chunk: int,
                  buffer: np.ndarray | None = None) -> Iterator[np.ndarray]:
    import numpy as np

    if p.numel == 0:
        return
    if p.is_contiguous():
        # Positional reads into one reusable buffer: no page faults and no mapped pages to give back, and a file
        # truncated under us is a short read (an error), not a SIGBUS.
        n_buf = min(per_chunk, p.numel)
        if buffer is None:
            buf = np.empty(n_buf, dtype=npdt)
        else:
            buf = buffer[: n_buf * npdt.itemsize].view(npdt)
        raw = buf.data.cast("B")
        pos = p.data_offset + p.storage_offset * npdt.itemsize
        remaining = p.numel
        if remaining > per_chunk and maps.remote is not None and p.file in maps.remote:
            # Behind a URL: several ranged reads in flight (the store's parallel throughput), read in order.
            nbytes = per_chunk * npdt.itemsize
            total = p.numel * npdt.itemsize
            for data in maps.remote.read_ahead(p.file, pos, total, nbytes):
                want = min(nbytes, total)
                if len(data) != want:
                    raise ValueError(f"{p.file}: {len(data)} of {want} bytes at offset {pos}: the file ends early "
                                     "(truncated, or changed while being read)")
                raw[:want] = data
                yield buf[: want // npdt.itemsize]
                pos += want
                total -= want
            if total:
                raise ValueError(f"{p.file}: 0 of {min(nbytes, total)} bytes at offset {pos}: the file ends early "
                                 "(truncated, or changed while being read)")
            return
        while remaining:
            n = min(per_chunk, remaining)
            nbytes = n * npdt.itemsize
            got = maps.read_into(p.file, raw[:nbytes], pos)
            if got != nbytes:
                raise ValueError(f"{p.file}: {got} of {nbytes} bytes at offset {pos}: the file ends early "
                                 "(truncated, or changed while being read)")
            yield buf[:n]
            pos += nbytes
            remaining -= n
        return
    if maps.get(p.file) is None:
        raise ValueError(f"{p.file} is empty")
    # Non-contiguous: copy row blocks (bounded) into row-major order.
    view = _piece_array(p, npdt, maps)
    rows = view.reshape(view.shape[0], -1) if view.ndim > 1 else view.reshape(-1, 1)
    row_len = rows.shape[1]
    step = max(1, per_chunk // max(1, row_len))
    for r in range(0, rows.shape[0], step):
        yield np.ascontiguousarray(view[r : r + step]).reshape(-1)


def _assembled_chunks(
    data: TensorData, pieces: list[Piece], npdt: np.dtype, maps: FileMaps, per_chunk: int
) -> Iterator[np.ndarray]:
    # Pieces split along more than the first dimension: assemble blocks of leading rows.
    import numpy as np

    shape = data.shape
    row_elems = max(1, math.prod(shape[1:]))
    step = max(1, per_chunk // row_elems)
    views = [(p, _piece_array(p, npdt, maps)) for p in pieces]
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        buf = np.empty((r1 - r0, *shape[1:]), dtype=npdt)
        for p, view in views:
            lo = max(r0, p.offsets[0])
            hi = min(r1, p.offsets[0] + p.sizes[0])
            if lo >= hi:
                continue
            dst = [slice(lo - r0, hi - r0)] + [slice(o, o + s) for o, s in zip(p.offsets[1:], p.sizes[1:], strict=True)]
            buf[tuple(dst)] = view[lo - p.offsets[0] : hi - p.offsets[0]]
        yield buf.reshape(-1)


SMALL_TENSOR_BYTES = 64 << 10
"""Tensors up to this size are read without NumPy while NumPy is not imported yet (:func:`small_read_plan`;
the engine's ``scan_small``, the checks' zero test)."""


def small_read_plan(data: TensorData, max_bytes: int) -> list[tuple[Piece, int]] | None:
    """The plan of a NumPy-free read of a small tensor: its non-empty pieces in row-major order, each with the
    file offset of its first byte; ``None`` when the tensor is over ``max_bytes`` or not a row-major
    concatenation of contiguous pieces (then only :func:`iter_chunks` reads it).

    Raises ``ValueError`` when the pieces do not tile the tensor, as :func:`iter_chunks` does. The pieces come in
    :func:`iter_chunks`' order, so reading them (:func:`read_exact`) yields the same bytes it would.
    """
    if data.nbytes > max_bytes:
        return None
    err = data.coverage_error()
    if err is not None:
        raise ValueError(err)
    slabs = data.row_slabs()
    if slabs is None:
        return None
    plan = []
    for p in slabs:
        if p.numel == 0:
            continue
        if not p.is_contiguous():
            return None
        plan.append((p, p.data_offset + p.storage_offset * data.dtype.itemsize))
    return plan


def read_exact(maps: FileMaps, piece: Piece, pos: int, nbytes: int) -> bytes:
    """``nbytes`` bytes of ``piece``'s file at ``pos`` (positional read; remote files: one ranged read); raises
    ``ValueError`` on a short read, with :func:`iter_chunks`' message."""
    buf = bytearray(nbytes)
    got = maps.read_into(piece.file, memoryview(buf), pos)
    if got != nbytes:  # the same message as _piece_chunks'
        raise ValueError(f"{piece.file}: {got} of {nbytes} bytes at offset {pos}: the file ends early "
                         "(truncated, or changed while being read)")
    return bytes(buf)


def row_major_runs(data: TensorData) -> list[tuple[str, int, int]] | None:
    """``(file, offset of the first byte, bytes)`` of the runs of bytes whose concatenation is the tensor in
    row-major order, in the order :func:`iter_chunks` reads them: one run for a tensor
    stored whole and contiguous (nearly every tensor of a ``torch.save`` or safetensors file), one per shard for a
    tensor split along its first dimension into contiguous shards (DCP saves of FSDP/DDP). ``None`` for anything
    else (strided or re-assembled pieces, pieces that do not tile the tensor: ``iter_chunks`` reads and judges
    those), or on a big-endian host (the chunks are read as little-endian words)."""
    if sys.byteorder != "little":
        return None
    size = data.dtype.itemsize
    whole = data.whole_piece()
    if whole is not None:
        return [(whole.file, whole.data_offset + whole.storage_offset * size, data.nbytes)] if (
            whole.is_contiguous()) else None
    if not data.shape or not data.pieces or data.coverage_error() is not None:
        return None
    slabs = data.row_slabs()  # iter_chunks' order and its condition for reading pieces one after the other
    if slabs is None or not all(p.is_contiguous() for p in slabs):
        return None
    return [(p.file, p.data_offset + p.storage_offset * size, p.numel * size) for p in slabs if p.numel]
