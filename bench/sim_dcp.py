"""A DCP save of a many-rank FSDP2 job, written on one machine by torch's own planner and writer code.

    .venv/bin/python bench/sim_dcp.py --out /tmp/sim-1024 --ranks 1024 --layers 8     # 8 layers of Llama-3-8B
    .venv/bin/python bench/sim_dcp.py --out /tmp/sim-1024 --ranks 1024 --layers 32    # all of Llama-3-8B

The training state is the documented path's (``ckptaudit.exporters.documented``: ``get_state_dict`` +
``torch.distributed.checkpoint.save``): the model's parameters and AdamW's two moments sharded on dimension 0
over every rank (FSDP2's ``Shard(0)``, uneven splits and empty shards included), a ``step`` tensor per parameter
and the param groups (replicated: DCP keeps one copy), the train step, and each rank's RNG state (its own keys).

What is torch's and what is not:

- each rank's local plan holds the ``WriteItem`` s that ``create_default_local_save_plan`` makes (a shard's size
  and offsets by DTensor's own ``_compute_local_shape_and_global_offset``, the one private function used here,
  for a mesh of ``--ranks``); the state dict is flattened by ``DefaultSavePlanner.set_up_planner``; the global
  plan and the ``Metadata`` are ``DefaultSavePlanner.create_global_plan``'s (deduplication, index hints,
  validation); the storage prefixes are ``FileSystemWriter.prepare_global_plan``'s; ``.metadata`` is pickled by
  ``FileSystemWriter.finish``;
- the data files are written here, in ``FileSystemWriter``'s order and layout (one ``__<rank>_0.distcp`` per
  rank: its non-tensor items, then its tensor items, each a ``torch.save`` archive at the offset the
  ``_StorageInfo`` records): every shard of the model and of the moments holds zeros, and its archive is the
  bytes ``torch.save`` writes for a zero tensor of its shape (made once per shape and dtype), with the tensor
  data left as a hole (``--sparse-over``, default 64 KiB: a sparse file reads as zeros and takes no disk).
  Small tensors (steps, RNG states) hold their real values.

``tests/bench/test_bench_sim.py`` holds this writer to a real 2-rank FSDP2 save: the same ``.metadata`` and the same
item offsets and lengths. A sparse checkpoint's data reads as zeros from no disk: it measures the metadata path
and the plan, not I/O.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pickle
import random
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Sharded:
    """A parameter (or a moment) sharded on dimension 0 over every rank, as FSDP2 keeps it (a DTensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Llama:
    """Llama-3 shapes (Hugging Face parameter names); the defaults are Llama-3-8B's."""

    layers: int = 32
    hidden: int = 4096
    ffn: int = 14336
    vocab: int = 128256
    kv: int = 1024
    """Width of the key and value projections (8 key-value heads of 128)."""

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        h, f, v, kv = self.hidden, self.ffn, self.vocab, self.kv
        out = [("model.embed_tokens.weight", (v, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                    (p + "post_attention_layernorm.weight", (h,))]
        return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]

    def nbytes(self) -> int:
        return sum(4 * _numel(s) for _, s in self.parameters())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def documented_state(rank: int, params: list[tuple[str, tuple[int, ...]]], step: int = 1000) -> dict[str, Any]:
    """Rank ``rank``'s state dict as ``ckptaudit.exporters.documented`` saves it (AdamW, after ``step`` steps),
    its sharded tensors as :class:`Sharded` placeholders."""
    rng = random.Random(rank)  # each rank's own RNG state, deterministic
    # get_state_dict builds the optimizer's FQNs apart from the model's: other string objects, which pickle
    # memoizes apart in the .metadata's planner_data (shared strings would make it smaller than a real one).
    names = [n.encode().decode() for n, _ in params]
    return {
        "model": {n: Sharded(s) for n, s in params},
        "optim": {  # AdamW's, in torch's key order (the pickled bytes' length depends on it)
            "state": {n: {"step": torch.tensor(float(step)), "exp_avg": Sharded(s), "exp_avg_sq": Sharded(s)}
                      for n, (_, s) in zip(names, params, strict=True)},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                              "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                              "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                              "initial_lr": 3e-4, "params": names}],
        },
        "train_state": {"step": step},
        "rng": {f"rank{rank}": {"python": rng.getstate(), "torch": torch.Generator().manual_seed(rank).get_state()}},
    }


def _local_chunk(shape: tuple[int, ...], world: int, rank: int) -> tuple[torch.Size, torch.Size]:
    """(sizes, offsets) of rank ``rank``'s shard of a ``Shard(0)`` DTensor on a 1-D mesh of ``world`` ranks: what
    ``compute_local_shape_and_global_offset`` returns there (its plain-data form, made for use without a mesh)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sizes, offsets = _compute_local_shape_and_global_offset(shape, (world,), [rank], [Shard(0)])
    return torch.Size(sizes), torch.Size(offsets)


def local_plan(flat: dict[str, Any], mappings: Any, world: int, rank: int) -> Any:
    """Rank ``rank``'s ``SavePlan``: ``create_default_local_save_plan``'s items, with :class:`Sharded` leaves as the
    DTensor shard items ``_create_write_items_for_dtensor`` makes."""
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    plain = create_default_local_save_plan({k: v for k, v in flat.items() if not isinstance(v, Sharded)},
                                           rank == 0).items
    by_fqn = {item.index.fqn: item for item in plain}
    items = []
    for fqn, obj in flat.items():
        if not isinstance(obj, Sharded):
            items.append(by_fqn[fqn])
            continue
        sizes, offsets = _local_chunk(obj.shape, world, rank)
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                        properties=TensorProperties(dtype=obj.dtype), size=torch.Size(obj.shape))))
    return SavePlan(items, planner_data=mappings)


class _Templates:
    """``torch.save`` of a zero tensor, once per (shape, dtype): its bytes before the tensor data, the data's
    length, and the bytes after (the archive is the same for every zero tensor of that shape)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[tuple[int, ...], torch.dtype], tuple[bytes, int, bytes]] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, int, bytes]:
        key = (tuple(shape), dtype)
        got = self._cache.get(key)
        if got is None:
            buf = io.BytesIO()
            torch.save(torch.zeros(shape, dtype=dtype), buf)
            raw = buf.getvalue()
            with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
            name_len, extra_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little"), \
                int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
            start = info.header_offset + 30 + name_len + extra_len
            got = self._cache[key] = (raw[:start], info.compress_size, raw[start + info.compress_size :])
        return got


def write(out: str, world: int, state_of: Callable[[int], dict[str, Any]], *, sparse_over: int = 64 << 10,
          values: Callable[[int, str], Any] | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the DCP save of ``world`` ranks whose state dicts ``state_of(rank)`` gives (:class:`Sharded` leaves
    for DTensors) into the new directory ``out``; return what was written (items, bytes, seconds).

    ``values(rank, fqn)``: the value of a :class:`Sharded` shard when it is not zeros (tests only: it is saved whole).
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    plans = []
    for rank in range(world):
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_of(rank), is_coordinator=rank == 0)
        plans.append(_sent(local_plan(planner.state_dict, planner.mappings, world, rank)))  # gathered
    say(f"local plans: {time.perf_counter() - t0:.1f} s")
    coordinator = DefaultSavePlanner()
    global_plans, metadata = coordinator.create_global_plan(plans)
    del plans
    writer = FileSystemWriter(out, single_file_per_rank=True, sync_files=False, overwrite=False)
    writer.set_up_storage_writer(True)
    writer.prepare_local_plan(global_plans[0])  # makes the directory
    global_plans = [_sent(p) for p in writer.prepare_global_plan(global_plans)]  # scattered
    say(f"global plan and metadata: {time.perf_counter() - t0:.1f} s")
    templates = _Templates()
    results = []
    items = data_bytes = 0
    for rank, plan in enumerate(global_plans):
        flat = _flat(state_of(rank))
        name = f"{plan.storage_data.prefix}0.distcp"
        mine = []
        with open(os.path.join(out, name), "wb") as fh:
            ordered = ([i for i in plan.items if i.type == WriteItemType.BYTE_IO]
                       + [i for i in plan.items if i.type != WriteItemType.BYTE_IO])
            for item in ordered:
                offset = fh.tell()
                fqn, td = item.index.fqn, item.tensor_data
                obj = flat[fqn]
                if isinstance(obj, Sharded) and values is not None:
                    obj = values(rank, fqn)  # a shard with a value of its own (tests)
                if not isinstance(obj, Sharded):  # a non-tensor item, a plain tensor, a shard with a value
                    buf = io.BytesIO()
                    torch.save(obj, buf)
                    fh.write(buf.getbuffer())
                else:
                    assert td is not None
                    head, n, tail = templates.get(tuple(td.chunk.sizes), td.properties.dtype)
                    fh.write(head)
                    if n >= sparse_over:
                        fh.seek(n, os.SEEK_CUR)  # a hole: reads as the zeros torch.save would have written
                    else:
                        fh.write(bytes(n))
                    fh.write(tail)
                    data_bytes += n
                length = fh.tell() - offset
                mine.append(WriteResult(index=item.index, size_in_bytes=length,
                                        storage_data=_StorageInfo(name, offset, length)))
        results.append(_sent(mine))  # gathered
        items += len(mine)
        if rank % 128 == 127:
            say(f"data files: {rank + 1}/{world}, {time.perf_counter() - t0:.1f} s")
    writer.finish(metadata, results)
    meta = os.path.getsize(os.path.join(out, ".metadata"))
    say(f".metadata: {meta / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s")
    return {"ranks": world, "items": items, "tensor_bytes": data_bytes, "metadata_bytes": meta,
            "tensors": sum(1 for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks")),
            "seconds": round(time.perf_counter() - t0, 1)}


def _sent(obj: Any) -> Any:
    """``obj`` as another process receives it from ``gather_object`` or ``scatter_object_list`` (pickled there,
    unpickled here; our own objects). Each rank's plan and results are then objects of their own, as in a real
    save: pickle memoizes by identity, so a rank's FQN strings are pickled again in ``.metadata`` for every rank
    that sent them (a real ``.metadata`` grows with ranks x tensors; shared strings would hide that)."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(state)
    return dict(planner.state_dict)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a new directory")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--kv", type=int, default=1024)
    ap.add_argument("--sparse-over", type=int, default=64 << 10, help="tensor data of this many bytes or more "
                    "is left as a hole")
    args = ap.parse_args(argv)
    if os.path.exists(args.out):
        ap.error(f"{args.out} exists; give a new directory")
    model = Llama(args.layers, args.hidden, args.ffn, args.vocab, args.kv)
    params = model.parameters()
    info = write(args.out, args.ranks, lambda r: documented_state(r, params), sparse_over=args.sparse_over,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    info.update(model=dataclasses.asdict(model), parameters=len(params), logical_bytes=3 * model.nbytes(),
                disk_bytes=sum(p.stat().st_blocks * 512 for p in Path(args.out).iterdir()))
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
