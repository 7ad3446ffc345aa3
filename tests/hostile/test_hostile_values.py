"""Values from a checkpoint that used to raise (issue 25): a manifest shard whose shape is not a list, a step
tensor holding NaN or an infinity under the distributed audit. A report each, never a traceback."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.cli import main


@pytest.mark.parametrize("sizes", [7, "7", None, [1.5], [[4]]])
def test_a_manifest_shard_shape_that_is_not_a_list_of_ints_is_a_finding(sizes: object, tmp_path: Path) -> None:
    from ckptaudit.launch import RankContext
    from ckptaudit.recipes.tinygpt import plain_recipe
    from ckptaudit.store import save_checkpoint

    job = plain_recipe.setup(RankContext(rank=0, world_size=1, backend="gloo", shared_dir=""))
    saved = Path(save_checkpoint(job, tmp_path / "run").path)
    assert not [f for f in run_audit(str(saved)).findings if f.code == "integrity.corrupt"]
    manifest = json.loads((saved / "manifest.json").read_text())
    name = sorted(manifest["tensors"])[0]
    manifest["tensors"][name]["shards"][0]["sizes"] = sizes
    (saved / "manifest.json").write_text(json.dumps(manifest))
    report = run_audit(str(saved))
    (bad,) = [f for f in report.findings if f.code == "integrity.corrupt"]
    assert bad.subject == "manifest.json" and "not a list of integers" in bad.message and name in bad.message
    assert main(["audit", str(saved), "--no-progress"], stdout=io.StringIO(), stderr=io.StringIO()) == 1


def test_step_tensors_holding_nan_and_infinity_audit_the_same_under_torchrun(tmp_path: Path) -> None:
    import torch

    from runs import torchrun

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = opt.state_dict()
    for value, entry in zip([float("nan"), float("inf"), float("-inf"), 2.0], state["state"].values(), strict=True):
        entry["step"] = torch.tensor(value)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": state, "step": 1}, path)
    out = io.StringIO()
    code = main(["audit", str(path), "--format", "json", "--no-progress", "--jobs", "1"], stdout=out,
                stderr=io.StringIO())
    single = json.loads(out.getvalue())
    run = torchrun(2, "audit", str(path), "--format", "json", "--no-progress", cwd=tmp_path)
    assert run.returncode == code, run.stderr[-3000:]
    assert json.loads(run.stdout) == single
    assert "optimizer.step-mismatch" in {f["code"] for f in single["findings"]}
    assert not re.search(r'File ".*ckptaudit', run.stderr), run.stderr[-3000:]


@pytest.mark.parametrize("step", [10**400, 10**5000], ids=["10**400", "10**5000"])
def test_plain_number_step_counters_past_float_and_str_are_a_finding_not_a_traceback(step: int,
                                                                                     tmp_path: Path) -> None:
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = opt.state_dict()
    state["state"][0]["step"] = step  # a Python int, as capturable=False optimizers may store
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    report = run_audit(str(path))
    (odd,) = [f for f in report.findings if f.code == "optimizer.step-mismatch"]
    assert "disagree" in odd.message
    for fmt in ("json", "table", "html"):
        out, err = io.StringIO(), io.StringIO()
        assert main(["audit", str(path), "--no-progress", "--format", fmt], stdout=out, stderr=err) == 0, \
            err.getvalue()  # a warning: not at the default fail level
        if fmt == "json":
            assert json.loads(out.getvalue())["findings"]


def test_megatron_iteration_past_the_int_to_string_limit_is_spelled_not_raised() -> None:
    from ckptaudit.layouts.megatron.layout import _megatron_data_detail

    huge = 10**5000
    assert "<integer of about 5001 digits>" in _megatron_data_detail({"iteration": huge,
                                                                     "args": {"consumed_train_samples": huge}})
    assert "<integer of about 5001 digits>" in _megatron_data_detail({"iteration": huge})
