"""The element-wise classifier on synthetic tensors: which rounding made the candidate, and how far apart two
tensors are. Pure unit tests (NumPy + torch's own conversions as the ground truth), no files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptaudit.comparing.elementwise import compare_streams, paired_chunks
from ckptaudit.formats.io.tensors import DTYPES


def raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as ``iter_chunks`` yields them (bf16 as its uint16 bit patterns)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def classify(ref: torch.Tensor, cand: torch.Tensor, ref_chunk: int = 1000, cand_chunk: int = 777) -> object:
    """Stream both sides in differently sized chunks, as two differently sharded checkpoints would be."""
    r, c = raw(ref), raw(cand)
    rd, cd = DTYPES[str(ref.dtype).removeprefix("torch.")], DTYPES[str(cand.dtype).removeprefix("torch.")]

    def chunks(a: np.ndarray, n: int) -> list[np.ndarray]:
        return [a[i : i + n] for i in range(0, len(a), n)]

    status, rounding, stats = compare_streams(
        lambda: paired_chunks(chunks(r, ref_chunk), chunks(c, cand_chunk)), rd, cd)
    return stats if stats is not None else (status, rounding)


def weights(n: int = 20_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 0.02


def truncate_bf16(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.int32) & ~0xFFFF).view(torch.float32)


def test_round_to_nearest_even_is_told_from_truncation() -> None:
    w = weights()
    rne, rtz = w.bfloat16().float(), truncate_bf16(w)
    # The two rules disagree on about half the elements, so only one can fit each candidate.
    assert 0.3 < (rne != rtz).float().mean().item() < 0.7
    assert classify(w, rne) == ("bf16-rounded", "round-to-nearest-even")
    assert classify(w, rtz) == ("bf16-rounded", "round-toward-zero")
    # Stored as bf16 rather than widened back to fp32: the same answers.
    assert classify(w, w.bfloat16()) == ("bf16-rounded", "round-to-nearest-even")
    assert classify(w, rtz.bfloat16()) == ("bf16-rounded", "round-toward-zero")


def test_ties_round_to_even_and_a_truncation_of_them_is_not_rne() -> None:
    # Values exactly half-way between two bf16 numbers: RNE goes to the even neighbour, up or down.
    base = torch.tensor([1.0, 1.0078125, 3.0, -5.0, 0.015625] * 50).view(torch.int32)
    ties = (base | 0x8000).view(torch.float32)
    rne = ties.bfloat16().float()
    assert torch.equal(rne.view(torch.int32) & 0xFFFF, torch.zeros_like(base))
    assert classify(ties, rne) == ("bf16-rounded", "round-to-nearest-even")
    rtz = truncate_bf16(ties)
    assert not torch.equal(rne, rtz)
    assert classify(ties, rtz) == ("bf16-rounded", "round-toward-zero")


def test_other_rounding_to_a_neighbour_is_stochastic_or_other() -> None:
    w = weights(seed=1)
    g = torch.Generator().manual_seed(2)
    down = truncate_bf16(w)
    up = (down.view(torch.int32) + 0x10000).view(torch.float32)  # next bf16 value away from zero
    inexact = (w.view(torch.int32) & 0xFFFF) != 0
    pick = torch.rand(w.shape, generator=g) < 0.5
    stochastic = torch.where(pick & inexact, up, down)
    assert classify(w, stochastic) == ("bf16-rounded", "stochastic-or-other")
    # One element two bf16 steps away: no rounding explains it any more.
    bad = stochastic.clone()
    bad[123] = (down[123].view(torch.int32) + 0x20000).view(torch.float32)
    result = classify(w, bad)
    assert result.__class__.__name__ == "DiffStats"


def test_fp16_rounding_modes() -> None:
    w = weights(seed=3)
    rne = w.half()
    assert classify(w, rne) == ("fp16-rounded", "round-to-nearest-even")
    assert classify(w, rne.float()) == ("fp16-rounded", "round-to-nearest-even")
    # Truncation toward zero: one fp16 step back where RNE rounded away from zero.
    away = rne.float().abs() > w.abs()
    rtz = (rne.view(torch.int16) - away.to(torch.int16)).view(torch.float16)
    assert classify(w, rtz) == ("fp16-rounded", "round-toward-zero")
    assert classify(w, rtz.float()) == ("fp16-rounded", "round-toward-zero")


def test_equal_identical_and_special_values() -> None:
    w = weights(seed=4)
    w[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0])
    assert classify(w, w.clone()) == ("identical", None)
    # -0.0 vs 0.0: equal values, not the same bits (the content hash would differ too).
    flipped = w.clone()
    flipped[2] = 0.0
    assert classify(w, flipped) == ("equal-values", None)
    # bf16-valued fp32 against the same values stored as bf16: equal values, another dtype.
    b = w.bfloat16()
    assert classify(b.float(), b) == ("equal-values", None)
    # NaN stays NaN under rounding.
    assert classify(w, w.bfloat16().float()) == ("bf16-rounded", "round-to-nearest-even")


def test_difference_statistics_are_exact_on_a_crafted_pair() -> None:
    ref = torch.tensor([1.0, 2.0, 4.0, 8.0] * 100)
    cand = ref.clone()
    cand[1] = torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)) + 2 * 2.0**-22  # 3 ULPs of fp32 at 2.0
    cand[7] = 9.0
    stats = classify(ref, cand)
    assert stats.__class__.__name__ == "DiffStats"
    assert stats.numel == 400 and stats.differ == 2
    assert stats.fraction == pytest.approx(2 / 400)
    assert stats.max_abs == pytest.approx(1.0)
    # 9 - 8 = 1.0 is 2**20 ULPs of fp32 at 8.0 (spacing 2**-20).
    assert stats.max_ulp == pytest.approx(2.0**20)
    norm = np.sqrt(np.sum(ref.double().numpy() ** 2))
    assert stats.rel_l2 == pytest.approx(np.sqrt(1.0 + (3 * 2.0**-22) ** 2) / norm)


def test_integer_tensors_compare_by_value() -> None:
    a = torch.arange(1000, dtype=torch.int64)
    assert classify(a, a.to(torch.int32)) == ("equal-values", None)
    b = a.clone()
    b[10] += 5
    stats = classify(a, b)
    assert stats.differ == 1 and stats.max_abs == 5.0 and stats.max_ulp is None


def test_paired_chunks_realigns_any_chunking_and_rejects_unequal_lengths() -> None:
    a = np.arange(100)
    left = [a[:7], a[7:8], a[8:50], a[50:]]
    right = [a[:33], a[33:34], a[34:99], a[99:]]
    got = list(paired_chunks(left, right))
    assert all(len(x) == len(y) and np.array_equal(x, y) for x, y in got)
    assert np.array_equal(np.concatenate([x for x, _ in got]), a)
    with pytest.raises(ValueError, match="different numbers of elements"):
        list(paired_chunks([a], [a[:99]]))


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=2**31 - 1), st.integers(min_value=-30, max_value=30))
def test_torch_bf16_conversion_is_always_recognised_as_nearest_even(seed: int, scale: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3000, generator=g) * 2.0**scale
    verdict = classify(w, w.bfloat16(), ref_chunk=512, cand_chunk=300)
    # RNE always fits; for tensors this large, truncation never does by chance.
    assert verdict == ("bf16-rounded", "round-to-nearest-even")
    assert classify(w, truncate_bf16(w).bfloat16()) == ("bf16-rounded", "round-toward-zero")


def test_a_hypothesis_skipped_while_a_preferred_one_held_is_tested_again() -> None:
    # The first chunk is equal (small integers are exact in every format), so the rounding rules are not
    # tested on it; when equality fails in a later chunk, the pass restarts and tests them from the start.
    w = weights(seed=5)
    w[:1000] = torch.arange(1000, dtype=torch.float32) % 7
    assert classify(w, w.bfloat16().float()) == ("bf16-rounded", "round-to-nearest-even")
    assert classify(w, w.half()) == ("fp16-rounded", "round-to-nearest-even")
    # Rounded in the first chunk only, different afterwards: nothing fits, and the statistics say where.
    bad = w.bfloat16().float()
    bad[5000:] += 1.0
    stats = classify(w, bad)
    assert stats.differ >= len(w) - 5000 and stats.max_abs == pytest.approx(1.0, rel=1e-2)
