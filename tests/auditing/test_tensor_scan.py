"""Effective precision and hashing: the bit tricks, the false-positive bound, and layout independence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ckptaudit.auditing.tensor_scan import MIN_INFORMATIVE, scan_tensor
from ckptaudit.findings import Precision
from ckptaudit.formats.io.tensors import DTYPES, FileMaps, Piece, TensorData


def fp32_tensor(tmp_path: Path, values: np.ndarray, name: str = "t.bin") -> TensorData:
    path = tmp_path / name
    arr = np.ascontiguousarray(values, dtype="<f4")
    path.write_bytes(arr.tobytes())
    shape = arr.shape
    stride = tuple(s // 4 for s in arr.strides)
    piece = Piece(str(path), 0, 0, shape, stride, (0,) * len(shape))
    return TensorData(DTYPES["float32"], shape, (piece,))


def precision_of(tmp_path: Path, values: np.ndarray, chunk_bytes: int = 1 << 20) -> Precision:
    with FileMaps() as maps:
        return scan_tensor(fp32_tensor(tmp_path, values), maps, chunk_bytes).precision


def bf16_round(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def test_uninformative_tensors_never_alarm(tmp_path: Path) -> None:
    assert precision_of(tmp_path, np.zeros(4096, np.float32)) is Precision.INCONCLUSIVE
    assert precision_of(tmp_path, np.ones(768, np.float32)) is Precision.INCONCLUSIVE  # fresh LayerNorm weight
    assert precision_of(tmp_path, np.arange(1000, dtype=np.float32)) is Precision.INCONCLUSIVE  # integers
    assert precision_of(tmp_path, np.array([0.5, -0.25, 1.5, 3.0], np.float32)) is Precision.INCONCLUSIVE


def test_genuine_fp32_small_tensors_do_not_alarm(tmp_path: Path) -> None:
    # The false-positive bound in practice: many 4-element fp32 biases, none called rounded.
    rng = np.random.default_rng(0)
    data = rng.standard_normal((20_000, MIN_INFORMATIVE)).astype(np.float32) * 0.02
    with FileMaps() as maps:
        td = fp32_tensor(tmp_path, data)
        # Each row is a tensor: scan rows as separate 4-element tensors through the same code path.
        flagged = 0
        for i in range(0, 20_000, 997):
            row = TensorData(td.dtype, (MIN_INFORMATIVE,), (Piece(td.pieces[0].file, i * 16, 0, (4,), (1,), (0,)),))
            flagged += scan_tensor(row, maps).precision is not Precision.EXACT
    assert flagged == 0


def test_bf16_rounded_small_bias_is_caught_but_three_values_are_not_enough(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    bias = bf16_round(rng.standard_normal(4).astype(np.float32) * 0.02 + 0.013)
    assert precision_of(tmp_path, bias) is Precision.BF16
    assert precision_of(tmp_path, bias[:3]) is Precision.INCONCLUSIVE


def test_rounded_matrix_is_bf16_and_one_extra_bit_makes_it_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    w = bf16_round(rng.standard_normal((300, 700)).astype(np.float32))
    assert precision_of(tmp_path, w, chunk_bytes=4096) is Precision.BF16
    bits = w.view(np.uint32).copy()
    bits[299, 699] |= 1  # one value in the last chunk needs the low bits
    assert precision_of(tmp_path, bits.view(np.float32), chunk_bytes=4096) is Precision.EXACT


def test_fp16_rounding_including_subnormals_and_range(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(np.float32)
    halves = x.astype(np.float16).astype(np.float32)
    assert precision_of(tmp_path, halves) is Precision.FP16
    sub = np.concatenate([halves, np.float16([3e-7, -5.9e-8, 1e-6]).astype(np.float32)])  # fp16 subnormals
    assert precision_of(tmp_path, sub) is Precision.FP16
    too_big = np.concatenate([halves, np.float32([70000.0])])  # out of fp16 range (bf16-exact? no: 70000 needs bits)
    assert precision_of(tmp_path, too_big) is Precision.EXACT
    too_small = np.concatenate([halves, np.float32([2.0**-26])])  # below fp16's smallest subnormal
    assert precision_of(tmp_path, too_small) is not Precision.FP16


def test_hash_is_the_same_for_any_layout_of_the_same_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    a = rng.standard_normal((6, 5)).astype(np.float32)
    contiguous = fp32_tensor(tmp_path, a, "c.bin")
    # The same logical tensor stored transposed (column-major storage, strided view).
    tpath = tmp_path / "t.bin"
    tpath.write_bytes(np.ascontiguousarray(a.T).tobytes())
    strided = TensorData(DTYPES["float32"], (6, 5), (Piece(str(tpath), 0, 0, (6, 5), (1, 6), (0, 0)),))
    # Two shards along dim 0 in two files (FSDP2's layout), and a 2-D block split.
    s0, s1 = tmp_path / "s0.bin", tmp_path / "s1.bin"
    s0.write_bytes(a[:3].tobytes())
    s1.write_bytes(a[3:].tobytes())
    sharded = TensorData(DTYPES["float32"], (6, 5), (
        Piece(str(s1), 0, 0, (3, 5), (5, 1), (3, 0)), Piece(str(s0), 0, 0, (3, 5), (5, 1), (0, 0))))
    b0, b1 = tmp_path / "b0.bin", tmp_path / "b1.bin"
    b0.write_bytes(np.ascontiguousarray(a[:, :2]).tobytes())
    b1.write_bytes(np.ascontiguousarray(a[:, 2:]).tobytes())
    blocks = TensorData(DTYPES["float32"], (6, 5), (
        Piece(str(b0), 0, 0, (6, 2), (2, 1), (0, 0)), Piece(str(b1), 0, 0, (6, 3), (3, 1), (0, 2))))
    with FileMaps() as maps:
        hashes = {scan_tensor(td, maps, chunk_bytes=16).hash for td in (contiguous, strided, sharded, blocks)}
    assert len(hashes) == 1


def test_shards_that_do_not_cover_the_tensor_are_an_error(tmp_path: Path) -> None:
    a = np.ones((4, 4), np.float32)
    td = fp32_tensor(tmp_path, a[:2])
    bad = TensorData(td.dtype, (4, 4), (Piece(td.pieces[0].file, 0, 0, (2, 4), (4, 1), (0, 0)),))
    with FileMaps() as maps, pytest.raises(ValueError, match="shards hold 8 elements, the tensor has 16"):
        scan_tensor(bad, maps)


def test_wrapper_segments_are_stripped_as_whole_components() -> None:
    from ckptaudit.layouts import normalize_fqn

    assert normalize_fqn("module._orig_mod.blocks.0.attn.weight") == "blocks.0.attn.weight"
    assert normalize_fqn("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.mlp.weight") == "blocks.0.mlp.weight"
    assert normalize_fqn("blocks.0._checkpoint_wrapped_module.mlp.weight") == "blocks.0.mlp.weight"
    # A submodule the user named "module" is not a wrapper.
    assert normalize_fqn("encoder.module.weight") == "encoder.module.weight"


def test_a_file_cut_short_after_it_was_opened_gives_the_short_read_message(tmp_path: Path) -> None:
    """A ``torch.save`` file truncated once the scan's descriptor is open (before, the scan's open finds another
    version: ``integrity.changed``, tests/auditing/test_file_versions.py): each tensor past the end is an error
    with the message of :func:`~ckptaudit.formats.io.tensors.iter_chunks` (one whole contiguous tensor is read by
    the scan's own loop, which must say the same), never bytes hashed from beyond the end."""
    import os

    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.scan import scan_items
    from ckptaudit.formats.io.tensors import iter_chunks

    path = tmp_path / "cut.pt"
    torch.save({"a": torch.randn(64, 1024), "b": torch.randn(64, 1024), "c": torch.randn(64, 1024)}, path)
    plan = plan_scan(str(path))
    try:
        plan.ckpt.maps.fd(str(path))  # the scan's one descriptor of the file, opened as its first tensor does
        os.truncate(path, os.path.getsize(path) // 2)
        outcomes = scan_items(plan, plan.scannable(), jobs=1, chunk_bytes=16 << 10)
        errors = {i: o.error for i, o in outcomes.items() if o.scan is None}
        assert errors and len(errors) < len(outcomes)  # the first tensor still reads whole
        for i, error in errors.items():
            assert "the file ends early (truncated, or changed while being read)" in error
            with pytest.raises(ValueError) as exc:
                for _ in iter_chunks(plan.items[i][0].data, plan.ckpt.maps, 16 << 10):
                    pass
            assert error == str(exc.value)
    finally:
        plan.close()


def test_each_record_names_its_data_file_relative_to_the_checkpoint(tmp_path: Path) -> None:
    """The report's ``file`` of a tensor: the file's base name for a single-file checkpoint, its path under the
    checkpoint's directory otherwise (a run directory of DCP step directories), never a path of this machine."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from ckptaudit.auditing.judge import run_audit

    single = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.randn(8, 4)}}, single)
    assert {t.file for t in run_audit(str(single)).tensors} == {"ckpt.pt"}
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: a single-process save
        for step in (2, 6):
            dcp.save({"model": {"w": torch.randn(8, 4), "b": torch.randn(4)}}, checkpoint_id=str(run / f"step-{step}"))
    tensors = run_audit(str(run)).tensors
    assert tensors and {t.name.split("/")[0] for t in tensors} <= {"step-2", "step-6"}, [t.name for t in tensors]
    for t in tensors:
        assert t.file == f"{t.name.split('/')[0]}/__0_0.distcp", (t.name, t.file)
    assert {t.file for t in run_audit(str(run / "step-2")).tensors} == {"__0_0.distcp"}
