"""The order-consistent assignment of index-keyed optimizer state to a model's parameters.

Unit cases for :func:`assign_by_order` (unique, ambiguous, none, skipped buffers, Trainer's decay / no-decay
split), a property test against brute-force enumeration, and a real ``torch.optim.Adafactor`` checkpoint whose
factored statistics must not be mistaken for moments of another shape.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from ckptaudit.auditing.judge import run_audit
from ckptaudit.layouts import attachment as optcheck
from ckptaudit.layouts.attachment import assign_by_order

Shape = tuple[int, ...]

# Hypothesis keeps caches under ./.hypothesis (already while collecting); tests never write into the working
# directory, so point it at the system temp directory before anything here is collected.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "ckptaudit-hypothesis")

M, V, W = (8, 4), (4,), (4, 4)  # an embedding-like matrix, a vector, a square matrix


def test_unique_assignment() -> None:
    fit = assign_by_order([M, V, W], [[M, V, W]])
    assert (fit.count, fit.solution, fit.exhausted) == (1, [[0, 1, 2]], False)


def test_trainer_decay_then_no_decay_groups() -> None:
    # named_parameters(): emb, ln.weight, ln.bias, fc.weight, fc.bias, head.weight
    params = [M, V, V, W, V, M]
    decay, no_decay = [M, W, M], [V, V, V]
    fit = assign_by_order(params, [decay, no_decay])
    assert fit.count == 1
    assert fit.solution == [[0, 3, 5], [1, 2, 4]]
    # Read as one group in plain order, the same healthy state fits nowhere.
    assert assign_by_order(params, [decay + no_decay]).count == 0


def test_ambiguous_assignment_names_the_loose_entries() -> None:
    # Two parameters of one shape, one of them frozen (no state): either could be the one with state.
    fit = assign_by_order([M, V, V, W], [[M, V, W]])
    assert fit.count == 2 and fit.solution is None and not fit.exhausted
    assert fit.options == (((0,), (1, 2), (3,)),)


def test_no_assignment() -> None:
    assert assign_by_order([M, W], [[W, M]]).count == 0  # order violated
    assert assign_by_order([M, W], [[M, V]]).count == 0  # shape absent
    assert assign_by_order([M], [[M], [M]]).count == 0  # more entries than parameters
    assert assign_by_order([M, M], [[M], [M]]).options == (((0, 1),), ((0, 1),))  # two groups share a shape


def test_buffers_are_skipped() -> None:
    # A leading 0-d buffer (Lightning's ``tokens_seen``) and a trailing one of another shape.
    fit = assign_by_order([(), M, V, (3,)], [[M, V]])
    assert (fit.count, fit.solution) == (1, [[1, 2]])
    # A buffer of a parameter's shape between two parameters of that shape is genuinely ambiguous.
    assert assign_by_order([V, V, V], [[V, V]]).count == 2


def test_entries_without_shape_match_anything() -> None:
    assert assign_by_order([M, W], [[None, W]]).solution == [[0, 1]]
    assert assign_by_order([M, W, V], [[None, V]]).count == 2


def test_search_gives_up_beyond_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optcheck, "MAX_DP_STATES", 10)
    fit = assign_by_order([V] * 12, [[V] * 3, [V] * 3])
    assert fit.exhausted and fit.count == 2 and fit.options == ()


def brute_force(params: Sequence[Shape], groups: Sequence[Sequence[Shape | None]]) -> tuple[int, list[list[set[int]]]]:
    """Every way of giving each parameter to a group (or none) that places all entries in order."""
    count = 0
    options: list[list[set[int]]] = [[set() for _ in g] for g in groups]
    for choice in itertools.product(range(-1, len(groups)), repeat=len(params)):
        placed = [[i for i, c in enumerate(choice) if c == g] for g in range(len(groups))]
        if any(len(p) != len(g) for p, g in zip(placed, groups, strict=True)):
            continue
        if all(want is None or params[i] == want for p, g in zip(placed, groups, strict=True)
               for i, want in zip(p, g, strict=True)):
            count += 1
            for g, p in enumerate(placed):
                for j, i in enumerate(p):
                    options[g][j].add(i)
    return count, options


shapes = st.sampled_from([M, V, W])


@settings(max_examples=150, deadline=None, database=None)
@given(params=st.lists(shapes, min_size=0, max_size=7),
       groups=st.lists(st.lists(st.one_of(shapes, st.none()), max_size=3), min_size=1, max_size=3))
def test_matches_brute_force(params: list[Shape], groups: list[list[Shape | None]]) -> None:
    count, options = brute_force(params, groups)
    fit = assign_by_order(params, groups)
    assert fit.count == min(count, 2)
    if count:
        assert [[set(o) for o in g] for g in fit.options] == options
    if count == 1:
        assert fit.solution == [[next(iter(o)) for o in g] for g in options]


def test_adafactor_factored_statistics_are_not_shape_mismatches(tmp_path: Path) -> None:
    import torch

    from ckptaudit.recipes.tinygpt import plain_recipe

    torch.manual_seed(0)
    model = plain_recipe.build_model()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.Adafactor([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], lr=1e-2)
    batch = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len + 1))
    for _ in range(2):
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    osd = opt.state_dict()
    assert any("row_var" in s for s in osd["state"].values())
    torch.save({"model": model.state_dict(), "optimizer": osd}, tmp_path / "adafactor.pt")
    report = run_audit(str(tmp_path / "adafactor.pt"))
    assert report.extra["attachment"] == "unique-order", [f.message for f in report.findings]
    assert "optimizer.shape-mismatch" not in {f.code for f in report.findings}
    names = [n for n, _ in model.named_parameters()]
    expected = {k: n for g, ps in zip(osd["param_groups"], (matrices, vectors), strict=True)
                for k, p in zip(g["params"], ps, strict=True)
                for n in names if model.get_parameter(n) is p}
    got = {int(t.name.split("/")[-2]): t.param for t in report.tensors if t.role == "row_var" or t.role == "variance"}
    assert got == expected


def test_malformed_param_groups_give_findings_not_tracebacks(tmp_path: Path) -> None:
    import torch

    model = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    state = {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(4, 4), "exp_avg_sq": torch.rand(4, 4)}}
    for groups in ([{"params": [[0], {"a": 1}, 0, True]}], "not a list", [{"params": 7}], [3, None]):
        path = tmp_path / "odd.pt"
        torch.save({"model": model, "optimizer": {"state": state, "param_groups": groups}}, path)
        report = run_audit(str(path))
        assert "optimizer.index-keyed" in {f.code for f in report.findings}
