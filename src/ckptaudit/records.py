"""From lazy tensors to :class:`~ckptaudit.model.TensorRecord`: content hash and effective precision.

One streaming pass per tensor, one bounded chunk at a time (see :mod:`ckptaudit.formats.tensors`): the hash
sees every byte; the precision test works on the raw fp32 bits and stops as soon as a value needs the low
mantissa bits (the common case for a genuine fp32 tensor is decided by its first chunk).

Effective precision of an fp32 tensor (see README, "How rounding is detected"):

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

from dataclasses import dataclass

import numpy as np
import xxhash

from ckptaudit.formats.tensors import DEFAULT_CHUNK_BYTES, FileMaps, TensorData, iter_chunks
from ckptaudit.model import Precision, PrecisionStats

__all__ = ["MIN_INFORMATIVE", "TensorScan", "classify", "fp32_precision_state", "scan_tensor"]

MIN_INFORMATIVE = 4
"""Informative values needed before a 16-bit-representable tensor is called rounded."""


@dataclass(frozen=True, slots=True)
class TensorScan:
    hash: str
    precision: Precision
    stats: PrecisionStats | None


class _Fp32State:
    """Running precision evidence over the chunks of one fp32 tensor."""

    __slots__ = ("bf16", "fp16", "info_bf16", "info_fp16")

    def __init__(self) -> None:
        self.bf16 = True
        self.fp16 = True
        self.info_bf16 = 0
        self.info_fp16 = 0

    @property
    def undecided(self) -> bool:
        return self.bf16 or self.fp16

    def update(self, chunk: np.ndarray) -> None:
        u = chunk.view(np.uint32)
        if self.bf16:
            # Low halves of little-endian fp32 words: a strided view, no temporary (shared/PERFORMANCE.md).
            if np.count_nonzero(u.view(np.uint16)[0::2]):
                self.bf16 = False
        if self.fp16 and np.count_nonzero(u & np.uint32(0x1FFF)):
            self.fp16 = False
        if not self.undecided:
            return
        x = chunk.view(np.float32)
        finite = np.isfinite(x)
        non_integer = finite & (np.floor(x) != x)
        if self.fp16:
            self.fp16 = _fp16_exact(u)
        if self.bf16:
            self.info_bf16 += int(np.count_nonzero(non_integer & ((u & np.uint32(0x000F0000)) != 0)))
        if self.fp16:
            self.info_fp16 += int(np.count_nonzero(non_integer & ((u & np.uint32(0x000FE000)) != 0)))

    def result(self) -> tuple[Precision, PrecisionStats]:
        stats = PrecisionStats(self.bf16, self.fp16, self.info_bf16, self.info_fp16)
        return classify(stats), stats


def fp32_precision_state() -> _Fp32State:
    return _Fp32State()


def _fp16_exact(u: np.ndarray) -> bool:
    """Whether every fp32 value (as bits) converts to fp16 and back unchanged."""
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


def scan_tensor(data: TensorData, maps: FileMaps, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TensorScan:
    """Hash every byte of ``data`` and work out its effective precision, streaming.

    Raises ``ValueError`` (bad shard layout) or ``OSError`` (unreadable file); callers turn these into
    findings.
    """
    h = xxhash.xxh3_128()
    dtype = data.dtype
    state = _Fp32State() if dtype.name == "float32" else None
    for chunk in iter_chunks(data, maps, chunk_bytes):
        h.update(np.ascontiguousarray(chunk).data.cast("B"))
        if state is not None and state.undecided:
            state.update(chunk)
    if state is not None:
        precision, stats = state.result()
        return TensorScan(h.hexdigest(), precision, stats)
    if not dtype.is_float:
        return TensorScan(h.hexdigest(), Precision.NOT_FLOAT, None)
    if dtype.itemsize <= 2:
        return TensorScan(h.hexdigest(), Precision.NATIVE_16, None)
    return TensorScan(h.hexdigest(), Precision.EXACT, None)
