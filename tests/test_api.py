"""The public API (``ckptaudit.audit``, ``ckptaudit.compare``, ``ckptaudit.Report``), the quick mode, and the shipped
JSON Schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptaudit
from ckptaudit.schema import SCHEMA_PATH, load_schema, validate
from real_checkpoints import trained


def test_import_is_cheap_and_the_surface_is_stable() -> None:
    def run(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert run("import sys, ckptaudit; print('numpy' in sys.modules, 'torch' in sys.modules)").split() == [
        "False", "False"]
    # Importing the engine packages leaves the public functions in place.
    out = run("import ckptaudit, ckptaudit.auditing.judge, ckptaudit.comparing; "
              "print(sorted(ckptaudit.__all__), type(ckptaudit.audit).__name__, type(ckptaudit.compare).__name__)")
    assert out.split(maxsplit=4) == ["['Report',", "'__version__',", "'audit',", "'compare']", "function function\n"]


def test_audit_returns_a_report_that_fails_on_rounded_masters(tmp_path: Path) -> None:
    good = ckptaudit.audit(trained(tmp_path / "good.pt"))
    assert good.ok and not good.quick and good.failing == ()
    bad = ckptaudit.audit(str(trained(tmp_path / "bad.pt", rounded=True)))
    assert not bad.ok
    assert {f.code for f in bad.failing} == {"precision.bf16-rounded"}
    assert "precision.bf16-rounded" in bad.describe()
    doc = json.loads(bad.to_json())
    assert doc["command"] == "audit" and doc["counts"]["error"] == len(bad.failing)
    validate(doc)


def test_fail_on_sets_the_level_of_ok(tmp_path: Path) -> None:
    path = trained(tmp_path / "good.pt")
    report = ckptaudit.audit(path, fail_on="warning")
    warnings = [f for f in report.findings if f.severity.label == "warning"]
    assert warnings, "an index-keyed torch.save optimizer gives a warning"
    assert not report.ok and report.failing == tuple(warnings)


def test_options_are_checked_with_the_name_the_value_and_the_fix(tmp_path: Path) -> None:
    path = trained(tmp_path / "good.pt")
    with pytest.raises(TypeError, match=r"unknown option 'master_dtpye'; did you mean 'master_dtype'\?"):
        ckptaudit.audit(path, master_dtpye="float32")
    with pytest.raises(ValueError, match=r"option master_dtype='fp32' is not valid; pass one of 'auto', 'float32'"):
        ckptaudit.audit(path, master_dtype="fp32")
    with pytest.raises(ValueError, match=r"option require=\['scheduler', 'optimiser'\] is not valid"):
        ckptaudit.audit(path, require=["scheduler", "optimiser"])
    with pytest.raises(ValueError, match="option quick='yes' is not valid; pass True or False"):
        ckptaudit.audit(path, quick="yes")
    with pytest.raises(ValueError, match=r"ckptaudit.compare: option threads=0 is not valid; pass an int from 1 to 64"):
        ckptaudit.compare(path, path, threads=0)
    with pytest.raises(FileNotFoundError, match=r"ckptaudit.audit: path '.*nope.pt' does not exist"):
        ckptaudit.audit(tmp_path / "nope.pt")
    report = ckptaudit.audit(path, require="scheduler")  # a comma-separated string works too
    assert {f.subject for f in report.failing} == {"scheduler"}


def test_compare_reports_the_rounding(tmp_path: Path) -> None:
    report = ckptaudit.compare(trained(tmp_path / "good.pt"), trained(tmp_path / "bad.pt", rounded=True))
    assert not report.ok
    assert "bf16" in report.summary
    validate(report.to_dict())


def test_quick_mode_decides_from_the_first_chunk_and_never_claims_a_full_clean(tmp_path: Path) -> None:
    # 64x64 fp32 weights = 16 KiB: with 4 KiB chunks the first chunk is the first 16 rows.
    good = trained(tmp_path / "good.pt", width=64)
    bad = trained(tmp_path / "bad.pt", width=64, rounded=True)
    quick_good = ckptaudit.audit(good, quick=True, chunk_bytes=4096)
    assert quick_good.ok and quick_good.quick
    assert quick_good.summary.startswith("quick audit") and "not a full verdict" in quick_good.summary
    assert all(t["hash"] is None for t in quick_good.to_dict()["tensors"])
    quick_bad = ckptaudit.audit(bad, quick=True, chunk_bytes=4096)
    assert {f.code for f in quick_bad.failing} == {"precision.bf16-rounded"}
    # Its stated limit: what lies beyond the first chunk is seen by the full audit alone. Here the first chunk
    # of one weight is zeros (says nothing) and the rest was rounded to bf16.
    blob = torch.load(good, weights_only=True)
    w = blob["model"]["0.weight"]
    w[:16] = 0
    w[16:] = w[16:].bfloat16().float()
    torch.save(blob, tmp_path / "late.pt")
    assert ckptaudit.audit(tmp_path / "late.pt", quick=True, chunk_bytes=4096).ok
    full = ckptaudit.audit(tmp_path / "late.pt", chunk_bytes=4096)
    assert [(f.code, f.subject) for f in full.failing] == [("precision.bf16-rounded", "model/0.weight")]


def test_the_schema_ships_in_the_package_and_rejects_what_it_should(tmp_path: Path) -> None:
    assert Path(SCHEMA_PATH).is_file() and load_schema()["title"] == "ckptaudit JSON report"
    doc = ckptaudit.audit(trained(tmp_path / "good.pt")).to_dict()
    validate(doc)
    broken = json.loads(json.dumps(doc))
    broken["findings"].append({"code": "Not A Code", "severity": "fatal", "subject": "x", "message": "",
                               "evidence": {}})
    del broken["counts"]
    with pytest.raises(ValueError, match=r"breaks report.schema.json \(4 error\(s\)\)") as info:
        validate(broken)
    assert "at /findings/" in str(info.value) and "'counts' is a required property" in str(info.value)


def test_every_catalogued_code_fits_the_schema() -> None:
    import re

    from ckptaudit.catalogue import CATALOGUE

    pattern = re.compile(load_schema()["$defs"]["finding"]["properties"]["code"]["pattern"])
    assert CATALOGUE and all(pattern.match(code) for code in CATALOGUE), [c for c in CATALOGUE if not pattern.match(c)]


def test_schema_1_x_is_additive_older_reports_still_validate(tmp_path: Path) -> None:
    # 1.1 added the optional "mode" key (quick audits), 1.2 the contract's "where"/"records", a finding's "ignored"
    # and counts' "ignored", 1.3 contract sources and latest's "skipped": a 1.0 report (none of them) still fits.
    from ckptaudit.findings import SCHEMA_VERSION

    assert SCHEMA_VERSION == "1.3"
    path = trained(tmp_path / "good.pt")
    quick = ckptaudit.audit(path, quick=True).to_dict()
    assert quick["schema_version"] == "1.3" and quick["mode"] == "quick"
    validate(quick)
    old = ckptaudit.audit(path).to_dict()
    assert "mode" not in old
    old["schema_version"] = "1.0"
    for key in ("where", "records"):
        del old["contract"][key]
    for f in old["findings"]:
        del f["ignored"]
    validate(old)
    docs = (Path(__file__).parents[1] / "docs" / "json-schema.md").read_text()
    assert f"# JSON report (schema {SCHEMA_VERSION})" in docs and f"| `{SCHEMA_VERSION}` | " in docs


def test_the_garbage_collector_is_left_as_the_caller_had_it(tmp_path: Path) -> None:
    """The open pauses Python's cyclic collector (bench/README.md); the caller's process gets it back as it
    was: on after an audit or a compare, off where the caller had switched it off, on after an open that failed,
    and paused during the open itself."""
    import gc

    from ckptaudit.formats.dcp import reader as dcp
    ckpt = trained(tmp_path / "ckpt.pt")
    seen: list[bool] = []
    real = dcp.read_dcp

    def watching(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    import torch.distributed.checkpoint as tdcp

    tdcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(tmp_path / "dcp"))
    assert gc.isenabled()
    dcp.read_dcp = watching
    try:
        ckptaudit.audit(str(tmp_path / "dcp"))
    finally:
        dcp.read_dcp = real
    assert seen == [False] and gc.isenabled()
    ckptaudit.compare(str(ckpt), str(ckpt))
    assert gc.isenabled()
    with pytest.raises(FileNotFoundError):
        ckptaudit.audit(str(tmp_path / "missing.pt"))
    assert gc.isenabled()
    gc.disable()
    try:
        ckptaudit.audit(str(ckpt))
        assert not gc.isenabled()
    finally:
        gc.enable()
