"""One API for what the command line does: ``ckptaudit.audit`` / ``compare`` and ``ckptaudit.testing`` take every
path ``ckptaudit audit`` / ``compare`` take (local paths, ``file://`` URLs, ``s3://`` URLs on a local S3 server),
with the same defaults: the CLI's JSON report and the API's ``Report.to_json()`` are the same document."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptaudit
from ckptaudit.cli import main
from ckptaudit.testing import AuditFailed, assert_checkpoint_ok
from local_s3 import local_s3
from real_checkpoints import trained

BUCKET = "parity-ckpts"
"""This module's bucket (moto shares its buckets between every server of the process)."""


def _cli(*argv: str) -> tuple[int, dict[str, Any], str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([*argv, "--format", "json", "--no-progress"], stdout=out, stderr=err)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    return {"good.pt": trained(root / "good.pt"), "bad.pt": trained(root / "bad.pt", rounded=True)}


@pytest.fixture(scope="module")
def s3(local: dict[str, Path]) -> Iterator[str]:
    with local_s3(BUCKET) as s3:
        for name, path in local.items():
            s3.fs.put(str(path), f"{BUCKET}/{name}")
        yield f"s3://{BUCKET}"


def local_path_of(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _forms(local: dict[str, Path], s3: str, name: str) -> list[str]:
    return [str(local[name]), f"file://{local[name]}", f"{s3}/{name}"]


@pytest.mark.parametrize("name", ["good.pt", "bad.pt"])
@pytest.mark.parametrize("options", [(), ("--master-dtype", "float32", "--require", "scheduler"),
                                     ("--quick", "--fail-on", "warning", "--ignore", "optimizer")])
def test_audit_gives_the_cli_report_for_every_path_the_cli_takes(local: dict[str, Path], s3: str, name: str,
                                                                 options: tuple[str, ...]) -> None:
    kwargs: dict[str, Any] = {}
    flags = list(options)
    while flags:  # the same options as keywords: --master-dtype float32 -> master_dtype="float32"
        flag = flags.pop(0)
        key = flag[2:].replace("-", "_")
        kwargs[key] = True if key == "quick" else flags.pop(0)
    for path in _forms(local, s3, name):
        code, cli, err = _cli("audit", path, *options)
        report = ckptaudit.audit(path, **kwargs)
        assert code in (0, 1), err
        assert json.loads(report.to_json()) == cli, path
        assert report.ok == (code == 0), (path, report.describe())
        assert report.path == local_path_of(path)
    # The helper for pytest judges the same report: it returns it where the CLI exits 0, raises with it where 1.
    code, cli, _ = _cli("audit", f"{s3}/{name}", *options)
    if code == 0:
        assert json.loads(assert_checkpoint_ok(f"{s3}/{name}", **kwargs).to_json()) == cli
    else:
        with pytest.raises(AuditFailed) as info:
            assert_checkpoint_ok(f"{s3}/{name}", **kwargs)
        assert json.loads(info.value.report.to_json()) == cli


def test_compare_gives_the_cli_report_for_urls_too(local: dict[str, Path], s3: str) -> None:
    for ref, cand in [(str(local["good.pt"]), f"{s3}/good.pt"), (f"{s3}/good.pt", f"file://{local['bad.pt']}")]:
        code, cli, err = _cli("compare", ref, cand)
        report = ckptaudit.compare(ref, cand)
        assert code in (0, 1), err
        assert json.loads(report.to_json()) == cli
        assert report.ok == (code == 0)
    assert not ckptaudit.compare(str(local["good.pt"]), f"{s3}/bad.pt").ok


def test_a_missing_path_is_the_same_refusal_and_a_missing_object_a_clear_error(local: dict[str, Path],
                                                                                   s3: str) -> None:
    missing = str(local["good.pt"].parent / "nope.pt")
    for path in (missing, f"file://{missing}"):
        code, _, err = _cli("audit", path)
        assert code == 2 and "no such file or directory" in err
        with pytest.raises(FileNotFoundError, match="does not exist; give the path of a checkpoint"):
            ckptaudit.audit(path)
    code, _, err = _cli("audit", f"{s3}/no-such.pt")
    assert code == 2 and f"{s3}/no-such.pt" in err
    with pytest.raises(OSError, match=r"no-such\.pt"):
        ckptaudit.audit(f"{s3}/no-such.pt")


def test_the_guards_audit_takes_urls_and_gives_the_cli_report(local: dict[str, Path], s3: str,
                                                              tmp_path: Path) -> None:
    from ckptaudit.integrations.guard_worker import audit_to_file

    for name in ("good.pt", "bad.pt"):
        where = tmp_path / f"{name}.json"
        gist = audit_to_file(f"{s3}/{name}", str(where), {"jobs": 1})
        code, cli, _ = _cli("audit", f"{s3}/{name}")
        assert json.loads(where.read_text()) == cli
        assert gist["ok"] == (code == 0)
