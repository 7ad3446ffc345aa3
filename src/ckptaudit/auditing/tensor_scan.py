"""From lazy tensors to :class:`~ckptaudit.findings.TensorRecord`: content hash and effective precision.

One streaming pass per tensor, one bounded chunk at a time (see :mod:`ckptaudit.formats.io.tensors`): the hash
sees every byte; the precision test works on the raw fp32 bits and stops as soon as a value needs the low
mantissa bits (the common case for a genuine fp32 tensor is decided by its first chunk).

Effective precision of an fp32 tensor (see docs/audit.md, "How rounding is detected"):

- bf16-representable: the low 16 bits of every value are zero;
- fp16-representable: every value lies in fp16's range and its bits below fp16's precision at that magnitude
  (13 for normal values, more for fp16 subnormals) are zero;
- a tensor is called rounded only if, in addition, at least :data:`MIN_INFORMATIVE` values are
  *informative*: finite, not integers, and needing at least five significant bits in the 16-bit format.
  Zeros, ones, small integers and short binary fractions are representable in every format and say nothing.
  Under the assumption that the low bits of a genuine fp32 value are uniform, the chance that a genuine
  tensor is called bf16-rounded is at most 2**(-16 * MIN_INFORMATIVE) = 2**-64 (fp16: 2**-52).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from ckptaudit.findings import Precision, PrecisionStats
from ckptaudit.formats.io.leased import MIN_MAPPED_BYTES
from ckptaudit.formats.io.tensors import (
    DEFAULT_CHUNK_BYTES,
    SMALL_TENSOR_BYTES,
    FileMaps,
    TensorData,
    iter_chunks,
    read_exact,
    row_major_runs,
    small_read_plan,
)

if TYPE_CHECKING:
    import numpy as np

    from ckptaudit.auditing.digesting import Hasher

__all__ = ["MIN_INFORMATIVE", "SMALL_TENSOR_BYTES", "TensorScan", "classify", "hash_tensor", "scan_first_chunk",
           "scan_tensor"]

MIN_INFORMATIVE = 4
"""Informative values needed before a 16-bit-representable tensor is called rounded."""


@dataclass(frozen=True, slots=True)
class TensorScan:
    hash: str | None
    """``None`` for a quick scan (:func:`scan_first_chunk`), which hashes nothing."""
    precision: Precision
    stats: PrecisionStats | None


INFORMATIVE_CAP = 64
"""Informative values are counted up to this many; beyond it the evidence is overwhelming either way."""
_INFO_SLICE = 4096
_PREFIX = 256
"""Values of a chunk OR-reduced first: enough to decide a genuine fp32 chunk (P(256 values all with 13 zero low
bits) = 2**-3328), small enough to cost nothing when they do not."""

class _Fp32State:
    """Running precision evidence over the chunks of one fp32 tensor.

    The fp16 range test is expensive and moot while the tensor is still bf16-representable (bf16 wins), so it
    is deferred; if bf16 fails later, :attr:`recheck_fp16_chunks` says how many earlier chunks still need it.
    """

    __slots__ = ("bf16", "chunks", "fp16", "fp16_checked_from", "info_bf16", "info_fp16")

    def __init__(self) -> None:
        self.bf16 = True
        self.fp16 = True
        self.info_bf16 = 0
        self.info_fp16 = 0
        self.chunks = 0
        self.fp16_checked_from: int | None = None
        """Index of the first chunk whose fp16 range was checked (``None``: none yet)."""

    @property
    def undecided(self) -> bool:
        return self.bf16 or self.fp16

    @property
    def recheck_fp16_chunks(self) -> int:
        if not self.fp16 or self.bf16:
            return 0
        return self.fp16_checked_from if self.fp16_checked_from is not None else self.chunks

    def update(self, chunk: np.ndarray) -> None:
        import numpy as np

        index = self.chunks
        self.chunks += 1
        u = chunk.view(np.uint32)
        # A genuine fp32 chunk has low bits set within its first few values: a short OR-reduction decides both
        # formats (0x1FFF lies inside 0xFFFF) without a pass over the chunk, the same answer as the full one.
        if int(np.bitwise_or.reduce(u[:_PREFIX])) & 0x1FFF if u.size else False:
            self.bf16 = self.fp16 = False
            return
        # One OR-reduction (a single read pass, ~60 GB/s) answers both low-bit questions for the chunk.
        low = int(np.bitwise_or.reduce(u)) if u.size else 0
        if low & 0xFFFF:
            self.bf16 = False
        if low & 0x1FFF:
            self.fp16 = False
        if not self.undecided:
            return
        if self.fp16 and not self.bf16:
            if self.fp16_checked_from is None:
                self.fp16_checked_from = index
            self.fp16 = _fp16_exact(u)
        if self.info_bf16 >= INFORMATIVE_CAP and (self.info_fp16 >= INFORMATIVE_CAP or not self.fp16):
            return
        # Count informative values in small slices, stopping at the cap: usually the first slice suffices, so
        # these temporaries never cost a pass over the chunk.
        for lo in range(0, u.size, _INFO_SLICE):
            us = u[lo : lo + _INFO_SLICE]
            x = us.view(np.float32)
            with np.errstate(invalid="ignore"):  # a signalling-NaN bit pattern is data here, not an error
                non_integer = np.isfinite(x) & (np.floor(x) != x)
            if self.bf16 and self.info_bf16 < INFORMATIVE_CAP:
                self.info_bf16 += int(np.count_nonzero(non_integer & ((us & np.uint32(0x000F0000)) != 0)))
            if self.fp16 and self.info_fp16 < INFORMATIVE_CAP:
                self.info_fp16 += int(np.count_nonzero(non_integer & ((us & np.uint32(0x000FE000)) != 0)))
            if self.info_bf16 >= INFORMATIVE_CAP and (self.info_fp16 >= INFORMATIVE_CAP or not self.fp16):
                break

    def recheck(self, chunk: np.ndarray) -> None:
        """The deferred fp16 range test for one of the first :attr:`recheck_fp16_chunks` chunks."""
        import numpy as np

        if self.fp16:
            self.fp16 = _fp16_exact(chunk.view(np.uint32))

    def update_values(self, u: Sequence[int], x: Sequence[float]) -> None:
        """:meth:`update` without NumPy, step for step, for a chunk given as its bits ``u`` and its values ``x``
        (used for small tensors: :func:`scan_small`)."""
        index = self.chunks
        self.chunks += 1
        low = 0
        for v in u:
            low |= v
        if low & 0xFFFF:
            self.bf16 = False
        if low & 0x1FFF:
            self.fp16 = False
        if not self.undecided:
            return
        if self.fp16 and not self.bf16:
            if self.fp16_checked_from is None:
                self.fp16_checked_from = index
            self.fp16 = _fp16_exact_values(u)
        if self.info_bf16 >= INFORMATIVE_CAP and (self.info_fp16 >= INFORMATIVE_CAP or not self.fp16):
            return
        isfinite, floor = math.isfinite, math.floor
        for lo in range(0, len(u), _INFO_SLICE):
            us = u[lo : lo + _INFO_SLICE]
            non_integer = [isfinite(f) and floor(f) != f for f in x[lo : lo + _INFO_SLICE]]
            if self.bf16 and self.info_bf16 < INFORMATIVE_CAP:
                self.info_bf16 += sum(1 for n, v in zip(non_integer, us, strict=True) if n and v & 0x000F0000)
            if self.fp16 and self.info_fp16 < INFORMATIVE_CAP:
                self.info_fp16 += sum(1 for n, v in zip(non_integer, us, strict=True) if n and v & 0x000FE000)
            if self.info_bf16 >= INFORMATIVE_CAP and (self.info_fp16 >= INFORMATIVE_CAP or not self.fp16):
                break

    def recheck_values(self, u: Sequence[int]) -> None:
        """:meth:`recheck` without NumPy."""
        if self.fp16:
            self.fp16 = _fp16_exact_values(u)

    def result(self) -> tuple[Precision, PrecisionStats]:
        stats = PrecisionStats(self.bf16, self.fp16, min(self.info_bf16, INFORMATIVE_CAP),
                               min(self.info_fp16, INFORMATIVE_CAP))
        return classify(stats), stats


def _fp16_exact(u: np.ndarray) -> bool:
    """Whether every fp32 value (as bits) converts to fp16 and back unchanged."""
    import numpy as np

    e = ((u >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32)
    m = u & np.uint32(0x7FFFFF)
    zero = (u & np.uint32(0x7FFFFFFF)) == 0
    special = e == 255  # inf and NaN exist in fp16 too
    normal = (e >= 113) & (e <= 142)
    sub = (e >= 103) & (e <= 112)
    # Bits that fp16 cannot hold at this magnitude: 13 for normal values, 126 - e for fp16 subnormals.
    need = np.where(sub, 126 - e, 13).astype(np.uint32)
    low = m & ((np.uint32(1) << need) - np.uint32(1))
    ok = zero | special | ((normal | sub) & (low == 0))
    return bool(ok.all())


def classify(stats: PrecisionStats) -> Precision:
    if stats.bf16_representable and stats.informative_bf16 >= MIN_INFORMATIVE:
        return Precision.BF16
    if stats.fp16_representable and stats.informative_fp16 >= MIN_INFORMATIVE:
        return Precision.FP16
    if stats.bf16_representable or stats.fp16_representable:
        return Precision.INCONCLUSIVE
    return Precision.EXACT


def scan_tensor(data: TensorData, maps: FileMaps, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                buffer: np.ndarray | None = None, extra: Hasher | None = None) -> TensorScan:
    """Hash every byte of ``data`` and work out its effective precision, streaming.

    ``buffer``: a :func:`~ckptaudit.formats.io.tensors.scratch_buffer` of this thread to read into (one per
    thread, reused across tensors). ``extra``: a second hasher (a passport's cryptographic one) given the same
    bytes in the same order as the content hash, each chunk right after it, while it is in cache. Raises
    ``ValueError`` (bad shard layout) or ``OSError`` (unreadable file); callers turn these into findings.
    """
    if "numpy" not in sys.modules:
        small = scan_small(data, maps, chunk_bytes, budget=_PURE_BUDGET, extra=extra)
        if small is not None:
            return small
    import numpy as np

    h = xxhash.xxh3_128()
    dtype = data.dtype
    state = _Fp32State() if dtype.name == "float32" else None
    spans = row_major_runs(data)
    if spans is not None:
        for span in spans:
            _scan_span(span, data.dtype.itemsize, maps, chunk_bytes, buffer, h, state, extra)
    else:
        for chunk in iter_chunks(data, maps, chunk_bytes, buffer):
            # Chunks are C-contiguous (iter_chunks' promise): the hash reads them in place, as bytes.
            flat = chunk if chunk.flags.c_contiguous else np.ascontiguousarray(chunk)
            h.update(flat.data)
            if extra is not None:
                extra.update(flat.view(np.uint8).data)  # as bytes: a complex chunk's buffer format is no byte one
            if state is not None and state.undecided:
                state.update(chunk)
    if state is not None:
        pending = state.recheck_fp16_chunks
        if pending:
            # bf16 failed after some chunks whose fp16 range test was deferred: a second, partial pass.
            for i, chunk in enumerate(iter_chunks(data, maps, chunk_bytes, buffer)):
                if i >= pending or not state.fp16:
                    break
                state.recheck(chunk)
        precision, stats = state.result()
        return TensorScan(h.hexdigest(), precision, stats)
    if not dtype.is_float:
        return TensorScan(h.hexdigest(), Precision.NOT_FLOAT, None)
    if dtype.itemsize <= 2:
        return TensorScan(h.hexdigest(), Precision.NATIVE_16, None)
    return TensorScan(h.hexdigest(), Precision.EXACT, None)


def hash_tensor(data: TensorData, maps: FileMaps, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """:func:`scan_tensor`'s content hash alone (xxh3-128 of the tensor's bytes in row-major order, hex), read the
    same way: the runs of bytes through the leased map where they can be, else :func:`iter_chunks`. Raises
    ``ValueError`` / ``OSError`` as :func:`scan_tensor` does."""
    import numpy as np

    h = xxhash.xxh3_128()
    spans = row_major_runs(data)
    if spans is not None:
        for span in spans:
            _scan_span(span, data.dtype.itemsize, maps, chunk_bytes, None, h, None)
    else:
        for chunk in iter_chunks(data, maps, chunk_bytes):
            h.update((chunk if chunk.flags.c_contiguous else np.ascontiguousarray(chunk)).data)
    return h.hexdigest()


REMOTE_PIECE_BYTES = 4 << 20
"""A ranged read of a large tensor behind a URL (:data:`ckptaudit.formats.remote.READ_AHEAD` of them in flight):
object stores answer a request after a round trip, so 1 MiB reads spend more time waiting than reading."""
EXTRA_PIECE_BYTES = 1 << 20
"""Once a tensor's precision is decided, :func:`_visit` gives the content hash and an extra hasher (a passport's)
its bytes this many at a time: each piece is read by the second hasher from the core's cache (2 MiB of L2 here),
not from memory again."""
MAPPED_CHUNK_BYTES = 8 << 20
"""A window of a tensor's bytes read through a leased map (:mod:`ckptaudit.formats.io.leased`) at a time: one lease
and two ``madvise`` calls per window, the precision's chunks (``chunk_bytes``) visited inside it while each is in
cache. Resident memory: this much mapped per thread, at most (docs/performance.md, "The per-byte path")."""


def _visit(data: memoryview, step: int, h: xxhash.xxh3_128, state: _Fp32State | None,
           extra: Hasher | None = None) -> None:
    """The one place each of a tensor's bytes is visited on the fast path: ``data`` (a run of its bytes starting at a
    chunk boundary, its length a multiple of the element size) hashed and, while the precision is undecided, given
    to ``state`` chunk by chunk (``step`` bytes, :func:`~ckptaudit.formats.io.tensors.iter_chunks`' chunks), each
    right after it was hashed, while it is in cache; once decided, the rest is hashed in one call. ``extra``
    (:func:`scan_tensor`'s) gets each chunk right after the hash, while it is in cache: then the rest goes in
    :data:`EXTRA_PIECE_BYTES` pieces, each hashed by both before the next is touched."""
    import numpy as np

    at, n = 0, len(data)
    while at < n:
        if state is None or not state.undecided:
            if extra is None:
                h.update(data[at:] if at else data)
                return
            chunk = data[at : at + EXTRA_PIECE_BYTES]
            h.update(chunk)
            extra.update(chunk)
            at += EXTRA_PIECE_BYTES
            continue
        chunk = data[at : at + step]
        h.update(chunk)
        if extra is not None:
            extra.update(chunk)
        state.update(np.frombuffer(chunk, dtype=np.uint32))  # keeps no reference to it
        at += step


def _scan_span(span: tuple[str, int, int], itemsize: int, maps: FileMaps, chunk_bytes: int,
               buffer: np.ndarray | None, h: xxhash.xxh3_128, state: _Fp32State | None,
               extra: Hasher | None = None) -> None:
    """:func:`scan_tensor`'s pass over one run of a tensor's bytes (:func:`~ckptaudit.formats.io.tensors.row_major_runs`): the chunks
    :func:`~ckptaudit.formats.io.tensors.iter_chunks` yields (``chunk_bytes // itemsize`` elements each), without its
    per-tensor and per-chunk set-up: a checkpoint of a thousand small tensors spends more on that than on their bytes.

    Where the file can be read through a leased map (:meth:`FileMaps.leased`), the bytes are visited where they lie
    in the page cache, :data:`MAPPED_CHUNK_BYTES` at a time (a whole number of chunks); elsewhere each chunk is read
    with one positional read into ``buffer`` (the same short-read error as ``iter_chunks``). Either way
    :func:`_visit` gives the hash every byte in order and the precision ``iter_chunks``' chunks.
    """
    import numpy as np

    path, pos, remaining = span
    step = max(1, chunk_bytes // itemsize) * itemsize
    if remaining and buffer is not None and buffer.nbytes < step:  # iter_chunks' condition and message
        raise ValueError(f"scratch buffer of {buffer.nbytes} bytes is smaller than a chunk ({step} bytes): "
                         "make it with scratch_buffer(chunk_bytes)")
    if remaining > step and maps.remote is not None and path in maps.remote:
        # Behind a URL: ranged reads of REMOTE_PIECE_BYTES, several in flight (a request costs a round trip: few
        # large ones reach the store's throughput), hashed in order; the precision still sees iter_chunks' chunks.
        piece = max(step, REMOTE_PIECE_BYTES // step * step)
        for data in maps.remote.read_ahead(path, pos, remaining, piece):
            want = min(piece, remaining)
            if len(data) < want:  # iter_chunks' message, at the first chunk that ends early
                at = len(data) // step * step
                n = min(step, want - at)
                raise ValueError(f"{path}: {len(data) - at} of {n} bytes at offset {pos + at}: the file ends "
                                 "early (truncated, or changed while being read)")
            _visit(memoryview(data)[:want], step, h, state, extra)
            pos += want
            remaining -= want
        if remaining:  # the object is shorter than the stand-in: the reads ended early
            raise ValueError(f"{path}: 0 of {min(step, remaining)} bytes at offset {pos}: the file ends early "
                             "(truncated, or changed while being read)")
        return
    leased = maps.leased(path) if remaining >= MIN_MAPPED_BYTES else None
    window = max(1, MAPPED_CHUNK_BYTES // step) * step
    buf = None
    while remaining:
        if leased is not None:
            n = min(window, remaining)
            view = leased.view(pos, n)
            if view is not None:
                try:
                    _visit(view, step, h, state, extra)
                finally:
                    leased.done(view, pos)
                pos += n
                remaining -= n
                continue
        if buf is None:
            buf = np.empty(min(step, remaining), dtype=np.uint8) if buffer is None else buffer
        raw = buf.data.cast("B")
        n = min(step, remaining)
        got = maps.read_into(path, raw[:n], pos)
        if got != n:  # iter_chunks' message
            raise ValueError(f"{path}: {got} of {n} bytes at offset {pos}: the file ends early "
                             "(truncated, or changed while being read)")
        _visit(raw[:n], step, h, state, extra)
        pos += n
        remaining -= n


def scan_first_chunk(data: TensorData, maps: FileMaps, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TensorScan:
    """The quick scan: effective precision from the first chunk of ``data`` only, and no hash.

    A genuine fp32 tensor is told from a rounded one by its first chunk (one value needing the low bits is
    enough), so a tensor called rounded here is rounded; but a tensor whose first chunk is exact and whose later
    chunks were rounded (or corrupted) is not seen. Raises ``ValueError`` / ``OSError`` as :func:`scan_tensor`.
    """
    dtype = data.dtype
    if not dtype.is_float:
        return TensorScan(None, Precision.NOT_FLOAT, None)
    if dtype.name != "float32":
        return TensorScan(None, Precision.NATIVE_16 if dtype.itemsize <= 2 else Precision.EXACT, None)
    state = _Fp32State()
    chunk = next(iter(iter_chunks(data, maps, chunk_bytes)), None)
    if chunk is not None:
        state.update(chunk)
        if state.recheck_fp16_chunks:
            state.recheck(chunk)
    precision, stats = state.result()
    return TensorScan(None, precision, stats)


def _fp16_exact_values(u: Sequence[int]) -> bool:
    """:func:`_fp16_exact` without NumPy."""
    for v in u:
        if not v & 0x7FFFFFFF:
            continue  # zero
        e = (v >> 23) & 0xFF
        if e == 255:
            continue  # inf and NaN exist in fp16 too
        if 113 <= e <= 142:
            need = 13
        elif 103 <= e <= 112:
            need = 126 - e
        else:
            return False
        if v & 0x7FFFFF & ((1 << need) - 1):
            return False
    return True


SMALL_SCAN_BUDGET = 256 << 10
"""Bytes a process scans without NumPy in all: past it, importing NumPy (~0.1 s) is cheaper than Python loops."""


class _Budget:
    """Bytes left for NumPy-free scans in this process; threads draw from it under a lock."""

    def __init__(self, total: int) -> None:
        self.left = total
        self._lock = threading.Lock()

    def draw(self, nbytes: int) -> bool:
        with self._lock:
            if nbytes > self.left:
                return False
            self.left -= nbytes
            return True


_PURE_BUDGET = _Budget(SMALL_SCAN_BUDGET)


def scan_small(data: TensorData, maps: FileMaps, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *,
               budget: _Budget | None = None, extra: Hasher | None = None) -> TensorScan | None:
    """:func:`scan_tensor` without NumPy, for a small tensor stored as contiguous pieces; ``None`` when the tensor
    does not qualify (over :data:`SMALL_TENSOR_BYTES`, strided, the budget spent, a big-endian host).

    Importing NumPy costs more than scanning a few kilobytes in Python, and a small checkpoint's audit should
    start in a blink. The result is the same as :func:`scan_tensor`'s, bit for bit: the same bytes hashed, and
    the precision evidence gathered chunk by chunk in the same steps (:meth:`_Fp32State.update_values`);
    ``tests/auditing/test_tensor_scan_small.py`` holds the two paths equal on random and crafted values of every dtype.
    """
    if sys.byteorder != "little":
        return None
    plan = small_read_plan(data, SMALL_TENSOR_BYTES)
    if plan is None or (budget is not None and not budget.draw(data.nbytes)):
        return None
    h = xxhash.xxh3_128()
    dtype = data.dtype
    state = _Fp32State() if dtype.name == "float32" else None
    # iter_chunks' chunks: each piece cut into chunks of chunk_bytes // itemsize elements.
    step = max(1, chunk_bytes // dtype.itemsize) * dtype.itemsize
    chunks: list[memoryview] = []
    for piece, pos in plan:
        raw = read_exact(maps, piece, pos, piece.numel * dtype.itemsize)
        h.update(raw)
        if extra is not None:
            extra.update(raw)
        if state is not None:
            chunks += [memoryview(raw)[lo : lo + step] for lo in range(0, len(raw), step)]
    if state is not None:
        for chunk in chunks:
            if not state.undecided:
                break
            state.update_values(chunk.cast("I"), chunk.cast("f"))
        # bf16 failed after chunks whose fp16 range test was deferred: recheck those.
        for chunk in chunks[: state.recheck_fp16_chunks]:
            if not state.fp16:
                break
            state.recheck_values(chunk.cast("I"))
        precision, stats = state.result()
        return TensorScan(h.hexdigest(), precision, stats)
    if not dtype.is_float:
        return TensorScan(h.hexdigest(), Precision.NOT_FLOAT, None)
    if dtype.itemsize <= 2:
        return TensorScan(h.hexdigest(), Precision.NATIVE_16, None)
    return TensorScan(h.hexdigest(), Precision.EXACT, None)
