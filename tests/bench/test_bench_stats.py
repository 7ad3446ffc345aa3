"""The benchmarks' paired statistics (bench/pairstats.py) on synthetic data whose answer is known: the t
quantiles, ABBA blocks cancelling a linear drift, the interval's coverage, and a verdict that widens with the
noise instead of claiming what it cannot see. No timing."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
from pairstats import abba_overheads, mean_ci, rounds_needed, t_cdf, t_quantile, verdict


@pytest.mark.parametrize(("df", "q975"), [(1, 12.7062), (2, 4.3027), (5, 2.5706), (10, 2.2281), (30, 2.0423),
                                          (120, 1.9799), (1e6, 1.9600)])
def test_t_quantiles_match_the_tables(df: float, q975: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=1e-4)
    assert t_quantile(0.025, df) == pytest.approx(-q975, abs=1e-4)
    assert t_cdf(t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-9)


def test_abba_cancels_a_linear_drift_exactly() -> None:
    # the machine slows down linearly (0.5% per segment); B costs 30 ms more than A's 1.000 s
    blocks, order, t = [], [], 0
    for i in range(6):
        kind = "ABBA" if i % 2 == 0 else "BAAB"
        times = []
        for k in kind:
            times.append(1.0 * (1 + 0.005 * t) + (0.03 * (1 + 0.005 * t) if k == "B" else 0.0))
            t += 1
        blocks.append(tuple(times))
        order.append(kind)
    assert abba_overheads(blocks, order) == pytest.approx([0.03] * 6, abs=1e-12)  # type: ignore[arg-type]
    # the naive ratio of the pair (A then B) would see the drift as overhead
    assert blocks[0][1] / blocks[0][0] - 1 > 0.035


def test_the_interval_covers_the_true_mean_95_percent_of_the_time() -> None:
    rng = random.Random(13)
    true, hits, trials = 0.004, 0, 2000
    for _ in range(trials):
        ci = mean_ci([rng.gauss(true, 0.02) for _ in range(8)])
        hits += ci.low <= true <= ci.high
    assert 0.93 <= hits / trials <= 0.97


def test_more_noise_widens_the_interval_and_the_verdict_never_claims_below_target() -> None:
    rng = random.Random(7)
    base = [rng.gauss(0.0, 1.0) for _ in range(40)]
    quiet = mean_ci([0.002 + 0.001 * z for z in base])
    loaded = mean_ci([0.002 + 0.06 * z for z in base])
    assert quiet.half_width < 0.005 < loaded.half_width
    assert loaded.half_width == pytest.approx(60 * quiet.half_width, rel=1e-9)
    assert verdict(quiet).startswith("overhead < 1% (95% CI [")
    said = verdict(loaded)
    assert said.startswith("cannot resolve 1% with this noise (95% CI [") and "run with --rounds" in said
    need = rounds_needed(loaded, 0.01)
    assert need is not None and need > loaded.n
    # an overhead truly above the target is said to be above it
    assert verdict(mean_ci([0.05 + 0.001 * z for z in base])).startswith("overhead > 1%")


def test_a_mean_on_the_target_is_not_promised_a_resolution() -> None:
    ci = mean_ci([0.01 + d for d in (-0.02, 0.02, -0.01, 0.01)])
    assert rounds_needed(ci, 0.01) is None
    assert "more rounds will not resolve it" in verdict(ci)


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="at least 2 paired differences"):
        mean_ci([0.1])
    with pytest.raises(ValueError, match="'ABBA' or 'BAAB'"):
        abba_overheads([(1.0, 1.0, 1.0, 1.0)], ["ABAB"])


def test_write_docs_replaces_only_the_marked_figures_and_refuses_a_file_without_markers(tmp_path: Path) -> None:
    from bench_guard import MARKERS, shown_args, write_docs

    begin, end = MARKERS["figures"]
    doc = tmp_path / "index.md"
    doc.write_text(f"# Guards\n\nbefore\n{begin}\nold figures\n{end}\nafter\n")
    write_docs([str(doc)], {"figures": "new figures", "sentence": "unused"})
    write_docs([str(doc)], {"figures": "newer figures", "sentence": "unused"})  # idempotent shape
    assert doc.read_text() == f"# Guards\n\nbefore\n{begin}\nnewer figures\n{end}\nafter\n"
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(SystemExit) as exc:
        write_docs([str(bare)], {"figures": "x", "sentence": "y"})
    assert exc.value.code == 2 and bare.read_text() == "no markers\n"
    assert shown_args(["--rounds", "9", "--write-docs", "a.md", "README.md", "--quick"]) == ["--rounds", "9", "--quick"]
