"""``bench/sim_dcp.py`` writes the DCP save a real FSDP2 job writes: held here to a real 2-rank FSDP2 save of
Llama-shaped parameters (uneven shards; AdamW under a scheduler; the documented state dict).

The simulator's ``.metadata`` (torch's ``Metadata``, pickled by torch) equals the real one but for the save's id,
every item lies at the same offset with the same length in the same file, the simulator's state dict is the
real one's (keys, param groups, steps, RNG states), and with the real shards' values the simulated checkpoint
audits exactly as the real one.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.launch import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

FAST: dict[str, Any] = {"start_method": "forkserver",
                        "preload": ("torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "sim_jobs")}
# Uneven row splits over 2 ranks (7, 5, 3 rows), every Llama parameter kind.
DIMS = {"layers": 2, "hidden": 6, "ffn": 10, "vocab": 7, "kv": 3}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import sim_dcp

    import sim_jobs

    out = tmp_path_factory.mktemp("sim")
    params = sim_dcp.Llama(**DIMS).parameters()
    states = launch(sim_jobs.save_llama, 2, (str(out / "real"), params), timeout_s=240, pg_timeout_s=120, **FAST)
    return {"dir": out, "params": params, "states": states}


def _metadata(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()  # written by this test: trusted


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    import sim_dcp

    return sim_dcp._flat(state)


def _audit(path: Path) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", str(path), "--format", "json", "--no-progress", "--jobs", "1"], stdout=out, stderr=err)
    assert code in (0, 1), err.getvalue()
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


def _same_layout(real: Path, sim: Path) -> None:
    a, b = _metadata(real), _metadata(sim)
    assert b.state_dict_metadata == a.state_dict_metadata
    assert b.planner_data == a.planner_data
    assert b.storage_data == a.storage_data  # every item: same file, offset and length
    assert sorted(os.listdir(sim)) == sorted(os.listdir(real))
    for name in os.listdir(real):  # .metadata too: as many bytes (its save id is the one difference)
        assert (sim / name).stat().st_size == (real / name).stat().st_size, name


def test_the_simulated_state_dict_is_the_real_one(real: dict[str, Any]) -> None:
    import sim_dcp
    import torch

    for rank, got in enumerate(real["states"]):
        sim = sim_dcp.documented_state(rank, real["params"], step=1)
        flat_real, flat_sim = _flat(got), _flat(sim)
        assert list(flat_sim) == list(flat_real)
        assert sim["optim"]["param_groups"] == got["optim"]["param_groups"]
        assert sim["train_state"] == got["train_state"]
        assert sim["rng"][f"rank{rank}"]["python"] == got["rng"][f"rank{rank}"]["python"]
        assert torch.equal(sim["rng"][f"rank{rank}"]["torch"], got["rng"][f"rank{rank}"]["torch"])
        for name, _ in real["params"]:
            assert torch.equal(sim["optim"]["state"][name]["step"], got["optim"]["state"][name]["step"])
            for leaf in (got["model"][name], got["optim"]["state"][name]["exp_avg"]):
                assert leaf.shape == sim_dcp._local_chunk(sim["model"][name].shape, 2, rank)[0]


def test_zero_shards_lie_where_the_real_shards_lie(real: dict[str, Any]) -> None:
    import sim_dcp

    sim = real["dir"] / "sim1"  # a path as long as the real one's: .metadata records it
    # --sparse-over 1: every shard's data a hole, yet each item's offsets and lengths are the real ones
    sim_dcp.write(str(sim), 2, lambda r: sim_dcp.documented_state(r, real["params"], step=1), sparse_over=1)
    _same_layout(real["dir"] / "real", sim)
    report = _audit(sim)
    assert report["counts"]["error"] == 0, report["findings"]


def test_with_the_real_values_the_simulated_save_audits_as_the_real_one(real: dict[str, Any]) -> None:
    import sim_dcp

    sim = real["dir"] / "sim2"
    shards = [_flat(s) for s in real["states"]]
    sim_dcp.write(str(sim), 2, lambda r: sim_dcp.documented_state(r, real["params"], step=1),
                  values=lambda r, fqn: shards[r][fqn])
    _same_layout(real["dir"] / "real", sim)
    got, expected = _audit(sim), _audit(real["dir"] / "real")
    assert got.pop("path") != expected.pop("path")
    assert got == expected  # every tensor's hash and precision, every finding


def test_the_command_line_writes_a_many_rank_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sim_dcp

    out = tmp_path / "s"
    assert sim_dcp.main(["--out", str(out), "--ranks", "16", "--layers", "1", "--hidden", "8", "--ffn", "12",
                         "--vocab", "20", "--kv", "4"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ranks"] == 16 and len([n for n in os.listdir(out) if n.endswith(".distcp")]) == 16
    report = _audit(out)
    assert report["counts"]["error"] == 0, report["findings"]
    assert len(report["tensors"]) == info["tensors"]
