"""Region hashes: a rank's region hashes the same whether cut from a live tensor or streamed from saved pieces."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.io.tensors import DTYPES, FileMaps, Piece, TensorData
from ckptaudit.probe.regions import Region, combine, hash_saved_region, hash_tensor_region
from ckptaudit.probe.wrappers import clean_fqn


def _oracle(t: torch.Tensor, region: Region) -> str:
    """xxh3-128 of the region's elements, computed the obvious way (a copy of the slice)."""
    if region.flat is not None:
        part = t.reshape(-1)[region.flat[0] : region.flat[1]]
    else:
        part = t[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes, strict=True))]
    return xxhash.xxh3_128(part.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@st.composite
def tensor_pieces_region(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[int, int]], list[tuple[int, int]],
                                                   Region]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))

    def cuts(n: int) -> list[tuple[int, int]]:
        points = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=2))) - {n})
        bounds = [0, *points, n]
        return [(a, b - a) for a, b in itertools.pairwise(bounds) if b > a]

    rows = cuts(shape[0])
    cols = cuts(shape[1]) if ndim > 1 else [(0, 1)]
    if draw(st.booleans()):
        total = math.prod(shape)
        lo = draw(st.integers(0, total))
        hi = draw(st.integers(lo, total))
        region = Region(flat=(lo, hi))
    else:
        offsets, sizes = [], []
        for n in shape:
            o = draw(st.integers(0, n))
            offsets.append(o)
            sizes.append(draw(st.integers(0, n - o)))
        region = Region(tuple(offsets), tuple(sizes))
    return shape, rows, cols, region


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tensor_pieces_region(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_saved_pieces_and_live_tensor_hash_alike(tmp_path: Path, case: tuple, dtype: torch.dtype) -> None:
    shape, rows, cols, region = case
    full = torch.randn(shape).to(dtype)
    # Store the tensor as a grid of pieces (row blocks x column blocks), each contiguous in its own file region,
    # the way DCP stores shards; the probe must reassemble any region from them.
    path = tmp_path / f"pieces-{abs(hash((shape, tuple(rows), tuple(cols))))}.bin"
    pieces = []
    with open(path, "wb") as fh:
        for r0, nr in rows:
            for c0, nc in cols:
                block = full[r0 : r0 + nr] if len(shape) == 1 else full[r0 : r0 + nr, c0 : c0 + nc]
                raw = block.contiguous().view(torch.uint8).numpy().tobytes()
                offset = fh.tell()
                fh.write(raw)
                sizes = tuple(block.shape)
                stride = tuple(int(s) for s in block.contiguous().stride())
                offs = (r0,) if len(shape) == 1 else (r0, c0, *([0] * (len(shape) - 2)))
                pieces.append(Piece(str(path), offset, 0, sizes, stride, offs))
    data = TensorData(DTYPES[str(dtype).removeprefix("torch.")], shape, tuple(pieces))
    expected = _oracle(full, region)
    assert hash_tensor_region(full, region) == expected
    with FileMaps() as maps:
        assert hash_saved_region(data, maps, region, chunk_bytes=16) == expected
        assert hash_saved_region(data, maps, region) == expected


def test_whole_region_hash_is_the_audit_hash(tmp_path: Path) -> None:
    from ckptaudit.auditing.tensor_scan import scan_tensor

    t = torch.randn(5, 3)
    torch.save({"w": t}, tmp_path / "w.pt")
    with open_checkpoint(str(tmp_path / "w.pt")) as ckpt:
        data = ckpt.parts[0].tree["w"]
        whole = Region.whole(t.shape)
        assert hash_saved_region(data, ckpt.maps, whole) == scan_tensor(data, ckpt.maps).hash
        assert hash_tensor_region(t) == scan_tensor(data, ckpt.maps).hash
        assert Region(flat=(0, 15)).is_whole(t.shape)


def test_casts_hash_the_cast_values() -> None:
    t = torch.randn(300, 7)
    region = Region((100, 2), (150, 4))
    sub = t[100:250, 2:6]
    bf16 = sub.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    assert hash_tensor_region(t, region, cast=torch.bfloat16, chunk_bytes=64) == xxhash.xxh3_128(bf16).hexdigest()
    back = sub.to(torch.bfloat16).float().contiguous().view(torch.uint8).numpy().tobytes()
    assert hash_tensor_region(t, region, via=torch.bfloat16, cast=torch.float32) == xxhash.xxh3_128(back).hexdigest()
    assert hash_tensor_region(t, region, via=torch.bfloat16, cast=torch.float32) != hash_tensor_region(t, region)


def test_region_checks_and_combined_hash() -> None:
    with FileMaps() as maps:
        data = TensorData(DTYPES["float32"], (4, 4), ())
        with pytest.raises(ValueError, match="exceeds shape"):
            hash_saved_region(data, maps, Region((2, 0), (3, 4)), chunk_bytes=16)
        with pytest.raises(ValueError, match="outside a tensor of 16 elements"):
            hash_saved_region(data, maps, Region(flat=(3, 17)))
    a, b = xxhash.xxh3_128(b"a").hexdigest(), xxhash.xxh3_128(b"b").hexdigest()
    assert combine([a, b]) != combine([b, a])
    assert combine([a, b]) == xxhash.xxh3_128(bytes.fromhex(a) + bytes.fromhex(b)).hexdigest()
    assert np.dtype(DTYPES["bfloat16"].numpy).itemsize == 2


@pytest.mark.parametrize(("raw", "clean"), [
    ("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn.qkv.weight", "blocks.0.attn.qkv.weight"),
    ("module.tok_emb.weight", "tok_emb.weight"),
    ("_orig_mod.module.head.weight", "head.weight"),
    ("encoder.module.weight", "encoder.module.weight"),  # a submodule named "module" keeps its name
    ("blocks.1._checkpoint_wrapped_module.mlp.fc.bias", "blocks.1.mlp.fc.bias"),
])
def test_wrapper_segments_are_removed_from_names(raw: str, clean: str) -> None:
    assert clean_fqn(raw) == clean
