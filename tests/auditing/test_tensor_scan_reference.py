"""The optimised scan (:func:`ckptaudit.auditing.tensor_scan.scan_tensor`) equals a straightforward reference, bit for bit.

The reference reads the whole tensor into memory and works out, chunk by chunk as the streaming scan sees the
chunks, the same precision evidence with whole-chunk NumPy expressions and no shortcuts: no prefix test, no
deferred fp16 range test, no capped or sliced counting, no reused buffers. Its hash is xxh3-128 of the
tensor's row-major bytes (what manifests and ``compare`` rely on). Random tensors of every dtype and crafted
fp32 tensors (rounded, exact, special values, a single genuine value at every interesting place), at chunk
sizes that put chunk boundaries inside them, with one reused scratch buffer across all scans.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptaudit.auditing.tensor_scan import INFORMATIVE_CAP, TensorScan, classify, scan_tensor
from ckptaudit.findings import Precision, PrecisionStats
from ckptaudit.formats.io.tensors import DTYPES, FileMaps, Piece, TensorData, scratch_buffer

CHUNK_BYTES = (16, 64, 1000, 1024, 4096, 1 << 20)


def reference_scan(pieces: list[np.ndarray], dtype: str, chunk_bytes: int) -> TensorScan:
    """What the scan must give: ``pieces`` are the tensor's row slabs in order (each chunked on its own)."""
    raw = b"".join(np.ascontiguousarray(p).tobytes() for p in pieces)
    digest = xxhash.xxh3_128(raw).hexdigest()
    dt = DTYPES[dtype]
    if dtype != "float32":
        if not dt.is_float:
            return TensorScan(digest, Precision.NOT_FLOAT, None)
        return TensorScan(digest, Precision.NATIVE_16 if dt.itemsize <= 2 else Precision.EXACT, None)
    per_chunk = max(1, chunk_bytes // 4)
    chunks = [p.reshape(-1)[lo:lo + per_chunk] for p in pieces for lo in range(0, p.size, per_chunk)]
    bf16 = fp16 = True
    info_bf16 = info_fp16 = 0
    for c in chunks:
        if not (bf16 or fp16):
            break
        u = c.view(np.uint32)
        bf16 = bf16 and not (u & 0xFFFF).any()
        fp16 = fp16 and not (u & 0x1FFF).any()
        if not (bf16 or fp16):
            continue
        if fp16 and not bf16:  # bf16 already failed: fp16 must hold its range too
            fp16 = fp16_exact(c)
        x = c.astype(np.float64)
        with np.errstate(invalid="ignore"):
            informative = np.isfinite(x) & (np.floor(x) != x)
        if bf16:
            info_bf16 += int(np.count_nonzero(informative & ((u & 0x000F0000) != 0)))
        if fp16:
            info_fp16 += int(np.count_nonzero(informative & ((u & 0x000FE000) != 0)))
    if fp16 and not bf16:  # every chunk, the ones seen before bf16 failed included
        fp16 = all(fp16_exact(c) for c in chunks)
    stats = PrecisionStats(bf16, fp16, min(info_bf16, INFORMATIVE_CAP), min(info_fp16, INFORMATIVE_CAP))
    return TensorScan(digest, classify(stats), stats)


def fp16_exact(x: np.ndarray) -> bool:
    """Every value converts to fp16 and back to the same fp32 bits (NaNs: any NaN stays a NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        back = x.astype(np.float16).astype(np.float32)
    same = back.view(np.uint32) == x.view(np.uint32)
    return bool((same | (np.isnan(x) & np.isnan(back))).all())


def write(tmp_path: Path, name: str, arr: np.ndarray) -> str:
    path = tmp_path / name
    path.write_bytes(b"\x7f" * 24 + np.ascontiguousarray(arr).tobytes())  # data at a non-zero offset
    return str(path)


def lazy(tmp_path: Path, arr: np.ndarray, dtype: str, split: int | None = None) -> tuple[TensorData, list[np.ndarray]]:
    """``arr`` as a lazy tensor of one piece, or of two row slabs in two files split at row ``split``."""
    slabs = [arr] if split is None else [arr[:split], arr[split:]]
    pieces = []
    row = 0
    for i, slab in enumerate(slabs):
        shape = slab.shape
        stride = tuple(int(np.prod(shape[k + 1:])) for k in range(len(shape)))
        offsets = (row,) + (0,) * (len(shape) - 1) if shape else ()
        pieces.append(Piece(write(tmp_path, f"{dtype}-{i}.bin", slab), 24, 0, shape, stride, offsets))
        row += shape[0] if shape else 0
    return TensorData(DTYPES[dtype], arr.shape, tuple(pieces)), slabs


def check(tmp_path: Path, arr: np.ndarray, dtype: str, chunk_bytes: int, buffer: np.ndarray,
          split: int | None = None) -> None:
    data, slabs = lazy(tmp_path, arr, dtype, split)
    want = reference_scan(slabs, dtype, chunk_bytes)
    with FileMaps() as maps:
        got = scan_tensor(data, maps, chunk_bytes, buffer if chunk_bytes == (1 << 20) else None)
        got_buffered = scan_tensor(data, maps, chunk_bytes, scratch_buffer(chunk_bytes))
    assert got == want, (dtype, arr.shape, chunk_bytes, split)
    assert got_buffered == want


def random_values(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    np_dt = np.dtype(DTYPES[dtype].numpy)
    raw = rng.integers(0, 256, n * np_dt.itemsize, dtype=np.uint8)
    if dtype == "bool":
        raw = raw & 1
    return raw.view(np_dt)


@pytest.fixture(scope="module")
def buffer() -> np.ndarray:
    return scratch_buffer(1 << 20)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_random_bytes_equal_the_reference(tmp_path: Path, dtype: str, buffer: np.ndarray) -> None:
    rng = np.random.default_rng(len(dtype))
    for n in (0, 1, 7, 300, 5000):
        arr = random_values(rng, dtype, n)
        for chunk_bytes in CHUNK_BYTES:
            check(tmp_path, arr, dtype, chunk_bytes, buffer)
        if n >= 300:
            check(tmp_path, arr.reshape(-1, 1 if n % 2 else 2), dtype, 64, buffer, split=n // 3)


def bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)


def crafted(rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = 3000
    g = (rng.standard_normal(n) * 0.02).astype(np.float32)
    out = {
        "genuine": g,
        "bf16": bf16(g),
        "fp16": g.astype(np.float16).astype(np.float32),
        "bf16 beyond fp16 range": bf16(g * np.float32(1e6)),
        "integers": np.arange(n, dtype=np.float32) - 7,
        "zeros and ones": np.tile(np.array([0.0, -0.0, 1.0, 0.5], np.float32), n // 4),
        "specials": np.tile(np.array([np.inf, -np.inf, np.nan, 0.0, 1e-45, 6e-8, 65504.0, 65520.0], np.float32),
                            n // 8),
        "fp16 subnormals": (rng.integers(1, 1024, n) * np.float32(2.0**-24)).astype(np.float32),
        "few informative": np.where(np.arange(n) % 997 == 0, bf16(g), np.float32(2.0)).astype(np.float32),
    }
    # One genuine value in a rounded tensor: inside the prefix, just after it, on a chunk edge, at the end.
    for at in (0, 255, 256, 257, 1023, 1024, 2047, n - 1):
        for base in ("bf16", "fp16"):
            t = out[base].copy()
            t[at] = np.float32(0.1234567)
            out[f"{base} with a genuine value at {at}"] = t
    # A bf16 tensor whose first chunks are also fp16-exact and whose later values are not.
    t = out["fp16"].copy()
    t[2500:] = bf16(g[2500:] * np.float32(1e6))
    out["fp16 then bf16 beyond range"] = t
    return out


def test_crafted_fp32_tensors_equal_the_reference(tmp_path: Path, buffer: np.ndarray) -> None:
    rng = np.random.default_rng(7)
    for name, arr in crafted(rng).items():
        for chunk_bytes in CHUNK_BYTES:
            check(tmp_path, arr, "float32", chunk_bytes, buffer)
        check(tmp_path, arr.reshape(-1, 4), "float32", 4096, buffer, split=123)
        assert name  # every case ran


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=600),
    low_mask=st.sampled_from([0xFFFFFFFF, 0xFFFF0000, 0xFFFFE000]),
    chunk_bytes=st.sampled_from(CHUNK_BYTES),
)
def test_random_fp32_bit_patterns_equal_the_reference(tmp_path: Path, buffer: np.ndarray, words: list[int],
                                                      low_mask: int, chunk_bytes: int) -> None:
    arr = (np.array(words, dtype=np.uint32) & np.uint32(low_mask)).view(np.float32)
    check(tmp_path, arr, "float32", chunk_bytes, buffer)


def test_threads_each_read_into_their_own_buffer(tmp_path: Path) -> None:
    """Many multi-chunk tensors on 4 threads: a buffer shared between threads would mix their chunks."""
    from safetensors.numpy import save_file

    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.scan import scan_items

    rng = np.random.default_rng(3)
    # 128 KiB each: over audit.BATCH_BYTES, so each tensor is its own unit of work, shared between the threads.
    tensors = {f"layer{i}.weight": (rng.standard_normal((64, 512)) * 0.02).astype(np.float32) for i in range(24)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    want = {name: xxhash.xxh3_128(arr.tobytes()).hexdigest() for name, arr in tensors.items()}
    plan = plan_scan(str(path))
    try:
        for _ in range(3):
            outcomes = scan_items(plan, plan.scannable(), jobs=4, chunk_bytes=4096)  # 32 chunks per tensor
            got = {plan.items[i][0].name.split("/")[-1]: o.scan.hash for i, o in outcomes.items() if o.scan}
            assert got == want
    finally:
        plan.close()
