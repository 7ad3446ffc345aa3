"""Start-up: the offline paths (audit, compare, latest, --help) do not import torch, so a small file audits in a
blink and ``latest`` in a shell loop stays cheap. Each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptaudit.api import audit
from ckptaudit.schema import VALIDATE_ENV
from real_checkpoints import safetensors_file


def _run_cli(*argv: str) -> tuple[set[str], str]:
    """Run ``ckptaudit.cli.main(argv)`` in a fresh interpreter as a user would (without the suite's report
    validation, which imports jsonschema): the modules imported by the end, and its stdout."""
    code = ("import io, sys\n"
            "from ckptaudit.cli import main\n"
            "out = io.StringIO()\n"
            f"rc = main({list(argv)!r}, stdout=out, stderr=io.StringIO())\n"
            "modules = sorted(sys.modules)\n"
            "import json\n"  # after the modules are listed: whether the command imported json is tested
            "print(json.dumps([rc, modules, out.getvalue()]))\n")
    env = {k: v for k, v in os.environ.items() if k != VALIDATE_ENV}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rc, modules, stdout = json.loads(run.stdout.strip().splitlines()[-1])
    assert rc in (0, 1), (argv, rc)
    return set(modules), stdout


def _torch_imported(*argv: str) -> bool:
    """Whether ``ckptaudit.cli.main(argv)`` in a fresh interpreter imported torch."""
    modules, _ = _run_cli(*argv)
    return any(m == "torch" or m.startswith("torch.") for m in modules)


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
    modules = ["ckptaudit.cli", "ckptaudit.auditing.judge", "ckptaudit.comparing", "ckptaudit.latest",
               "ckptaudit.report", "ckptaudit.auditing.tensor_scan", "ckptaudit.layouts", "ckptaudit.formats",
               "ckptaudit.auditing.distributed"]
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


# -- imported only when needed ------------------------------------------------------------------------------------
# What a small offline audit must not import: NumPy (small tensors are scanned without it, see
# tests/auditing/test_tensor_scan_small.py), rich (only the table renderer), a thread pool (a small scan runs on one thread),
# the distributed audit and the remote machinery (docs/performance.md, "Start-up"), and the readers and layout rules of
# formats the checkpoint is not in.

ALWAYS_LAZY = {"numpy", "rich", "concurrent.futures", "logging", "tempfile", "shutil", "difflib",
               # OpenSSL (~4 ms: only a 5,000-digit key's name is hashed), the leased map's signal (nothing mapped)
               "hashlib", "_hashlib", "signal",
               "ckptaudit.layouts.megatron.layout", "ckptaudit.layouts.deepspeed.layout",
               # the distributed audit (only under torchrun) and the remote machinery (only for a URL)
               "ckptaudit.auditing.distributed", "ckptaudit.auditing.share", "ckptaudit.formats.remote.staging",
               "ckptaudit.formats.remote.objects"}
LAZY_FOR_FILES = {"ckptaudit.formats.dcp.reader", "ckptaudit.formats.dcp.metadata", "ckptaudit.formats.deepspeed.reader"}
"""(A directory is told from a DeepSpeed one by its file names, in ``ckptaudit.formats.deepspeed.reader``.)"""


@pytest.fixture(scope="module")
def small_training_state(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model with its AdamW state (moments and step counters) after one step, as torch.save and
    single-process DCP, and the model as safetensors."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("small")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    sd, osd = model.state_dict(), opt.state_dict()
    torch.save({"model": sd, "optimizer": osd}, out / "ckpt.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": sd, "optim": osd}, checkpoint_id=str(out / "dcp"))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return {"torch.save": out / "ckpt.pt", "dcp": out / "dcp", "safetensors": out / "model.safetensors"}


def _essence(report_json: str) -> tuple[object, object]:
    doc = json.loads(report_json)
    return doc["findings"], doc["tensors"]


@pytest.mark.parametrize("fmt", ["torch.save", "dcp", "safetensors"])
def test_small_audit_imports_only_what_the_checkpoint_needs(small_training_state: dict[str, Path], fmt: str) -> None:
    path = small_training_state[fmt]
    modules, stdout = _run_cli("audit", str(path), "--format", "json")
    lazy = ALWAYS_LAZY | (LAZY_FOR_FILES if fmt != "dcp" else set())
    if fmt == "safetensors":  # a JSON header: no pickle reader at all
        lazy |= {"ckptaudit.formats.pickle.unpickler", "ckptaudit.formats.zip.archive"}
    if fmt == "torch.save":  # no JSON read (a manifest or a serving artifact's gate is read where it exists)
        lazy |= {"ckptaudit.formats.io.safejson"}
    assert {m.split(".")[0] if m.split(".")[0] in ("numpy", "rich") else m for m in modules} & lazy == set()
    # The same report as the audit in this process, where NumPy is imported and every tensor takes its path.
    assert "numpy" in sys.modules
    assert _essence(stdout) == _essence(audit(str(path)).to_json())
    assert json.loads(stdout)["tensors"]  # the tensors were read


def test_help_imports_no_engine() -> None:
    modules, _ = _run_cli("--help")
    assert modules & {"ckptaudit.auditing", "ckptaudit.formats", "ckptaudit.findings", "numpy", "rich", "xxhash"} == set()


def test_a_small_audit_printed_as_a_table_into_a_pipe_imports_no_rich(small_training_state: dict[str, Path]) -> None:
    """The table is drawn without rich where the output is no terminal (``ckptaudit.report.plain``; rich's import
    was about a third of the start-up), with rich's characters (``tests/report/test_table_plain.py``)."""
    modules, stdout = _run_cli("audit", str(small_training_state["torch.save"]))
    assert not {m for m in modules if m == "rich" or m.startswith("rich.")}
    assert not {m for m in modules if m == "json" or m.startswith("json.")}  # nor json: no JSON read or written
    assert "findings" in stdout and "━" in stdout


def test_the_running_command_alone_gets_the_flags_the_whole_parser_gives_it() -> None:
    """``main`` builds the parser of the command that runs (``build_parser(command)``): its flags, defaults, choices
    and help are those of the same command in the whole parser (which ``--help`` and tests/test_docs.py read)."""
    import argparse

    from ckptaudit.cli.parser import build_parser

    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return dict(sub.choices)

    def flags(parser: argparse.ArgumentParser) -> list[tuple[object, ...]]:
        return [(a.option_strings, a.dest, a.default, a.choices, a.help, a.metavar, a.nargs, a.type, type(a).__name__)
                for a in parser._actions]

    whole = commands(build_parser())
    assert len(whole) == 9
    for name, parser in whole.items():
        alone = commands(build_parser(name))
        assert list(alone) == [name]
        assert flags(alone[name]) == flags(parser), name
        assert alone[name].format_help() == parser.format_help()
    assert list(commands(build_parser("no-such-command"))) == list(whole)  # argparse's "invalid choice" lists them
