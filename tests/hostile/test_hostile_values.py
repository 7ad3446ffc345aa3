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


def test_the_safe_formatter_never_raises_and_keeps_distinct_values_apart() -> None:
    from ckptaudit.findings import safe_repr, safe_str

    huge = 10**5000
    assert safe_str(huge).startswith("<integer of about 5001 digits> (blake2b ")
    assert safe_str(huge) != safe_str(huge + 1) and safe_str(-huge) != safe_str(huge)  # names never merge
    assert safe_str((huge, "a")).endswith(", 'a')") and safe_repr([huge]).startswith("[<integer")
    assert safe_str(2**100) == str(2**100) and safe_str(float("nan")) == "NaN" and safe_repr("a") == "'a'"

    class Hostile:
        def __str__(self) -> str:
            raise ValueError("no")

        def __repr__(self) -> str:
            raise ValueError("no")

    assert safe_str(Hostile()) == "<Hostile>" and safe_repr(Hostile()) == "<Hostile>"
    assert safe_str({huge: 1}) == "<dict of 1 items>"
    assert len(safe_str("x" * 10**6, 100)) <= 100 and "chars)" in safe_str("x" * 10**6, 100)


def _huge_key_checkpoints(tmp_path: Path) -> dict[str, Path]:
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    huge = 10**5000
    pt = tmp_path / "huge.pt"
    torch.save({"model": {huge: torch.randn(3), huge + 1: torch.randn(3), "w": torch.randn(2)}, huge: torch.ones(2),
                "step": huge}, pt)
    root = tmp_path / "huge-dcp"
    dcp.save({"model": {"w": torch.randn(4)}, "x": torch.randn(2)}, checkpoint_id=str(root), no_dist=True)
    with open(root / ".metadata", "rb") as fh:
        md = pickle.load(fh)  # the test's own file
    md.planner_data["x"] = ("x", huge)  # a planner_data path element of 5,001 digits
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return {"torch.save": pt, "dcp": root}


def test_keys_of_5001_digits_end_in_a_report_from_the_api_and_the_cli(tmp_path: Path) -> None:
    import ckptaudit

    paths = _huge_key_checkpoints(tmp_path)
    report = ckptaudit.audit(paths["torch.save"])
    names = [t.name for t in report.raw.tensors]
    huge_names = [n for n in names if "<integer of about 5001 digits>" in n]
    assert len(huge_names) == 3 and len(set(huge_names)) == 3, names  # two model keys and one top-level: apart
    dcp_report = ckptaudit.audit(paths["dcp"])
    assert any(f.code == "integrity.corrupt" and "<integer of about 5001 digits>" in f.message
               for f in dcp_report.findings), dcp_report.findings
    for path in paths.values():
        for fmt in ("table", "json", "html"):
            for extra in ([], ["--verbose"]):
                out, err = io.StringIO(), io.StringIO()
                code = main(["audit", str(path), "--no-progress", "--format", fmt, *extra], stdout=out, stderr=err)
                assert code in (0, 1) and "Traceback" not in err.getvalue(), err.getvalue()[-2000:]
                assert out.getvalue()
                if fmt == "json":
                    json.loads(out.getvalue())
        out, err = io.StringIO(), io.StringIO()
        assert main(["compare", str(path), str(path), "--no-progress"], stdout=out, stderr=err) in (0, 1), \
            err.getvalue()[-2000:]
