"""The NumPy-free scan of small tensors (``auditing.tensor_scan.scan_small``, ``auditing.scan.scalar_value``, ``checks.updates.all_zero``) gives
the same result as the NumPy path, bit for bit: hash, effective precision and the precision evidence, on random
and crafted values of every dtype, in every layout the small path takes, and with chunks small enough that the
evidence is gathered over many chunks (the deferred fp16 recheck included).

Run: ``.venv/bin/python -m pytest -q tests/auditing/test_tensor_scan_small.py``
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from ckptaudit.auditing.scan import scalar_value
from ckptaudit.auditing.tensor_scan import SMALL_TENSOR_BYTES, TensorScan, _Budget, scan_small, scan_tensor
from ckptaudit.checks.updates import all_zero
from ckptaudit.formats.io.tensors import DTYPES, FileMaps, Piece, TensorData, iter_chunks


def _numpy_scan(data: TensorData, maps: FileMaps, chunk_bytes: int) -> TensorScan:
    # scan_tensor takes the NumPy path once NumPy is imported (it is, in this process).
    assert "numpy" in sys.modules
    return scan_tensor(data, maps, chunk_bytes)


def _tensor(tmp_path: Path, dtype: str, raw: bytes, shape: tuple[int, ...], pieces: int = 1,
            name: str = "t") -> TensorData:
    """``raw`` (row-major bytes of ``shape``) stored as ``pieces`` contiguous shards along dim 0, one file each,
    listed in reverse order (the reader sorts them), each at a different offset of its file."""
    dt = DTYPES[dtype]
    rows = shape[0] if shape else 1
    row_bytes = len(raw) // rows if rows else 0
    cuts = sorted({0, rows, *[rows * i // pieces for i in range(1, pieces)]}) if shape else [0, 1]
    out = []
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        path = tmp_path / f"{name}{i}.bin"
        pad = 16 * (i + 1)
        path.write_bytes(b"\xee" * pad + raw[lo * row_bytes : hi * row_bytes] + b"\xee" * 3)
        sizes = (hi - lo, *shape[1:]) if shape else ()
        stride = tuple(math.prod(sizes[j + 1:]) for j in range(len(sizes)))
        offsets = (lo, *[0] * (len(shape) - 1)) if shape else ()
        out.append(Piece(str(path), pad - dt.itemsize, 1, sizes, stride, offsets))  # storage_offset 1 element
    return TensorData(dt, shape, tuple(reversed(out)))


def _fp32_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(14)
    x = rng.standard_normal(700).astype(np.float32)
    bf16 = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    fp16 = x.astype(np.float16).astype(np.float32)
    subnormals = np.float16([3e-7, -5.9e-8, 1e-6, 6e-5]).astype(np.float32)
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.0, 0.5, 65504.0, 70000.0, 2.0**-26])
    late = fp16.copy()
    late[-1] = np.float32(0.1)  # bf16 and fp16 fail only in the last chunk
    bf16_then_fp16 = np.concatenate([bf16[:300], fp16[:300]])  # bf16 fails late: the deferred fp16 recheck
    # fp16 subnormals at the edge, for every exponent: the lowest mantissa bit fp16 keeps, then one below it.
    exps = np.arange(103, 113, dtype=np.uint32)
    edge_ok = ((exps << np.uint32(23)) | (np.uint32(1) << (np.uint32(126) - exps))).view(np.float32)
    edge_bad = ((exps << np.uint32(23)) | (np.uint32(1) << (np.uint32(125) - exps))).view(np.float32)
    beyond_fp16 = (np.float32([3.0e5, 1.5e-9, -7.7e4]).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    lowest_bf16_bit = np.float32([(1 + 2.0**-7) * 2.0**-k for k in range(1, 7)])  # only mantissa bit 16 set
    return {
        "fp16-subnormal-edges": np.concatenate([fp16[:20], edge_ok]),
        "fp16-subnormal-bit-too-low": np.concatenate([fp16[:20], edge_bad[:1]]),
        "fp16-subnormal-bit-too-low-last": np.concatenate([fp16[:20], edge_bad[-1:]]),
        "bf16-lowest-bit": lowest_bf16_bit,
        "bf16-beyond-fp16-then-fp16": np.concatenate([beyond_fp16, bf16[:40], fp16[:40]]),
        "genuine": x,
        "bf16": bf16,
        "bf16-three-values": bf16[:3],
        "fp16": fp16,
        "fp16-subnormals": np.concatenate([fp16[:50], subnormals]),
        "fp16-out-of-range": np.concatenate([fp16[:50], np.float32([70000.0])]),
        "fp16-below-subnormal": np.concatenate([fp16[:50], np.float32([2.0**-26])]),
        "specials": specials,
        "bf16-with-specials": np.concatenate([bf16[:40], specials]),
        "zeros": np.zeros(600, np.float32),
        "integers": np.arange(-300, 300, dtype=np.float32),
        "late-exact": late,
        "bf16-then-fp16": bf16_then_fp16,
        "fp16-then-bf16": np.concatenate([fp16[:300], bf16[:300]]),
        "random-bits": rng.integers(0, 2**32, 500, dtype=np.uint32).view(np.float32),
        "bf16-random-bits": (rng.integers(0, 2**32, 500, dtype=np.uint32) & np.uint32(0xFFFF0000)).view(np.float32),
        "fp16-random-bits": rng.integers(0, 2**16, 500, dtype=np.uint16).view(np.float16).astype(np.float32),
        "scalar": np.float32([0.1]),
    }


@pytest.mark.parametrize("case", sorted(_fp32_cases()))
def test_fp32_small_scan_equals_the_numpy_scan(tmp_path: Path, case: str) -> None:
    values = _fp32_cases()[case]
    raw = values.astype("<f4").tobytes()
    seen = set()
    with FileMaps() as maps:
        for shape, pieces in (((values.size,), 1), ((values.size,), 3), ((values.size, 1), 2)):
            data = _tensor(tmp_path, "float32", raw, shape, pieces, name=f"{len(shape)}-{pieces}-")
            for chunk_bytes in (4, 12, 64, 1000, 1 << 20):
                ours = scan_small(data, maps, chunk_bytes)
                assert ours is not None, (case, shape, pieces)
                assert ours == _numpy_scan(data, maps, chunk_bytes), (case, shape, pieces, chunk_bytes)
                seen.add(ours.precision)
    assert len(seen) == 1, seen  # the layout never changes the verdict


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_small_scan_equals_the_numpy_scan(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    itemsize = DTYPES[dtype].itemsize
    with FileMaps() as maps:
        for n in (1, 7, 300):
            raw = rng.integers(0, 256, n * itemsize, dtype=np.uint8).tobytes()
            for shape, pieces in (((n,), 1), ((n,), 2), ((), 1)):
                if shape == () and n != 1:
                    continue
                data = _tensor(tmp_path, dtype, raw, shape, pieces, name=f"{dtype}-{n}-{pieces}-{len(shape)}-")
                for chunk_bytes in (16, 1 << 20):
                    ours = scan_small(data, maps, chunk_bytes)
                    assert ours is not None
                    assert ours == _numpy_scan(data, maps, chunk_bytes), (dtype, n, shape, pieces)


def test_small_scan_declines_what_it_does_not_cover(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4) + np.float32(0.1)
    path = tmp_path / "t.bin"
    path.write_bytes(np.ascontiguousarray(a.T).tobytes())
    strided = TensorData(DTYPES["float32"], (3, 4), (Piece(str(path), 0, 0, (3, 4), (1, 3), (0, 0)),))
    big = _tensor(tmp_path, "float32", np.zeros(SMALL_TENSOR_BYTES // 4 + 1, np.float32).tobytes(),
                  (SMALL_TENSOR_BYTES // 4 + 1,), name="big")
    small = _tensor(tmp_path, "float32", a.tobytes(), (3, 4), name="small")
    b0, b1 = tmp_path / "b0.bin", tmp_path / "b1.bin"
    b0.write_bytes(np.ascontiguousarray(a[:, :2]).tobytes())
    b1.write_bytes(np.ascontiguousarray(a[:, 2:]).tobytes())
    blocks = TensorData(DTYPES["float32"], (3, 4), (
        Piece(str(b0), 0, 0, (3, 2), (2, 1), (0, 0)), Piece(str(b1), 0, 0, (3, 2), (2, 1), (0, 2))))
    budget = _Budget(48)
    with FileMaps() as maps:
        assert scan_small(strided, maps) is None
        assert scan_small(blocks, maps) is None
        assert scan_small(big, maps) is None
        assert scan_small(small, maps, budget=budget) == _numpy_scan(small, maps, 1 << 20)
        assert scan_small(small, maps, budget=budget) is None  # 48 bytes drawn: the budget is spent
        # What it declines, scan_tensor still scans (the NumPy path), with the same hash for the same values.
        assert scan_tensor(strided, maps).hash == scan_tensor(small, maps).hash


def test_small_scan_errors_are_the_numpy_scan_errors(tmp_path: Path) -> None:
    data = _tensor(tmp_path, "float32", np.ones(8, np.float32).tobytes(), (8,))
    truncated = TensorData(data.dtype, (9,), (Piece(data.pieces[0].file, data.pieces[0].data_offset, 1, (9,), (1,),
                                                    (0,)),))
    uncovered = TensorData(data.dtype, (16,), data.pieces)
    with FileMaps() as maps:
        for bad in (truncated, uncovered):
            with pytest.raises(ValueError) as numpy_error:
                _numpy_scan(bad, maps, 1 << 20)
            with pytest.raises(ValueError) as small_error:
                scan_small(bad, maps)
            assert str(small_error.value) == str(numpy_error.value)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_scalar_value_and_all_zero_without_numpy_equal_numpy(tmp_path: Path, dtype: str) -> None:
    dt = DTYPES[dtype]
    if dt.numpy.startswith("<c"):
        pytest.skip("complex step counters are read through NumPy, as before")
    rng = np.random.default_rng(7)
    raws = [bytes(dt.itemsize), rng.integers(0, 256, dt.itemsize, dtype=np.uint8).tobytes(),
            np.ones(1, dt.numpy).tobytes()]
    with FileMaps() as maps:
        for i, raw in enumerate(raws):
            data = _tensor(tmp_path, dtype, raw, (1,), name=f"s{dtype}{i}")
            chunk = next(iter(iter_chunks(data, maps)))
            if dtype == "bfloat16":
                expected: float | None = float(np.array([int(chunk[0]) << 16], np.uint32).view(np.float32)[0])
            elif dt.numpy.startswith("u") and dt.is_float:
                expected = None
            else:
                expected = float(chunk[0])
            got = scalar_value(data, maps)
            assert got == expected or (got is not None and expected is not None and math.isnan(got)
                                       and math.isnan(expected)), (dtype, raw, got, expected)
            assert all_zero(data, maps) is (not any(raw))


# -- NumPy objects in pickles: the unpickler's NumPy entries are made when a pickle first names NumPy ---------------

def test_numpy_objects_in_pickles_are_rebuilt_on_demand(tmp_path: Path) -> None:
    import io
    import pickle

    import torch

    from ckptaudit.formats import open_checkpoint
    from ckptaudit.formats.pickle.scan import UnsafeGlobalError
    from ckptaudit.formats.pickle.unpickler import RestrictedUnpickler, base_table

    state = np.random.RandomState(0).get_state()
    arr = np.arange(5, dtype=np.int16)
    for proto in (2, 5):
        loaded = RestrictedUnpickler(io.BytesIO(pickle.dumps((state, arr), protocol=proto)), base_table()).load()
        assert loaded[0][0] == state[0] and loaded[0][2:] == state[2:]
        assert loaded[0][1].dtype == state[1].dtype and np.array_equal(loaded[0][1], state[1])
        assert loaded[1].dtype == arr.dtype and np.array_equal(loaded[1], arr)
    # Only a table that asked for NumPy (base_table) gets it: a table without it still refuses NumPy globals.
    with pytest.raises(UnsafeGlobalError):
        RestrictedUnpickler(io.BytesIO(pickle.dumps(arr, protocol=2)), {}).load()
    # A torch.save file holding an RNG state: read whole, the arrays real, nothing reported as unloaded.
    torch.save({"w": torch.ones(2), "rng_state": {"numpy": state, "v": arr}}, tmp_path / "c.pt")
    ckpt = open_checkpoint(str(tmp_path / "c.pt"))
    tree = ckpt.parts[0].tree
    assert np.array_equal(tree["rng_state"]["numpy"][1], state[1]) and np.array_equal(tree["rng_state"]["v"], arr)
    assert ckpt.findings == []
