"""Hostile DeepSpeed tag folders (issue 25), made by mutating the files DeepSpeed itself wrote (``ds`` fixture,
``lib_writers.py deepspeed``): the pickles are loaded here (our own trusted files, with DeepSpeed importable),
changed, and saved again with ``torch.save``, so every byte is still written by torch's own pickler (shared
objects memoised, as a real save shares them).

Used by ``tests/hostile/test_hostile_deepspeed.py`` and ``tests/support/hostile_figures.py``.
"""

from __future__ import annotations

import collections
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "mp_rank_00_model_states.pt"


def optim_name(rank: int) -> str:
    return f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def load(path: Path) -> Any:
    """One of DeepSpeed's own files, loaded whole (it pickles DeepSpeed's classes: only our own writer's files)."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return torch.load(path, weights_only=False)


def mutate(src: Path, dst: Path, edit: Callable[[dict[str, Any], str], None], pattern: str = "*.pt") -> Path:
    """A copy of the tag folder ``src`` at ``dst`` with ``edit(state, file name)`` applied to each file matching
    ``pattern``; returns ``dst``."""
    import torch

    shutil.copytree(src, dst)
    for f in sorted(dst.glob(pattern)):
        state = load(f)
        edit(state, f.name)
        torch.save(state, f)
    return dst


def many_ranks(src: Path, dst: Path, *, ranks: int, params: int, seed: int = 0) -> Path:
    """A ZeRO-2 tag folder of ``ranks`` data-parallel ranks and ``params`` one-element parameters in one group
    (``params`` a multiple of ``2 * ranks``: no padding), every file derived from the real ZeRO-2 save ``src``:
    each rank's flat fp32 partition and moments hold ``params // ranks`` elements. Parameter ``p.i``'s master is
    element ``i`` of the concatenated partitions, which :func:`expected_master` gives."""
    import torch

    assert params % (2 * ranks) == 0
    dst.mkdir(parents=True)
    per_rank = params // ranks
    model = load(src / MODEL)
    one = torch.Size([1])  # one object: torch's pickler memoises it, as DeepSpeed's param_shapes share sizes
    model["param_shapes"] = [collections.OrderedDict((f"p.{i}", one) for i in range(params))]
    model["module"] = collections.OrderedDict()
    model["dp_world_size"] = ranks
    torch.save(model, dst / MODEL)
    template = load(src / optim_name(0))
    for r in range(ranks):
        osd = template["optimizer_state_dict"]
        osd["single_partition_of_fp32_groups"] = [expected_slice(r, per_rank, seed)]
        base = osd["base_optimizer_state"]
        entry = base["state"][0]
        base["state"] = {0: {"step": entry["step"], "exp_avg": expected_slice(r, per_rank, seed + 1),
                             "exp_avg_sq": expected_slice(r, per_rank, seed + 2).abs()}}
        # zero_to_fp32 reads the paddings from rank 0's file only: the others leave them out (smaller files).
        osd["param_alignment_paddings"] = [[0] * params] if r == 0 else None
        osd["group_paddings"] = [0]
        osd["partition_count"] = [ranks]
        osd["param_slice_mappings"] = [collections.OrderedDict()]
        torch.save(template, dst / optim_name(r))
    return dst


def expected_slice(rank: int, per_rank: int, seed: int) -> Any:
    """Rank ``rank``'s partition in :func:`many_ranks` (distinct values: a misplaced element is seen)."""
    import torch

    return torch.arange(rank * per_rank, (rank + 1) * per_rank, dtype=torch.float32) + seed * 0.25


def empty_params(src: Path, dst: Path, *, count: int) -> Path:
    """The real ZeRO-2 tag folder ``src`` with ``count`` zero-size parameters declared before its real ones in
    ``param_shapes`` (one shared ``torch.Size([0])``, memoised by the pickler: a few bytes per entry), and the
    matching zero alignment paddings in every optimizer shard: a layout DeepSpeed's ``zero_to_fp32`` accepts."""
    import torch

    dst.mkdir(parents=True)
    model = load(src / MODEL)
    empty = torch.Size([0])
    (real,) = model["param_shapes"]
    model["param_shapes"] = [collections.OrderedDict([*((f"e.{i}", empty) for i in range(count)), *real.items()])]
    torch.save(model, dst / MODEL)
    for f in sorted(src.glob("*optim_states.pt")):
        state = load(f)
        osd = state["optimizer_state_dict"]
        osd["param_alignment_paddings"] = [[0] * count + list(osd["param_alignment_paddings"][0])]
        torch.save(state, dst / f.name)
    return dst


HOSTILE_VALUES: tuple[Any, ...] = (10**400, -1, -(10**400), float("nan"), float("inf"), 2**64, "x", None, [3],
                                   {"a": 1}, 1.5, True)
"""What a damaged or crafted record may hold where DeepSpeed wrote a number, a string, a list or a dict."""


def record_leaves(obj: Any, path: tuple[Any, ...] = (), depth: int = 0) -> list[tuple[Any, ...]]:
    """The paths of every number, string and ``None`` in the plain containers (dicts, lists) of a loaded
    DeepSpeed file: the values its readers take from the record rather than from tensors."""
    if depth > 8:
        return []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in record_leaves(v, (*path, k), depth + 1)]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in record_leaves(v, (*path, i), depth + 1)]
    return [path] if obj is None or isinstance(obj, (bool, int, float, str)) else []


def set_leaf(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
