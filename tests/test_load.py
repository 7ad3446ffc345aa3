"""The stable safe loader, ``ckptaudit.load``: it returns what torch (or safetensors) would, for torch.save files,
safetensors files, DCP directories (whole, or into a template) and a stack's folder; it refuses what torch would
run, naming the file and the audit's finding, and nothing runs; the old import path still works, with a
``DeprecationWarning``."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hostile_files as hf
from ckptaudit.load import UnsafeCheckpointError, dcp_reader, load, load_dcp
from real_checkpoints import dcp_checkpoint, trained


def _same(a: Any, b: Any) -> None:
    """Equal values, tensor by tensor (dtype and bits too), container by container."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_a_torch_save_file_loads_as_torch_load_returns_it(tmp_path: Path) -> None:
    path = trained(tmp_path / "ckpt.pt")
    _same(load(path), torch.load(path, weights_only=True, map_location="cpu"))


def test_a_safetensors_file_loads_as_safetensors_returns_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(3, 4), "b": torch.randn(4).bfloat16()}, str(path))
    _same(load(path), dict(load_file(str(path))))
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"bad\.safetensors is not a readable safetensors file"):
        load(tmp_path / "bad.safetensors")


def test_a_dcp_directory_loads_whole_nested_as_saved_or_into_a_template(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    path = dcp_checkpoint(tmp_path / "step-2", extra={"train": {"step": 2, "note": "hello"}})
    whole = load(path)
    assert set(whole) == {"model", "optim", "step", "train"}
    assert whole["train"] == {"step": 2, "note": "hello"}
    # What DCP itself loads into a template of the same shapes: the same bits.
    template = {"model": {k: torch.zeros_like(v) for k, v in whole["model"].items()}, "step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, checkpoint_id=str(path))
    _same(whole["model"], template["model"])
    _same(whole["step"], template["step"])
    assert set(whole["optim"]["state"]) == set(whole["model"])  # every parameter's moments (no buffers here)
    assert set(whole["optim"]["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    # load_dcp and dcp_reader fill a template in place, as dcp.load does.
    mine = {"model": {k: torch.zeros_like(v) for k, v in whole["model"].items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_dcp(mine, path)
        _same(mine["model"], whole["model"])
        again = {"model": {k: torch.zeros_like(v) for k, v in whole["model"].items()}}
        dcp.load(again, storage_reader=dcp_reader(path))
    _same(again["model"], whole["model"])
    with pytest.raises(TypeError, match="chooses the storage reader itself"):
        load_dcp(mine, path, checkpoint_id=str(path))


def test_a_folder_loads_file_by_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    root = tmp_path / "checkpoint-2"
    root.mkdir()
    trained(root / "optimizer.pt")
    save_file({"w": torch.ones(2)}, str(root / "model.safetensors"))
    (root / "config.json").write_text("{}")
    dcp_checkpoint(root / "dcp")
    got = load(root)
    assert list(got) == ["dcp", "model.safetensors", "optimizer.pt"]
    _same(got["optimizer.pt"], torch.load(root / "optimizer.pt", weights_only=True))
    assert set(got["dcp"]) == {"model", "optim", "step"}


@pytest.mark.parametrize("kind", ["os.system", "exec", "stack_global_memo"])
def test_what_torch_would_run_is_refused_naming_the_file_and_the_finding(tmp_path: Path, kind: str) -> None:
    sentinel = tmp_path / "pwned"
    template = trained(tmp_path / "template.pt")
    bad = tmp_path / "bad.pt"
    hf.torch_save_payload(kind, str(sentinel), bad, template)
    with pytest.raises(UnsafeCheckpointError) as info:
        load(bad)
    message = str(info.value)
    assert str(bad) in message and "refusing to load it" in message
    assert "the audit's finding: security." in message, message
    # In a folder too, and the DCP loaders refuse a hostile .metadata before unpickling anything.
    with pytest.raises(UnsafeCheckpointError, match=r"bad\.pt"):
        load(tmp_path)
    dcp_dir = dcp_checkpoint(tmp_path / "dcp")
    (dcp_dir / ".metadata").write_bytes(hf.payload_pickle(kind, str(sentinel)))
    for attempt in (lambda: load(dcp_dir), lambda: load_dcp({}, dcp_dir), lambda: dcp_reader(dcp_dir)):
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata") as info:
            attempt()
        assert "the audit's finding: security." in str(info.value), str(info.value)
    assert not sentinel.exists()


def test_a_missing_path_and_a_non_checkpoint_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.pt' does not exist"):
        load(tmp_path / "nope.pt")
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"notes\.pt"):
        load(tmp_path / "notes.pt")


def test_the_old_import_path_still_works_with_a_deprecation_warning(tmp_path: Path) -> None:
    import ckptaudit.formats.torchload as old

    path = trained(tmp_path / "ckpt.pt")
    for name in ("safe_torch_load", "safe_dcp_load", "safe_dcp_reader"):
        with pytest.warns(DeprecationWarning, match=rf"torchload.{name} is internal and deprecated; use ckptaudit.load"):
            fn = getattr(old, name)
        assert callable(fn)
    with pytest.warns(DeprecationWarning):
        from ckptaudit.formats.torchload import safe_torch_load  # the import the docs of 0.x taught
    _same(safe_torch_load(path), load(path))
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018
    assert os.path.exists(path)


def test_the_loader_is_reached_from_the_package_root_without_importing_torch_early() -> None:
    import subprocess
    import sys

    code = ("import sys, ckptaudit; before = 'torch' in sys.modules; m = ckptaudit.load; "
            "print(before, m.__name__, callable(m.load))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "ckptaudit.load", "True"]
