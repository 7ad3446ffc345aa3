"""DCP items are found by their flattened keys, as ``torch.distributed.checkpoint.load`` finds them; ``planner_data``
(where each key sits in the nested dict) is accepted only where it agrees with the key.

Each case is a real ``dcp.save`` whose ``.metadata`` this test rewrites (unpickled with plain pickle: the test
wrote the file itself) and pickles back.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptaudit
from ckptaudit.formats.dcp.reader import UnsafeCheckpointError, check_metadata_safe, read_dcp
from ckptaudit.formats.io.tensors import TensorData
from runs import cli

CORRUPT = "integrity.corrupt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 8, generator=g).to(torch.bfloat16).float()  # fp32 with its low bits lost
    state = {"model": {"weight": weight, "bias": torch.randn(8, generator=g)},
             "decoy": torch.randn(8, 8, generator=g),
             "layers": [torch.randn(2, generator=g), torch.randn(2, generator=g)],
             "a.b": {"c": torch.randn(3, generator=g)}, "opt": 1, "opt.x": torch.randn(2, generator=g),
             "": torch.randn(1, generator=g), "step": 3}
    root = tmp_path_factory.mktemp("keypaths") / "base"
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    return root


def _metadata(root: Path) -> Any:
    with open(root / ".metadata", "rb") as fh:
        return pickle.load(fh)  # the test's own file


def _variant(saved: Path, dest: Path, edit: Callable[[Any], None]) -> Path:
    shutil.copytree(saved, dest)
    md = _metadata(saved)
    edit(md)
    (dest / ".metadata").write_bytes(pickle.dumps(md))
    return dest


def _set(key: str, path: Any) -> Callable[[Any], None]:
    def edit(md: Any) -> None:
        md.planner_data[key] = path
    return edit


def _replace(value: Any) -> Callable[[Any], None]:
    def edit(md: Any) -> None:
        md.planner_data = value
    return edit


def test_the_real_save_nests_by_its_key_paths(saved: Path) -> None:
    read = read_dcp(str(saved))
    assert not [f for f in read.findings if f.code == CORRUPT], read.findings
    assert read.part is not None
    tree = read.part.tree
    assert isinstance(tree["model"]["weight"], TensorData) and isinstance(tree["a.b"]["c"], TensorData)
    assert isinstance(tree["layers"], list) and len(tree["layers"]) == 2
    assert tree["opt"] == 1 and isinstance(tree["opt.x"], TensorData) and isinstance(tree[""], TensorData)


DISAGREEMENTS: dict[str, tuple[Callable[[Any], None], str]] = {
    # the decoy of issue 36: an item filed under the path of another, listed after it
    "decoy": (_set("decoy", ("model", "weight")), "joins to another key than 'decoy'"),
    "inside-another-value": (_set("opt.x", ("opt", "x")), "inside the value of 'opt'"),
    "index-beside-name": (_set("layers.1", ("layers", "1")), "a list index and a name sit side by side"),
    "index-too-large": (_set("layers.1", ("layers", 10**5000)), "neither a name nor a list index below"),
    "negative-index": (_set("layers.1", ("layers", -1)), "neither a name nor a list index below"),
    "bool-index": (_set("layers.1", ("layers", True)), "neither a name nor a list index below"),
    "starts-with-index": (_set("layers.0", (0, "layers")), "torch's flattening starts every path with a name"),
    "not-a-path": (_set("step", "step"), "not a key path"),
    "empty-path": (_set("step", ()), "not a key path"),
    "not-a-mapping": (_replace(["step"]), "not a mapping of keys"),
    "key-not-a-name": (_set(7, ("step",)), "which is not a key"),  # type: ignore[arg-type]
    "dot-moved": (_set("a.b.c", ("a.b.", "c")), "joins to another key"),
}


@pytest.mark.parametrize("case", sorted(DISAGREEMENTS))
def test_a_planner_path_that_disagrees_with_its_key_is_corrupt_and_never_an_overwrite(
        case: str, saved: Path, tmp_path: Path) -> None:
    edit, fragment = DISAGREEMENTS[case]
    root = _variant(saved, tmp_path / case, edit)
    read = read_dcp(str(root))
    bad = [f for f in read.findings if f.code == CORRUPT and f.subject == ".metadata"]
    assert bad and fragment in bad[0].message, read.findings
    assert "finds every item by its key" in bad[0].message
    # Every item stays under its own key at the top: nothing took another's place.
    assert read.part is not None
    tree = read.part.tree
    md = _metadata(saved)
    assert set(tree) == set(md.state_dict_metadata)
    assert tree["opt"] == 1 and tree["step"] == 3
    # The live loaders refuse what the audit calls corrupt.
    with pytest.raises(UnsafeCheckpointError, match="planner_data"):
        check_metadata_safe(str(root))
    if case == "decoy":
        import torch

        from ckptaudit.formats.torchload import vetted_dcp_load

        with pytest.raises(UnsafeCheckpointError, match="planner_data"):
            vetted_dcp_load({"model": {"weight": torch.zeros(8, 8)}}, root)


def test_list_indices_past_the_item_count_are_accepted(tmp_path: Path) -> None:
    # torch's flattening visits every element of a list holding a tensor; an empty dict among them leaves no key,
    # so an honest index may exceed the number of items
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "empties"
    dcp.save({"layers": [{}, {}, {}, torch.ones(2)]}, checkpoint_id=str(root), no_dist=True)
    assert _metadata(root).planner_data == {"layers.3": ("layers", 3)}
    read = read_dcp(str(root))
    assert not [f for f in read.findings if f.code == CORRUPT], read.findings
    assert read.part is not None and isinstance(read.part.tree["layers"][3], TensorData)


@pytest.mark.parametrize("case", ["all-dots-split", "no-planner-data", "key-absent", "extra-entry"])
def test_planner_paths_that_agree_with_their_keys_are_accepted(case: str, saved: Path, tmp_path: Path) -> None:
    edits: dict[str, Callable[[Any], None]] = {
        "all-dots-split": _set("a.b.c", ("a", "b", "c")),  # another path that joins back to the same key
        "no-planner-data": _replace(None),
        "key-absent": lambda md: md.planner_data.pop("model.bias"),
        "extra-entry": _set("nothing.here", ("model", "weight")),  # names no item: no reading uses it
    }
    root = _variant(saved, tmp_path / case, edits[case])
    read = read_dcp(str(root))
    assert not [f for f in read.findings if f.code == CORRUPT], read.findings
    assert read.part is not None
    tree = read.part.tree
    if case == "all-dots-split":
        assert isinstance(tree["a"]["b"]["c"], TensorData)
    elif case == "no-planner-data":
        assert isinstance(tree["model.weight"], TensorData) and isinstance(tree["layers.0"], TensorData)
    elif case == "key-absent":
        assert isinstance(tree["model.bias"], TensorData) and isinstance(tree["model"]["weight"], TensorData)
    check_metadata_safe(str(root))


def test_the_decoy_is_judged_on_the_real_weight_from_the_api_and_the_cli(saved: Path, tmp_path: Path) -> None:
    clean = ckptaudit.audit(saved)
    assert "precision.bf16-rounded" in {f.code for f in clean.findings}
    root = _variant(saved, tmp_path / "decoy", _set("decoy", ("model", "weight")))
    report = ckptaudit.audit(root)
    codes = {(f.code, f.subject) for f in report.findings}
    assert ("integrity.corrupt", ".metadata") in codes and ("precision.bf16-rounded", "model.weight") in codes
    code, out, err = cli("audit", str(root), "--format", "json", "--no-progress")
    assert code == 1 and "Traceback" not in err
    found = {(f["code"], f["subject"]) for f in json.loads(out)["findings"]}
    assert ("precision.bf16-rounded", "model.weight") in found and ("integrity.corrupt", ".metadata") in found


def test_the_decoy_is_judged_the_same_under_torchrun(saved: Path, tmp_path: Path) -> None:
    from runs import torchrun

    root = _variant(saved, tmp_path / "decoy", _set("decoy", ("model", "weight")))
    code, out, _err = cli("audit", str(root), "--format", "json", "--no-progress", "--jobs", "1")
    run = torchrun(2, "audit", str(root), "--format", "json", "--no-progress", cwd=tmp_path)
    assert run.returncode == code == 1, run.stderr[-3000:]
    def findings(text: str) -> list[str]:
        return sorted(json.dumps(f, sort_keys=True) for f in json.loads(text)["findings"])

    assert findings(run.stdout) == findings(out)
    assert "precision.bf16-rounded" in {f["code"] for f in json.loads(run.stdout)["findings"]}
    assert not re.search(r'File ".*ckptaudit', run.stderr), run.stderr[-3000:]


def test_a_size_or_storage_offset_torch_refuses_is_malformed(saved: Path, tmp_path: Path) -> None:
    def list_size(md: Any) -> None:
        md.state_dict_metadata["decoy"].size = [8, 8]

    root = _variant(saved, tmp_path / "size", list_size)
    read = read_dcp(str(root))
    assert any(f.code == CORRUPT and "not torch.Size" in f.message for f in read.findings), read.findings

    def list_offset(md: Any) -> None:
        key = next(k for k in md.storage_data if k.fqn == "decoy")
        object.__setattr__(key, "offset", [0, 0])  # after the dict hashed it: pickled as a list

    root = _variant(saved, tmp_path / "offset", list_offset)
    with pytest.raises(TypeError, match="unhashable"):
        _metadata(root)  # torch's own reading of it fails
    read = read_dcp(str(root))
    assert any(f.code == CORRUPT and "offset is a list" in f.message for f in read.findings), read.findings
