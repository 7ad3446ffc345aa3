"""The command line as a new user meets it: piped widths, grouped findings, closed pipes, honest messages, file
modes, ``--help``, ``latest``'s options, unknown flags, the first run of a job, and files that are no checkpoint.

Real files throughout (``torch.save``, the writer of ``ckptaudit.store``, safetensors); the pipe tests run the real
CLI in a child process whose stdout reader is already gone.

Run: ``.venv/bin/python -m pytest -q tests/cli/test_cli_edges.py``
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.auditing.judge import run_audit
from ckptaudit.catalogue import CATALOGUE, finding
from ckptaudit.cli import main
from ckptaudit.findings import RawReport, Severity
from ckptaudit.launch import RankContext
from ckptaudit.recipes import Job
from ckptaudit.recipes.tinygpt import plain_recipe
from ckptaudit.report.table import render_table

ROOT = Path(__file__).resolve().parents[2]
CTX = RankContext(rank=0, world_size=1, backend="gloo", shared_dir="")


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root written by ``ckptaudit.store.save_checkpoint``: steps 1 and 2 of the tiny GPT."""
    from ckptaudit.store import save_checkpoint

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("ckpts")
        job = plain_recipe.setup(CTX)
        for _ in range(2):
            plain_recipe.step(job)
            save_checkpoint(job, root)
    finally:
        torch.set_num_threads(before)
    return root


def _report(findings: list[Any]) -> RawReport:
    return RawReport(command="audit", path="/x", format="torch.save", findings=tuple(findings), summary="s")


def _render(report: RawReport, verbose: bool = False) -> list[str]:
    out = io.StringIO()
    render_table(report, out, verbose=verbose)
    return out.getvalue().splitlines()


# ---------------------------------------------------------------------------------------------------------------
# Width and grouping


LONG = "the low mantissa bits were lost before saving, e.g. by exporting the bf16 compute copies " * 3


def test_piped_output_honours_columns_and_headers_never_break_inside_a_word(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _report([finding("precision.low-precision-storage", "model/blocks.0.attn.qkv.weight", LONG),
                      finding("component.missing", "scheduler", LONG, severity=Severity.WARNING)])
    monkeypatch.delenv("COLUMNS", raising=False)
    assert max(len(line) for line in _render(report)) == 140
    for columns in (100, 80):
        monkeypatch.setenv("COLUMNS", str(columns))
        lines = _render(report)
        assert max(len(line) for line in lines) <= columns
        header = next(line for line in lines if "severity" in line)
        assert re.findall(r"[a-z]+", header) == ["severity", "code", "subject", "message"], header
        assert any("precision.low-precision-storage" in line for line in lines)  # codes never fold
    monkeypatch.setenv("COLUMNS", "garbage")
    assert max(len(line) for line in _render(report)) == 140


def test_findings_group_by_severity_and_code() -> None:
    """component.missing is an error for the model and optimizer and a warning for the rest: an error row lists
    only error subjects."""
    errors = [finding("component.missing", f"err{i}", "m") for i in range(4)]
    warnings = [finding("component.missing", f"warn{i}", "m", severity=Severity.WARNING) for i in range(4)]
    lines = _render(_report([*errors, *warnings]))
    rows = [line for line in lines if "4 subjects" in line]
    assert len(rows) == 2, lines
    error_row = next(line for line in rows if line.lstrip().startswith("error"))
    warning_row = next(line for line in rows if line.lstrip().startswith("warning"))
    assert "err0" in error_row and "warn" not in error_row
    assert "warn0" in warning_row and "err" not in warning_row.replace("error", "")


# ---------------------------------------------------------------------------------------------------------------
# Closed pipes


def _closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI with its stdout a pipe whose reader is gone before it writes (``| head -c 0``, deterministic)."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    try:
        return subprocess.run([sys.executable, "-m", "ckptaudit", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=env, check=False)
    finally:
        os.close(write)


def test_a_closed_pipe_keeps_the_verdicts_exit_code_and_prints_no_error(store_root: Path, tmp_path: Path) -> None:
    clean = _closed_pipe("audit", str(store_root / "step-000002"))
    assert (clean.returncode, clean.stderr) == (0, "")
    latest = _closed_pipe("latest", str(store_root))
    assert (latest.returncode, latest.stderr) == (0, "")
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    failing = _closed_pipe("audit", str(text))
    assert (failing.returncode, failing.stderr) == (1, "")


# ---------------------------------------------------------------------------------------------------------------
# Messages that say what was observed


def test_the_probe_says_what_it_saw_not_which_exporter_did_it() -> None:
    from ckptaudit.probe.verdict import ParamVerdict, _findings_for

    v = ParamVerdict("w", "compute-copy-upcast", "equal to the bfloat16 compute copy observed inside forward, "
                     "upcast to float32")
    (f,) = _findings_for(v, (), (), ())
    assert f.code == "probe.saved-compute-copy"
    assert "bit for bit the compute copy" in f.message
    assert "captured the compute copies or it cast the masters" in f.message
    assert "saved the FSDP compute copies" not in CATALOGUE["probe.saved-compute-copy"].summary


def test_compare_calls_bf16_stored_parameters_what_audit_calls_them(tmp_path: Path) -> None:
    from ckptaudit.comparing import run_compare

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g)
    opt = {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.randn(16, 8, generator=g)}},
           "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    torch.save({"model": {"w": w}, "optimizer": opt}, tmp_path / "ref.pt")
    torch.save({"model": {"w": w.bfloat16()}, "optimizer": opt}, tmp_path / "stored.pt")
    torch.save({"model": {"w": w.bfloat16().float()}, "optimizer": opt}, tmp_path / "upcast.pt")

    stored = run_compare(str(tmp_path / "ref.pt"), str(tmp_path / "stored.pt"))
    codes = {f.code for f in stored.findings if f.subject.endswith("w")}
    assert "precision.low-precision-storage" in codes and "precision.bf16-rounded" not in codes
    msg = next(f.message for f in stored.findings if f.code == "precision.low-precision-storage")
    assert "stored as bfloat16" in msg and "wider dtype" not in msg
    assert "precision.low-precision-storage" in {f.code for f in run_audit(str(tmp_path / "stored.pt")).findings}
    # Rounded values stored in fp32 look like masters until their bits are read: that is precision.bf16-rounded.
    upcast = run_compare(str(tmp_path / "ref.pt"), str(tmp_path / "upcast.pt"))
    assert "precision.bf16-rounded" in {f.code for f in upcast.findings}
    assert "precision.low-precision-storage" not in {f.code for f in upcast.findings}


# ---------------------------------------------------------------------------------------------------------------
# Files other users can read


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_serving_artifact_honours_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    from ckptaudit.serving.export import write_artifact

    old = os.umask(umask)
    try:
        files = write_artifact(str(tmp_path / "out"), {"a": torch.ones(4, 4), "b": torch.zeros(3)},
                               {"artifact": "serving"}, 64)
    finally:
        os.umask(old)
    assert len(files) == 3  # two shards and the index
    for f in files:
        assert (tmp_path / "out" / f.name).stat().st_mode & 0o777 == mode, f.name


# ---------------------------------------------------------------------------------------------------------------
# --help, latest's options, unknown flags


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resume-test", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--save-at", "8"), ("--steps", "8"), ("--margin", "10"), ("--timeout", "600")):
        assert re.search(re.escape(flag) + r" [A-Z_]+ [^-]*\(default:? " + re.escape(default) + r"[ )]", text), flag
    assert main(["audit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: auto)" in text and "(default: table)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_an_unknown_flag_prints_the_commands_usage() -> None:
    err = io.StringIO()
    assert main(["audit", "x.pt", "--bogus"], stderr=err) == 2
    assert err.getvalue().startswith("usage: ckptaudit audit ")
    assert "ckptaudit audit: error: unrecognized arguments: --bogus" in err.getvalue()
    err = io.StringIO()
    assert main(["latest", "--bogus", "root"], stderr=err) == 2
    assert err.getvalue().startswith("usage: ckptaudit latest ")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_latest_fail_on_and_no_progress(store_root: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "root"
    shutil.copytree(store_root, root)
    (root / "latest").write_text("step-000001\n")  # a stale pointer: store.pointer-stale, a warning
    out = io.StringIO()
    assert main(["latest", str(root)], stdout=out, stderr=io.StringIO()) == 0
    assert "store.pointer-stale" in out.getvalue()
    assert main(["latest", str(root), "--fail-on", "warning"], stdout=io.StringIO(), stderr=io.StringIO()) == 1
    assert main(["latest", str(root), "--fail-on", "error"], stdout=io.StringIO(), stderr=io.StringIO()) == 0
    err = _Tty()
    main(["latest", str(root)], stdout=io.StringIO(), stderr=err)
    assert "latest: checking step-000002" in err.getvalue()
    err = _Tty()
    main(["latest", str(root), "--no-progress"], stdout=io.StringIO(), stderr=err)
    assert err.getvalue() == ""
    # Nothing resumable stays exit 1 whatever --fail-on says.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["latest", str(empty), "--fail-on", "info"], stdout=io.StringIO(), stderr=io.StringIO()) == 1


# ---------------------------------------------------------------------------------------------------------------
# The first run of a job


def _fresh() -> Job:
    return plain_recipe.setup(CTX)


def test_load_checkpoint_missing_ok_on_the_first_run(store_root: Path, tmp_path: Path) -> None:
    import shutil

    from ckptaudit.store import CheckpointLoadError, load_checkpoint

    job = _fresh()
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    assert load_checkpoint(job, tmp_path / "never-saved", missing_ok=True) is None
    with pytest.raises(CheckpointLoadError, match="missing_ok=True"):
        load_checkpoint(job, tmp_path / "never-saved")
    # A first save that died before its commit leaves only a temporary directory: still nothing to resume.
    crashed = tmp_path / "crashed"
    (crashed / "step-000001.partial-0badcafe").mkdir(parents=True)
    assert load_checkpoint(job, crashed, missing_ok=True) is None
    assert job.step == 0 and all(torch.equal(before[k], v) for k, v in job.model.state_dict().items())
    # Committed checkpoints none of which is resumable are damage, not a first run: that still raises.
    broken = tmp_path / "broken"
    shutil.copytree(store_root, broken)
    for step in ("step-000001", "step-000002"):
        (broken / step / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointLoadError, match="no resumable checkpoint"):
        load_checkpoint(job, broken, missing_ok=True)
    loaded = load_checkpoint(job, store_root, missing_ok=True)
    assert loaded is not None and loaded.step == 2 and job.step == 2


# ---------------------------------------------------------------------------------------------------------------
# Files that are no checkpoint


def test_a_text_file_or_a_folder_of_other_files_is_not_a_checkpoint_first(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\nthis is text\n")
    report = run_audit(str(text))
    assert [f.code for f in report.findings] == ["format.unrecognized"]
    assert report.findings[0].message.startswith("notes.txt: not a checkpoint in any known format")
    assert report.summary.startswith("not a checkpoint")
    folder = tmp_path / "stuff"
    folder.mkdir()
    (folder / "a.bin").write_bytes(bytes(range(19, 256)) * 4)
    (folder / "b.dat").write_bytes(os.urandom(64))
    (folder / "c.txt").write_text("hi\n")
    report = run_audit(str(folder))
    codes = [(f.code, f.subject) for f in report.findings]
    assert codes[0] == ("format.unrecognized", "stuff") and "not a checkpoint in any known format" in \
        report.findings[0].message
    assert ("format.unrecognized", "a.bin") in codes[1:]
    assert "component.missing" not in {c for c, _ in codes}
    out = io.StringIO()
    assert main(["audit", str(folder)], stdout=out) == 1
    rows = [line for line in out.getvalue().splitlines() if "format.unrecognized" in line]
    assert "stuff" in rows[0] and "MISSING" not in out.getvalue()


def test_a_real_checkpoint_missing_a_component_is_still_judged_as_one(tmp_path: Path) -> None:
    """Only what no reader recognises is 'not a checkpoint': a model without its optimizer is a checkpoint with
    a missing component, as before."""
    torch.save({"model": {"w": torch.randn(4, 4)}}, tmp_path / "weights.pt")
    report = run_audit(str(tmp_path / "weights.pt"))
    assert ("component.missing", "optimizer") in {(f.code, f.subject) for f in report.findings}
    assert "format.unrecognized" not in {f.code for f in report.findings}


def test_a_known_format_ckptaudit_does_not_read_is_not_called_unrecognised(tmp_path: Path) -> None:
    """A legacy (pre-1.6) torch.save file is a checkpoint in a known format: refused as an unvetted pickle (an
    error), never called unrecognised."""
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    codes = {f.code for f in run_audit(str(tmp_path / "legacy.pt")).findings}
    assert "security.unvetted-pickle" in codes and "format.unrecognized" not in codes
