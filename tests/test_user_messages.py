"""What a user meets by default (issue 37): the install line of the docs, the report going to a file still saying
its verdict, a plain FSDP2 folder not called torchtitan, a mistyped exporter refused before any rank starts, the
schema page naming the sections the JSON has."""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.cli import main
from real_checkpoints import trained

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_no_page_installs_ckptaudit_from_an_index() -> None:
    # The package is on no index: `pip install ckptaudit` (or 'ckptaudit[torch]') fails for a new user. A clone
    # (`pip install .`, `'.[torch]'`, `./ckptaudit`) or a git URL (`ckptaudit @ git+https://...`) works.
    wrong = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for args in re.findall(r"pip install ([^`#\n]*)", line):
                tokens = [t.strip("'\"") for t in args.split()]
                for i, t in enumerate(tokens):
                    named = re.fullmatch(r"ckptaudit(\[[\w,]+\])?", t)
                    if named and (i + 1 >= len(tokens) or tokens[i + 1] != "@"):
                        wrong.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_every_install_line_a_message_gives_is_the_one_the_docs_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """The messages that tell a user to install an extra give README's command (from a clone), never the package's
    name on an index; and no message in the source names one."""
    import sys

    from ckptaudit.extras import install_line, torch_missing
    from ckptaudit.formats.remote.errors import RemoteError
    from ckptaudit.formats.remote.objects import filesystem
    from ckptaudit.passport.model import PassportError
    from ckptaudit.passport.statements import load_private_key

    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("## The demo")]
    assert "from a clone" in setup
    docs = "\n".join(p.read_text() for p in PAGES)
    for extra, page in [("torch", setup), ("remote", setup), ("sign", docs)]:
        command = install_line(extra).split(" in a clone")[0]
        assert f"`{command}`" in page, (extra, command)
        assert "clone" in install_line(extra)

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert install_line("torch") in (torch_missing("ckptaudit demo") or "")
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "fsspec", None)  # "import fsspec" raises ImportError
    with pytest.raises(RemoteError, match=re.escape(install_line("remote"))):
        filesystem("s3://bucket/ckpt.pt")
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives", None)
    with pytest.raises(PassportError, match=re.escape(install_line("sign"))):
        load_private_key("key.pem")

    named = re.compile(r"pip install [^\n]*ckptaudit\[")
    wrong = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in sorted((ROOT / "src" / "ckptaudit").rglob("*.py"))
             for m in named.finditer(p.read_text())]
    assert not wrong, wrong


def test_a_report_written_to_a_file_still_says_its_verdict(tmp_path: Path) -> None:
    bad = trained(tmp_path / "bad.pt", rounded=True)
    for fmt in ("html", "json", "table"):
        out = tmp_path / f"report.{fmt}"
        code, stdout, stderr = _cli("audit", str(bad), "--format", fmt, "-o", str(out), "--no-progress")
        assert code == 1 and out.stat().st_size > 0 and stdout == ""
        (line,) = stderr.splitlines()
        assert line.startswith(f"{bad}: NOT resumable as-is") and line.endswith(f"(report: {out})"), stderr
    code, stdout, stderr = _cli("audit", str(bad), "--format", "json", "--no-progress")
    assert code == 1 and stdout.startswith("{") and stderr == ""  # on stdout, the report itself is the verdict


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_plain_fsdp2_folder_is_not_labelled_torchtitan(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptaudit.auditing.judge import run_audit

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The model's FQNs at the top level, as torchtitan saves them, but none of torchtitan's own keys.
        dcp.save({**msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "step-2"), no_dist=True)
        dcp.save({**msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": 2}},
                 checkpoint_id=str(tmp_path / "titan-2"), no_dist=True)
    assert run_audit(str(tmp_path / "step-2")).format == "dcp"
    assert run_audit(str(tmp_path / "titan-2")).format == "torchtitan"


def test_a_mistyped_exporter_or_recipe_is_refused_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptaudit.launch
    import ckptaudit.resume.driver

    def no_ranks(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("ranks were launched for a spec that does not resolve")

    monkeypatch.setattr(ckptaudit.resume.driver, "launch", no_ranks)
    monkeypatch.setattr(ckptaudit.launch, "launch", no_ranks)
    code, _, err = _cli("resume-test", "--exporter", "ckptaudit.exporters:documentd", "--no-progress")
    assert code == 2 and "module ckptaudit.exporters has no attribute 'documentd'" in err
    assert "did you mean ckptaudit.exporters:documented?" in err
    code, _, err = _cli("resume-test", "--recipe", "ckptaudit.recipes.tinygpt:recipes", "--no-progress")
    assert code == 2 and "did you mean ckptaudit.recipes.tinygpt:recipe?" in err


def test_the_schema_page_names_the_serving_section_as_the_json_does() -> None:
    page = (ROOT / "docs" / "json-schema.md").read_text()
    sentence = page[page.index("The other commands add their own section"):].split("\n\n", 1)[0]
    assert "`serving` for export-serving" in sentence and "`export`)" not in sentence
    source = (ROOT / "src" / "ckptaudit" / "serving" / "export.py").read_text()
    assert 'extra={"serving": ' in source  # the key the command writes


def test_the_resume_test_names_the_generators_speaks_plainly_and_shows_only_the_users_frames() -> None:
    import numpy as np

    from ckptaudit.recipes import describe_function
    from ckptaudit.resume import COMPONENTS, ResumeConfig, Trajectory, default_load, judge_resume

    def traj(p: float) -> Trajectory:
        return Trajectory(losses=[2.0, 2.0], params=[{"w": np.full(4, p)} for _ in range(3)],
                          norms=[{"w": 2.0} for _ in range(3)])

    saved = {c: {"k": "saved"} for c in COMPONENTS}
    saved["rng"] = {"rank0/python": "saved", "rank0/numpy": "saved", "rank0/torch": "saved"}
    fresh = {c: {"k": "fresh"} for c in COMPONENTS}
    fresh["rng"] = {"rank0/python": "fresh", "rank0/numpy": "fresh", "rank0/torch": "saved"}
    # Restored: everything but the moments and Python's and NumPy's generators.
    restored = {**saved, "optimizer moments": fresh["optimizer moments"], "rng": fresh["rng"]}
    loader = describe_function(default_load)
    assert loader == "ckptaudit.resume.default_load"  # ours by its import name, no path or line of our files
    assert describe_function(traj).startswith("test_the_resume_test_names") and "test_user_messages.py:" in (
        describe_function(traj))  # the user's own: where it is
    ref = {"traj": traj(1.0), "fresh": fresh, "restored": saved, "loader": loader, "control": ""}
    cand = {**ref, "restored": restored}
    report = judge_resume(ResumeConfig(), "/nonexistent", traj(1.0), ref, {**ref, "traj": traj(1.1), "control": "x"},
                          [(0, cand, "", "")])
    text = " ".join(f.message for f in report.findings) + " " + report.summary
    assert "the optimizer moments are not restored by ckptaudit.resume.default_load" in text, text
    assert "the rng (numpy, python) is not restored" in text and "rng (numpy, python) not restored" in text
    assert "moments is" not in text and "phases.py" not in text and "ckptaudit/" not in text
