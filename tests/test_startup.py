"""Start-up: the offline paths (audit, compare, latest, --help) do not import torch, so a small file audits in a
blink and ``latest`` in a shell loop stays cheap. Each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from real_checkpoints import safetensors_file


def _torch_imported(*argv: str) -> bool:
    """Run ``ckptaudit.cli.main(argv)`` in a fresh interpreter; whether torch was imported by the end."""
    code = ("import io, json, sys\n"
            "from ckptaudit.cli import main\n"
            f"rc = main({list(argv)!r}, stdout=io.StringIO(), stderr=io.StringIO())\n"
            "print(json.dumps([rc, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))]))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    rc, torch_modules = json.loads(run.stdout.strip().splitlines()[-1])
    assert rc in (0, 1), (argv, rc)
    return bool(torch_modules)


@pytest.fixture(scope="module")
def small_safetensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return safetensors_file(tmp_path_factory.mktemp("startup") / "model.safetensors")


@pytest.mark.parametrize("argv", [["--help"], ["audit", "--help"], ["compare", "--help"], ["latest", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    assert not _torch_imported(*argv)


def test_latest_on_an_empty_directory_does_not_import_torch(tmp_path: Path) -> None:
    assert not _torch_imported("latest", str(tmp_path))


def test_audit_and_compare_of_safetensors_do_not_import_torch(small_safetensors: Path) -> None:
    assert not _torch_imported("audit", str(small_safetensors), "--format", "json")
    assert not _torch_imported("compare", str(small_safetensors), str(small_safetensors), "--format", "json")


def test_offline_modules_do_not_import_torch() -> None:
    modules = ["ckptaudit.cli", "ckptaudit.audit", "ckptaudit.compare", "ckptaudit.store.latest", "ckptaudit.report",
               "ckptaudit.records", "ckptaudit.layouts", "ckptaudit.formats", "ckptaudit.distaudit"]
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "False"


def test_audit_of_a_torch_save_file_does_not_import_torch(scale_checkpoints: dict[str, Path]) -> None:
    assert not _torch_imported("audit", str(scale_checkpoints["torch.save"]), "--format", "json")


def test_audit_of_a_dcp_directory_does_not_import_torch(scale_checkpoints: dict[str, Path]) -> None:
    assert not _torch_imported("audit", str(scale_checkpoints["dcp"]), "--format", "json")


def test_compare_of_torch_save_and_dcp_does_not_import_torch(scale_checkpoints: dict[str, Path]) -> None:
    assert not _torch_imported("compare", str(scale_checkpoints["dcp"]), str(scale_checkpoints["torch.save"]),
                               "--format", "json")
