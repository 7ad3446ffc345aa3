"""Element-wise comparison of two tensors streamed as chunks: pure NumPy, no I/O, bounded memory.

Both tensors arrive as equal-length chunk pairs (:func:`paired_chunks` re-aligns two sides that are sharded
and chunked differently), and :func:`compare_streams` classifies them:

1. :class:`Classifier` keeps hypotheses alive -- *equal*, and for an fp32 reference the candidate being the
   reference rounded to bf16 / fp16 by round-to-nearest-even, by round-toward-zero (truncation), or to one of
   the two neighbouring 16-bit values by some other rule (stochastic rounding) -- and drops each at the first
   chunk that contradicts it. When none is left the pass stops: a genuinely different tensor costs one chunk.
   A hypothesis the verdict ranks lower (fp16 below bf16 below equal) is not tested while a higher one holds;
   if the higher one fails after the first chunk, the pass restarts without it.
2. Only for a tensor that is *different*, :class:`DiffAccumulator` measures how: maximum absolute difference,
   maximum difference in units in the last place of the reference dtype, relative L2 error, and the fraction
   of elements that differ.

The bf16 rules work on the raw fp32 bits. With ``u`` the reference bits, ``c`` the candidate's (a bf16 value
widened to fp32: low 16 bits zero) and ``d = u - c`` modulo 2**32:

- truncation (round toward zero)  <=>  ``0 <= d <= 0xFFFF``;
- one of the two neighbours        <=>  ``-0xFFFF <= d <= 0xFFFF``;
- round-to-nearest-even           <=>  ``c == (u + 0x7FFF + lsb) & ~0xFFFF`` with ``lsb`` bit 16 of ``u`` (ties
  to even), i.e. ``0 <= d + lsb + 0x7FFF <= 0xFFFF``.

Each is one reduction (a maximum) per chunk. Floats are sign-magnitude, so the same tests hold for negative
values, and a sign change fails them all. fp16 uses NumPy's float32 -> float16 conversion (round-to-nearest-
even) and steps one unit toward zero on the 16-bit pattern for truncation. NaN against NaN counts as equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ckptaudit.formats.io.tensors import DType

__all__ = [
    "ROUNDINGS",
    "Classifier",
    "DiffAccumulator",
    "DiffStats",
    "Pool",
    "compare_streams",
    "paired_chunks",
]

ROUNDINGS = ("round-to-nearest-even", "round-toward-zero", "stochastic-or-other")
"""How a 16-bit-rounded candidate was rounded, most specific first."""

_U32 = np.uint32
_NUMERIC_FLOATS = ("float64", "float32", "float16", "bfloat16")


def _numeric(dtype: DType) -> bool:
    return dtype.name in _NUMERIC_FLOATS or not dtype.is_float


def _common(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sides in one NumPy type where values can be compared exactly."""
    if a.dtype == b.dtype:
        return a, b
    t = np.result_type(a.dtype, b.dtype)
    if a.dtype.kind in "iub" and b.dtype.kind in "iub" and t.kind == "f":  # int64 vs uint64
        return a.astype(np.float64), b.astype(np.float64)
    return a.astype(t, copy=False), b.astype(t, copy=False)


def _bits(x: np.ndarray) -> np.ndarray:
    """The raw bit patterns (so that -0.0 != 0.0 and NaN payloads count, as in the content hash)."""
    if x.dtype.itemsize in (1, 2, 4, 8):
        return x.view(f"<u{x.dtype.itemsize}")
    return x.view(np.uint8)


def paired_chunks(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Re-chunk two row-major streams of the same element count into pairs of equal length.

    Each yielded pair is a pair of views, valid until the next pair is requested. Raises ``ValueError`` when
    one stream ends before the other.
    """
    ita, itb = iter(a), iter(b)
    ca: np.ndarray | None = None
    cb: np.ndarray | None = None
    ia = ib = 0
    while True:
        while ca is None or ia >= len(ca):
            ca, ia = next(ita, None), 0
            if ca is None:
                break
        while cb is None or ib >= len(cb):
            cb, ib = next(itb, None), 0
            if cb is None:
                break
        if ca is None or cb is None:
            if ca is not None or cb is not None:
                raise ValueError("the two tensors hold different numbers of elements")
            return
        n = min(len(ca) - ia, len(cb) - ib)
        yield ca[ia : ia + n], cb[ib : ib + n]
        ia += n
        ib += n


class Pool:
    """Reusable work arrays, by name, grown to the largest chunk seen.

    Fresh 1 MiB temporaries cost a page fault per 4 KiB each time (the allocator returns large blocks to the
    kernel), which made the passes several times slower; one pool serves every pair of a comparison, so its
    size is bounded by the chunk (a few MiB), not by the checkpoint.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, dtype: type | np.dtype, n: int) -> np.ndarray:
        dt = np.dtype(dtype)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dt or len(buf) < n:
            buf = np.empty(n, dt)
            self._bufs[name] = buf
        return buf[:n]


def _decode_into(chunk: np.ndarray, dtype: DType, pool: Pool, name: str) -> np.ndarray:
    """Raw chunk -> NumPy values, bf16 widened exactly to float32 in the pool's ``name`` array (float8 and
    complex stay as read: they are compared, not measured in ULPs)."""
    if dtype.name != "bfloat16":
        return chunk
    out = pool.get(name, _U32, len(chunk))
    np.copyto(out, chunk)
    np.left_shift(out, _U32(16), out=out)
    return out.view(np.float32)


def _all_true_or_nan_pairs(mask: np.ndarray, a: np.ndarray, b: np.ndarray) -> bool:
    """``mask.all()``, where positions that are NaN on both sides count as true."""
    if mask.all():
        return True
    if a.dtype.kind not in "fc":
        return False
    first = int(np.argmin(mask))  # the first false position: most mismatches are not NaN pairs, stop here
    if not (np.isnan(a[first]) and np.isnan(b[first])):
        return False
    return bool(np.all(mask | (np.isnan(a) & np.isnan(b))))


class _Rules:
    """Running rounding hypotheses (nearest-even, toward-zero, neighbours) for an fp32 reference; a chunk
    that contradicts a rule kills it for the rest of the tensor."""

    __slots__ = ("alive", "cand_storage", "pool")

    def __init__(self, cand_storage: str, pool: Pool) -> None:
        self.cand_storage = cand_storage
        self.pool = pool
        self.alive = {"round-to-nearest-even": True, "round-toward-zero": True, "stochastic-or-other": True}

    def any(self) -> bool:
        return any(self.alive.values())

    def kill(self) -> None:
        for k in self.alive:
            self.alive[k] = False


class _Bf16Rules(_Rules):
    """The bf16 hypotheses."""

    __slots__ = ("check_low",)

    def __init__(self, cand_storage: str, pool: Pool, *, check_low: bool = True) -> None:
        super().__init__(cand_storage, pool)
        self.check_low = check_low and cand_storage == "float32"
        """Whether each fp32 candidate chunk must be checked for bf16 values (unknown from its scan)."""

    def exact_rule_alive(self) -> bool:
        return self.alive["round-to-nearest-even"] or self.alive["round-toward-zero"]

    def update(self, ref: np.ndarray, cand: np.ndarray) -> None:
        n = len(ref)
        pool = self.pool
        u = ref.view(_U32)
        if self.cand_storage == "bfloat16":
            c = pool.get("wide", _U32, n)
            np.copyto(c, cand)
            np.left_shift(c, _U32(16), out=c)
        else:
            c = cand.view(_U32)
            # One OR-reduction: is any low half (the bits bf16 lacks) non-zero?
            if self.check_low and n and int(np.bitwise_or.reduce(c)) & 0xFFFF:
                self.kill()
                return
        d, f = pool.get("d", _U32, n), pool.get("f", _U32, n)
        np.subtract(u, c, out=d)  # modulo 2**32
        held_this_chunk = False
        if self.alive["round-to-nearest-even"]:
            # c == rne(u) == (u + 0x7FFF + lsb) & ~0xFFFF, lsb = bit 16 of u (ties to even), and c has no low
            # bits, so: d + lsb + 0x7FFF lies in [0, 0xFFFF]. One reduction, no special case for ties.
            np.right_shift(u, _U32(16), out=f)
            np.bitwise_and(f, _U32(1), out=f)
            np.add(f, d, out=f)
            if _within(f, 0x7FFF, 0xFFFF, ref, c, pool):
                held_this_chunk = True
            else:
                self.alive["round-to-nearest-even"] = False
        if self.alive["round-toward-zero"]:
            if _within(d, 0, 0xFFFF, ref, c, pool):
                held_this_chunk = True
            else:
                self.alive["round-toward-zero"] = False
        if self.alive["stochastic-or-other"] and not held_this_chunk:
            # Nearest-even or truncation held for this chunk, and each implies a neighbour: no test needed.
            if not _within(d, 0xFFFF, 0x1FFFE, ref, c, pool):
                self.alive["stochastic-or-other"] = False


def _within(x: np.ndarray, shift: int, top: int, ref: np.ndarray, c: np.ndarray, pool: Pool) -> bool:
    """Whether every ``(x + shift) mod 2**32 <= top``, NaN-against-NaN positions excepted. Adds ``shift`` to
    ``x`` in place; the common outcome costs one reduction."""
    if shift:
        np.add(x, _U32(shift), out=x)
    if not len(x) or int(np.maximum.reduce(x)) <= top:
        return True
    bad = pool.get("mask", bool, len(x))
    np.greater(x, _U32(top), out=bad)
    first = int(np.argmax(bad))
    if not _both_nan(ref[first : first + 1], c[first : first + 1]).all():
        return False
    idx = np.flatnonzero(bad)
    return bool(_both_nan(ref[idx], c[idx]).all())


def _both_nan(ref_f32: np.ndarray, cand_bits: np.ndarray) -> np.ndarray:
    return np.isnan(ref_f32.view(np.float32)) & np.isnan(cand_bits.view(np.float32))


class _Fp16Rules(_Rules):
    """The fp16 hypotheses (candidate stored as fp16, or as fp32 holding fp16 values)."""

    __slots__ = ()

    def update(self, ref: np.ndarray, cand: np.ndarray) -> None:
        n = len(ref)
        pool = self.pool
        r = ref.view(np.float32)
        mask = pool.get("mask", bool, n)
        wide = pool.get("wide", _U32, n).view(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            if self.cand_storage == "float16":
                ch = cand.view(np.uint16)
            else:
                c = cand.view(np.float32)
                h = pool.get("h1", np.uint16, n).view(np.float16)
                np.copyto(h, c, casting="unsafe")
                np.copyto(wide, h)
                np.equal(wide.view(_U32), c.view(_U32), out=mask)
                if not mask.all():  # some value is not an fp16 value
                    self.kill()
                    return
                ch = h.view(np.uint16)
            rne = pool.get("h2", np.uint16, n).view(np.float16)
            np.copyto(rne, r, casting="unsafe")  # NumPy's float32 -> float16 rounds to nearest even
        rne_bits = rne.view(np.uint16)

        def nan_ok() -> np.ndarray:
            return np.isnan(r) & np.isnan(ch.view(np.float16))

        held_this_chunk = False
        if self.alive["round-to-nearest-even"]:
            np.equal(ch, rne_bits, out=mask)
            if not _all_or_nan(mask, nan_ok):
                self.alive["round-to-nearest-even"] = False
            else:
                held_this_chunk = True
        if self.alive["round-toward-zero"] or self.alive["stochastic-or-other"]:
            np.copyto(wide, rne)
            away = np.abs(wide) > np.abs(r)  # rounded away from zero: step one unit back toward it
            rtz = rne_bits - away.astype(np.uint16)
            if self.alive["round-toward-zero"]:
                if not _all_or_nan(ch == rtz, nan_ok):
                    self.alive["round-toward-zero"] = False
                else:
                    held_this_chunk = True
            if self.alive["stochastic-or-other"] and not held_this_chunk:
                inexact = wide != r
                ok = (ch == rtz) | ((ch == rtz + np.uint16(1)) & inexact)
                if not _all_or_nan(ok, nan_ok):
                    self.alive["stochastic-or-other"] = False


def _all_or_nan(ok: np.ndarray, nan_ok: Callable[[], np.ndarray]) -> bool:
    if ok.all():
        return True
    return bool(np.all(ok | nan_ok()))


class Classifier:
    """Phase 1 over one tensor pair: which of equal / bf16-rounded / fp16-rounded still fits.

    Feed equal-length raw chunks (as :func:`~ckptaudit.formats.io.tensors.iter_chunks` yields them) with
    :meth:`update`; it returns ``False`` once nothing but *different* is possible (stop reading then), or
    when :attr:`restart` is set: read again from the start with :meth:`successor`.

    Hypotheses are tested in the order the verdict prefers them (equal, bf16, fp16), and a lower one is not
    tested while a higher one holds: a bf16-rounded tensor never pays for the fp16 rules. Should the higher
    one fail after the first chunk, the lower one has gaps, and the pass restarts without the dead one.

    ``cand_bf16`` / ``cand_fp16``: what the fp32 candidate's own scan knows -- ``False``: some value is not a
    bf16 (fp16) value, so it cannot be a rounding to it; ``True`` (bf16 only): every value is one, no need to
    check per chunk; ``None``: unknown.
    """

    def __init__(self, ref: DType, cand: DType, *, pool: Pool | None = None, cand_bf16: bool | None = None,
                 cand_fp16: bool | None = None, lazy: bool = True) -> None:
        self.ref, self.cand = ref, cand
        self.pool = pool or Pool()
        self.same_dtype = ref.name == cand.name
        self.equal = True
        self.bitwise = self.same_dtype
        self.numeric = _numeric(ref) and _numeric(cand)
        self.lazy = lazy
        self.restart = False
        self._gaps = {"bf16": False, "fp16": False}
        fp32_ref = ref.name == "float32"
        self.bf16 = (_Bf16Rules(cand.name, self.pool, check_low=cand_bf16 is not True)
                     if fp32_ref and cand.name in ("float32", "bfloat16") else None)
        self.fp16 = _Fp16Rules(cand.name, self.pool) if fp32_ref and cand.name in ("float32", "float16") else None
        if self.bf16 is not None and cand_bf16 is False:
            self.bf16.kill()
        if self.fp16 is not None and cand_fp16 is False:
            self.fp16.kill()

    def alive(self) -> bool:
        return self.equal or (self.bf16 is not None and self.bf16.any()) or (
            self.fp16 is not None and self.fp16.any())

    def successor(self) -> Classifier:
        """A classifier for a second pass: what is dead stays dead, nothing is skipped."""
        nxt = Classifier(self.ref, self.cand, pool=self.pool, lazy=False)
        nxt.equal = self.equal
        nxt.bitwise = self.bitwise
        for mine, theirs in ((self.bf16, nxt.bf16), (self.fp16, nxt.fp16)):
            if mine is not None and theirs is not None:
                theirs.alive = dict(mine.alive)
                if isinstance(mine, _Bf16Rules) and isinstance(theirs, _Bf16Rules):
                    theirs.check_low = mine.check_low
        return nxt

    def update(self, ref: np.ndarray, cand: np.ndarray) -> bool:
        if self.equal:
            if not (self.bitwise and self._bits_equal(ref, cand)):
                self.bitwise = False
                self.equal = self.numeric and self._values_equal(ref, cand)
        for name, rules in (("bf16", self.bf16), ("fp16", self.fp16)):
            if rules is None or not rules.any():
                continue
            if self.lazy and self._blocked(name):
                self._gaps[name] = True
            elif self._gaps[name]:
                self.restart = True
                return False
            else:
                rules.update(ref, cand)
        return self.alive()

    def _blocked(self, name: str) -> bool:
        """Whether a hypothesis the verdict prefers to ``name``'s rules still holds."""
        if name == "bf16":
            return self.equal
        return self.equal or (self.bf16 is not None and self.bf16.exact_rule_alive())

    def finish(self) -> None:
        """At the end of the stream: sets :attr:`restart` if rules that were skipped now decide the verdict."""
        for name, rules in (("bf16", self.bf16), ("fp16", self.fp16)):
            if rules is not None and rules.any() and self._gaps[name] and not self._blocked(name):
                self.restart = True

    def _bits_equal(self, ref: np.ndarray, cand: np.ndarray) -> bool:
        eq = self.pool.get("mask", bool, len(ref))
        np.equal(_bits(ref), _bits(cand), out=eq)
        return bool(eq.all())

    def _values_equal(self, ref: np.ndarray, cand: np.ndarray) -> bool:
        a = _decode_into(ref, self.ref, self.pool, "wide")
        b = _decode_into(cand, self.cand, self.pool, "wide2")
        if a.dtype != b.dtype:
            a, b = _common(a, b)
        eq = self.pool.get("mask", bool, len(ref))
        np.equal(a, b, out=eq)
        return _all_true_or_nan_pairs(eq, a, b)

    def verdict(self) -> tuple[str, str | None] | None:
        """``(status, rounding)`` or ``None`` for *different* (then measure with :class:`DiffAccumulator`)."""
        if self.equal:
            return ("identical" if self.bitwise else "equal-values"), None
        for fmt, rules in (("bf16", self.bf16), ("fp16", self.fp16)):
            if rules is not None:
                for rounding in ROUNDINGS:
                    if rules.alive[rounding] and rounding != "stochastic-or-other":
                        return f"{fmt}-rounded", rounding
        for fmt, rules in (("bf16", self.bf16), ("fp16", self.fp16)):
            if rules is not None and rules.alive["stochastic-or-other"]:
                return f"{fmt}-rounded", "stochastic-or-other"
        return None


@dataclass(frozen=True, slots=True)
class DiffStats:
    """How two tensors of the same shape differ."""

    numel: int
    differ: int
    """Elements whose values differ (NaN equals NaN)."""
    max_abs: float | None
    """Largest ``|cand - ref|`` over elements finite on both sides; ``None`` when not numeric."""
    max_ulp: float | None
    """Largest ``|cand - ref|`` in units in the last place of the reference dtype at the reference value."""
    rel_l2: float | None
    """``||cand - ref||_2 / ||ref||_2`` over elements finite on both sides (``inf`` if ``ref`` is all zero)."""

    @property
    def fraction(self) -> float:
        return self.differ / self.numel if self.numel else 0.0


class DiffAccumulator:
    """Phase 2 over one tensor pair that is not equal: difference statistics, streaming, in float64.

    The common case (every value finite on both sides) runs on pooled work arrays; chunks with NaN or
    infinity take a slower path that drops those positions from the measures (they still count as differing
    unless both sides are NaN).
    """

    def __init__(self, ref: DType, cand: DType, *, pool: Pool | None = None) -> None:
        self.ref, self.cand = ref, cand
        self.pool = pool or Pool()
        self.numeric = _numeric(ref) and _numeric(cand)
        self.numel = 0
        self.differ = 0
        self.max_abs = 0.0
        # ULPs of the reference dtype: bf16 has fp32's exponent range and 16 fewer mantissa bits, so its
        # spacing is fp32's times 2**16 (subnormals included).
        self.ulp_scale = {"float32": 1.0, "float64": 1.0, "float16": 1.0, "bfloat16": 65536.0}.get(ref.name)
        self.max_ulp = 0.0 if self.ulp_scale is not None and self.numeric else None
        self.sq_diff = 0.0
        self.sq_ref = 0.0

    def update(self, ref: np.ndarray, cand: np.ndarray) -> None:
        n = len(ref)
        self.numel += n
        if not self.numeric:
            self.differ += int(np.count_nonzero(ref != cand)) if ref.dtype == cand.dtype else n
            return
        pool = self.pool
        ra = _decode_into(ref, self.ref, pool, "wide")  # the reference in its own type (for its spacing)
        a, b, d = pool.get("a64", np.float64, n), pool.get("b64", np.float64, n), pool.get("d64", np.float64, n)
        np.copyto(a, ra)
        np.copyto(b, _decode_into(cand, self.cand, pool, "wide2"))
        eq = pool.get("mask", bool, n)
        np.equal(a, b, out=eq)
        np.subtract(b, a, out=d)
        np.abs(d, out=d)
        with np.errstate(invalid="ignore", over="ignore"):
            total = float(np.add.reduce(d)) + float(np.add.reduce(a))
            if not math.isfinite(total):
                self._update_nonfinite(ra, a, b, eq)
                return
            self.differ += n - int(np.count_nonzero(eq))
            self.max_abs = max(self.max_abs, float(d.max()))
            self.sq_diff += float(np.dot(d, d))
            self.sq_ref += float(np.dot(a, a))
            if self.max_ulp is not None and self.ulp_scale is not None:
                sp = pool.get("sp_" + ra.dtype.name, ra.dtype, n)
                np.spacing(ra, out=sp)  # negative for negative values: divide, then take |.|
                np.divide(d, sp, out=d)
                np.abs(d, out=d)
                self.max_ulp = max(self.max_ulp, float(d.max()) / self.ulp_scale)

    def _update_nonfinite(self, ra: np.ndarray, a: np.ndarray, b: np.ndarray, eq: np.ndarray) -> None:
        both_nan = np.isnan(a) & np.isnan(b)
        self.differ += int(np.count_nonzero(~(eq | both_nan)))
        fin = np.isfinite(a) & np.isfinite(b)
        a, b, ra = a[fin], b[fin], ra[fin]
        if not len(a):
            return
        d = np.abs(b - a)
        self.max_abs = max(self.max_abs, float(d.max()))
        self.sq_diff += float(np.dot(d, d))
        self.sq_ref += float(np.dot(a, a))
        if self.max_ulp is not None and self.ulp_scale is not None:
            sp = np.abs(np.spacing(ra)).astype(np.float64) * self.ulp_scale
            self.max_ulp = max(self.max_ulp, float((d / sp).max()))

    def result(self) -> DiffStats:
        if not self.numeric:
            return DiffStats(self.numel, self.differ, None, None, None)
        if self.sq_ref > 0:
            rel = math.sqrt(self.sq_diff / self.sq_ref)
        else:
            rel = 0.0 if self.sq_diff == 0 else math.inf
        return DiffStats(self.numel, self.differ, self.max_abs, self.max_ulp, rel)


def compare_streams(stream: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]], ref: DType, cand: DType, *,
                    measure: bool = True, pool: Pool | None = None, cand_bf16: bool | None = None,
                    cand_fp16: bool | None = None) -> tuple[str, str | None, DiffStats | None]:
    """``(status, rounding, stats)`` of one tensor pair. ``stream()`` yields equal-length raw chunk pairs from
    the start each time it is called (:func:`paired_chunks`): once for the classification (twice if a
    preferred hypothesis failed after the first chunk), once more for the statistics of a *different* pair
    unless ``measure`` is false."""
    pool = pool or Pool()
    cl = Classifier(ref, cand, pool=pool, cand_bf16=cand_bf16, cand_fp16=cand_fp16)
    for _attempt in range(2):
        for a, b in stream():
            if not cl.update(a, b):
                break
        else:
            cl.finish()
        if not cl.restart:
            break
        cl = cl.successor()  # a preferred hypothesis failed late: test the skipped ones from the start
    verdict = cl.verdict()
    if verdict is not None:
        return verdict[0], verdict[1], None
    if not measure:
        return "different", None, None
    acc = DiffAccumulator(ref, cand, pool=pool)
    for a, b in stream():
        acc.update(a, b)
    return "different", None, acc.result()
