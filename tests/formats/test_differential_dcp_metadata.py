"""The standing differential test, DCP's ``.metadata`` itself: ckptaudit's reading against DCP's own.

A real DCP checkpoint (``dcp.save`` in one process, plus a tensor saved as two row shards, as FSDP writes them) has
its ``.metadata`` mutated structurally, seeded: ``planner_data`` (decoys, other spellings of a path, prefixes,
list indices, missing entries), chunk lists (dropped, duplicated, moved, resized, reordered, empty chunks),
``storage_data`` (missing, extra, swapped, moved entries, other offsets), key spellings (dots, empty, unicode,
digits), tensor sizes and dtypes, ``storage_meta`` and ``version``, and the order of every mapping. Each mutant is
read by ckptaudit (:func:`ckptaudit.formats.dcp.reader.read_dcp`) and, in a child process, by DCP
(``FileSystemReader`` and ``torch.distributed.checkpoint.load`` into a state dict built from the metadata's own
keys: what DCP finds each item by). Two properties hold:

- **clean means the same**: whenever ckptaudit reports nothing wrong, DCP loads it, and every key holds what
  ckptaudit holds at that key's path: the same tree, dtype, shape and, bit for bit, the same bytes;
- **code means an error**: a ``.metadata`` carrying a payload (a pickle that creates a marker file when DCP's
  plain ``pickle.load`` reads it) is an error of ckptaudit's wherever the marker appears.

It fails when the check of ``planner_data`` against the keys
(:func:`ckptaudit.formats.dcp.metadata._planner`) is removed. ``CKPTAUDIT_DIFF_SEED`` picks another seed.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.auditing.tensor_scan import scan_tensor
from ckptaudit.findings import Severity
from ckptaudit.formats.base import walk
from ckptaudit.formats.dcp.reader import read_dcp
from ckptaudit.formats.io.tensors import FileMaps, TensorData
from zip_mutants import Reduce

SEED = int(os.environ.get("CKPTAUDIT_DIFF_SEED", "20250"))
CASES = 260
CHILD_TIMEOUT = 300


# ----------------------------------------------------------------------------------------------------------------
# The base: a real save, and a tensor in two row shards


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    g = torch.Generator().manual_seed(11)
    state = {"model": {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16),
                       "blocks": [torch.randn(2, generator=g), torch.randn(2, generator=g)],
                       "v": torch.randn(4, 4, generator=g)},
             "a.b": {"c": torch.randn(3, generator=g)}, "step": 3, "extra": {"k": [1, 2], "name": "run"},
             "opt": {"lr": 0.1}}
    root = tmp_path_factory.mktemp("dcp-md") / "base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(root), no_dist=True)
    # "model.s", [4, 3] in two row shards of another data file, as a 2-rank FSDP save writes it
    md = _load_md(root)
    full = torch.randn(4, 3, generator=g)
    data = bytearray()
    chunks = []
    for r0 in (0, 2):
        buf = io.BytesIO()
        torch.save(full[r0:r0 + 2].clone(), buf)
        md.storage_data[MetadataIndex("model.s", torch.Size([r0, 0]))] = _StorageInfo("__1_0.distcp", len(data),
                                                                                     len(buf.getvalue()))
        data += buf.getvalue()
        chunks.append(ChunkStorageMetadata(torch.Size([r0, 0]), torch.Size([2, 3])))
    (root / "__1_0.distcp").write_bytes(bytes(data))
    props = md.state_dict_metadata["model.w"].properties
    md.state_dict_metadata["model.s"] = TensorStorageMetadata(props, torch.Size([4, 3]), chunks)
    md.planner_data["model.s"] = ("model", "s")
    _dump_md(root, md)
    return root


def _load_md(root: Path) -> Any:
    with open(root / ".metadata", "rb") as fh:
        return pickle.load(fh)  # the test's own file


def _dump_md(root: Path, md: Any) -> None:
    (root / ".metadata").write_bytes(pickle.dumps(md))


# ----------------------------------------------------------------------------------------------------------------
# Mutations: each takes (rng, md, case) and changes torch's own Metadata in place


class Case:
    def __init__(self, root: Path, marker: Path) -> None:
        self.root, self.marker, self.armed = root, marker, False


def _tensor_keys(md: Any) -> list[str]:
    return [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")]


def _path(md: Any, key: str) -> tuple[Any, ...]:
    return tuple((md.planner_data or {}).get(key, (key,)))


def _planner(md: Any) -> dict[str, Any]:
    if md.planner_data is None:  # an earlier mutation dropped it
        md.planner_data = {}
    return md.planner_data  # type: ignore[no-any-return]


def m_decoy(rng: random.Random, md: Any, case: Case) -> None:
    keys = _tensor_keys(md)
    a, b = rng.sample(keys, 2)
    _planner(md)[a] = _path(md, b)  # a filed under b's path (listed before or after it)


def m_respell(rng: random.Random, md: Any, case: Case) -> None:
    key = rng.choice(list(md.state_dict_metadata))
    _planner(md)
    parts = key.split(".")
    how = rng.choice(("merged", "split", "digits-as-names", "digits-as-indices", "shifted-dot"))
    if how == "merged":
        md.planner_data[key] = (key,)
    elif how == "split":
        md.planner_data[key] = tuple(parts)
    elif how == "digits-as-names":
        md.planner_data[key] = tuple(str(p) for p in _path(md, key))
    elif how == "digits-as-indices":
        md.planner_data[key] = tuple(int(p) if p.isdigit() and i else p for i, p in enumerate(parts))
    else:
        md.planner_data[key] = (*parts[:-1], "." + parts[-1]) if len(parts) > 1 else (key + ".",)


def m_planner_entries(rng: random.Random, md: Any, case: Case) -> None:
    how = rng.choice(("drop-one", "none", "empty", "extra", "odd-value"))
    keys = list(_planner(md)) or list(md.state_dict_metadata)
    if how == "drop-one":
        md.planner_data.pop(rng.choice(keys), None)
    elif how == "none":
        md.planner_data = None
    elif how == "empty":
        md.planner_data = {}
    elif how == "extra":
        md.planner_data["no.such.key"] = _path(md, rng.choice(keys))
    else:
        md.planner_data[rng.choice(keys)] = rng.choice([[], "model", ("model", -1), ("model", 10**6), (0,), None])


def m_chunks(rng: random.Random, md: Any, case: Case) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    key = rng.choice(["model.s", "model.s", *_tensor_keys(md)])
    item = md.state_dict_metadata[key]
    chunks = item.chunks
    c = rng.randrange(len(chunks))
    how = rng.choice(("drop", "dup", "move", "resize", "reverse", "empty", "outside"))
    if how == "drop" and len(chunks) > 1:
        chunks.pop(c)
    elif how == "dup":
        chunks.append(chunks[c])
    elif how == "move":
        d = rng.randrange(len(item.size)) if item.size else 0
        if item.size:
            offs = list(chunks[c].offsets)
            offs[d] += rng.choice((-1, 1))
            chunks[c] = ChunkStorageMetadata(torch.Size(offs), chunks[c].sizes)
    elif how == "resize" and item.size:
        d = rng.randrange(len(item.size))
        sizes = list(chunks[c].sizes)
        sizes[d] = max(0, sizes[d] + rng.choice((-1, 1)))
        chunks[c] = ChunkStorageMetadata(chunks[c].offsets, torch.Size(sizes))
    elif how == "reverse":
        chunks.reverse()
    elif how == "empty":
        chunks.append(ChunkStorageMetadata(torch.Size([0] * len(item.size)), torch.Size([0] * len(item.size))))
    elif how == "outside" and item.size:
        chunks[c] = ChunkStorageMetadata(torch.Size([n + 1 for n in item.size]), chunks[c].sizes)


def m_storage(rng: random.Random, md: Any, case: Case) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    keys = list(md.storage_data)
    k = rng.choice(keys)
    info = md.storage_data[k]
    how = rng.choice(("drop", "extra", "swap", "rekey", "hint", "shift", "other-file"))
    if how == "drop":
        del md.storage_data[k]
    elif how == "extra":
        md.storage_data[MetadataIndex(k.fqn + ".x", k.offset)] = info
    elif how == "swap":
        k2 = rng.choice(keys)
        md.storage_data[k], md.storage_data[k2] = md.storage_data[k2], info
    elif how == "rekey" and k.offset is not None:
        del md.storage_data[k]
        md.storage_data[MetadataIndex(k.fqn, torch.Size([o + 1 for o in k.offset]))] = info
    elif how == "hint":
        del md.storage_data[k]
        md.storage_data[MetadataIndex(k.fqn, k.offset, 7)] = info  # the index is a hint: equal keys
    elif how == "shift":
        md.storage_data[k] = _StorageInfo(info.relative_path, info.offset + rng.choice((-1, 1)), info.length)
    else:
        md.storage_data[k] = _StorageInfo(rng.choice(["__0_0.distcp", "__1_0.distcp"]), info.offset, info.length)


def m_rename(rng: random.Random, md: Any, case: Case) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    old = rng.choice(list(md.state_dict_metadata))
    other = rng.choice([k for k in md.state_dict_metadata if k != old])
    new = rng.choice(["", "x.y", "wé", " w", "0", "model", "step.", other + ".x", "model.w.0"])
    if new in md.state_dict_metadata:
        return
    md.state_dict_metadata = {new if k == old else k: v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {MetadataIndex(new, k.offset, k.index) if k.fqn == old else k: v
                       for k, v in md.storage_data.items()}
    planner = _planner(md)
    planner.pop(old, None)
    if new == other + ".x":
        planner[new] = (*_path(md, other), "x")  # inside another item's value
    elif rng.random() < 0.5:
        planner[new] = tuple(new.split(".")) if new else (new,)
    else:
        planner[new] = (new,)


def m_tensor_meta(rng: random.Random, md: Any, case: Case) -> None:
    from torch.distributed.checkpoint.metadata import TensorProperties

    item = md.state_dict_metadata[rng.choice(_tensor_keys(md))]
    how = rng.choice(("grow", "shrink", "rank", "dtype", "list-size"))
    if how == "grow" and item.size:
        item.size = torch.Size([item.size[0] + 1, *item.size[1:]])
    elif how == "shrink" and item.size and item.size[0] > 1:
        item.size = torch.Size([item.size[0] - 1, *item.size[1:]])
    elif how == "rank":
        item.size = torch.Size([*item.size, 1])
    elif how == "list-size":
        item.size = list(item.size)  # torch compares it with the loading tensor's torch.Size: never equal
    elif how == "dtype":
        item.properties = TensorProperties(dtype=rng.choice([torch.float16, torch.bfloat16, torch.float64]))


def m_order(rng: random.Random, md: Any, case: Case) -> None:
    for name in ("state_dict_metadata", "storage_data", "planner_data"):
        items = list((getattr(md, name) or {}).items())
        rng.shuffle(items)
        setattr(md, name, dict(items))


def m_meta(rng: random.Random, md: Any, case: Case) -> None:
    from torch.distributed.checkpoint.metadata import StorageMeta

    how = rng.choice(("no-storage-meta", "modules", "version"))
    if how == "no-storage-meta":
        md.storage_meta = None
    elif how == "modules":
        md.storage_meta = StorageMeta(modules=["a", "b"])
    else:
        md.version = rng.choice([None, "0.0.1", "9.9"])


def m_payload(rng: random.Random, md: Any, case: Case) -> None:
    # torch's FileSystemReader.read_metadata unpickles .metadata with plain pickle: this runs there
    md.version = Reduce(io.open, str(case.marker), "w")
    case.armed = True


MUTATIONS: dict[str, Callable[[random.Random, Any, Case], None]] = {
    "decoy": m_decoy, "respell": m_respell, "planner-entries": m_planner_entries, "chunks": m_chunks,
    "storage": m_storage, "rename": m_rename, "tensor-meta": m_tensor_meta, "order": m_order, "meta": m_meta,
    "payload": m_payload,
}


# ----------------------------------------------------------------------------------------------------------------
# The two readings, each flattened to {(key, *path inside its value): leaf}


def _leaf(kind: str, dtype: str, shape: tuple[int, ...], digest: str) -> list[Any]:
    return [kind, dtype, list(shape), digest]


def _flat_ours(tree: Any, maps: FileMaps, prefix: tuple[Any, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, leaf in walk(tree, prefix):
        if isinstance(leaf, TensorData):
            out[json.dumps(path)] = _leaf("tensor", leaf.dtype.name, leaf.shape, scan_tensor(leaf, maps).hash)
        else:
            out[json.dumps(path)] = [type(leaf).__name__, repr(leaf)]
    return out


def ours_by_key(root: Path) -> tuple[bool, bool, dict[str, Any] | None]:
    """(clean, error, {json path: leaf}) of ckptaudit's reading: every key's value found at the key path the reader
    accepted, and nothing else in the tree."""
    read = read_dcp(str(root))
    problems = [f for f in read.findings if f.severity >= Severity.WARNING]
    if problems or read.part is None or read.metadata is None:
        errors = [f for f in read.findings if f.severity >= Severity.ERROR
                  and f.code.startswith(("security.", "integrity."))]
        return False, bool(errors), None
    md = read.metadata
    out: dict[str, Any] = {}
    leaves = 0
    with FileMaps() as maps:
        for key in md.state_dict_metadata:
            node = read.part.tree
            try:
                for p in md.planner_data.get(key, (key,)):
                    node = node[p]
            except (KeyError, IndexError, TypeError):  # the reader placed the item elsewhere: a difference
                out[json.dumps([key])] = ["nothing at the key path the reader accepted"]
                continue
            got = _flat_ours(node, maps, (key,))
            leaves += len(got)
            out.update(got)
    if leaves != sum(1 for _ in walk(read.part.tree)):
        out["extra"] = ["the tree holds values under no key"]
    return True, False, out


_DCP_READS = """
import io, json, sys, warnings, pickle
import torch, xxhash
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
warnings.simplefilter("ignore")

class Planner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

def flat(obj, prefix):
    out = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[json.dumps(prefix)] = ["tensor", str(obj.dtype).removeprefix("torch."), list(obj.shape),
                                   xxhash.xxh3_128(raw).hexdigest()]
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat(v, [*prefix, k]))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat(v, [*prefix, i]))
    else:
        out[json.dumps(prefix)] = [type(obj).__name__, repr(obj)]
    return out

with open(sys.argv[2], "w") as results:
    for root in open(sys.argv[1]).read().split("\\n"):
        if not root:
            continue
        try:
            reader = FileSystemReader(root)
            md = reader.read_metadata()  # plain pickle.load: a payload runs here
            state = {fqn: torch.zeros(it.size, dtype=it.properties.dtype) if isinstance(it, TensorStorageMetadata)
                     else "" for fqn, it in md.state_dict_metadata.items()}
            dcp.load(state, storage_reader=FileSystemReader(root), planner=Planner(flatten_state_dict=False),
                     no_dist=True)
            out = {}
            for fqn, value in state.items():
                out.update(flat(value, [fqn]))
            results.write(json.dumps({"root": root, "verdict": "read", "flat": out}) + "\\n")
        except BaseException as exc:
            results.write(json.dumps({"root": root, "verdict": f"refused: {type(exc).__name__}: {str(exc)[:200]}",
                                      "flat": None}) + "\\n")
print("done")
"""


def dcp_readings(roots: list[Path], tmp: Path) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """DCP's reading of each root, in one child process (the payloads run there, never here)."""
    listing, results = tmp / "dcp-roots.txt", tmp / "dcp-readings.jsonl"
    listing.write_text("\n".join(str(r) for r in roots))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_DCP_READS), str(listing), str(results)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT, cwd=tmp, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-3000:]
    out = {}
    for line in results.read_text().splitlines():
        rec = json.loads(line)
        out[rec["root"]] = (rec["verdict"], rec["flat"])
    return out


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in a.items() if b.get(k) != v}


# ----------------------------------------------------------------------------------------------------------------


def test_dcp_metadata_mutants_read_as_dcp_reads_them(base: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED + 36)
    cases: list[tuple[Case, str, tuple[bool, bool, dict[str, Any] | None]]] = []
    stats: Counter[str] = Counter()
    kinds = list(MUTATIONS)
    for n in range(CASES):
        case = Case(tmp_path / f"md-{n}", tmp_path / f"md-marker-{n}")
        shutil.copytree(base, case.root)
        md = _load_md(base)
        chosen = rng.sample(kinds, k=rng.choice((1, 1, 2)))
        for kind in chosen:
            MUTATIONS[kind](rng, md, case)
        try:
            _dump_md(case.root, md)
        except (pickle.PicklingError, TypeError, AttributeError):
            shutil.rmtree(case.root)
            continue
        ours = ours_by_key(case.root)
        for kind in chosen:
            stats[f"{kind}:{'clean' if ours[0] else 'refused'}"] += 1
        cases.append((case, "+".join(chosen), ours))
    theirs = dcp_readings([base] + [c.root for c, _l, _o in cases], tmp_path)
    # the unmutated base reads the same both ways
    base_ours = ours_by_key(base)
    assert base_ours[0] and base_ours[2] == theirs[str(base)][1], (base_ours, theirs[str(base)])
    for case, label, (clean, error, flat) in cases:
        verdict, dcp_flat = theirs[str(case.root)]
        if clean:
            assert flat is not None
            assert dcp_flat is not None, f"{case.root.name} ({label}): ckptaudit calls it clean, DCP {verdict}"
            assert flat == dcp_flat, (f"{case.root.name} ({label}): ckptaudit calls it clean but reads it otherwise "
                                      f"than DCP:\nckptaudit: {_diff(flat, dcp_flat)}\nDCP:       {_diff(dcp_flat, flat)}")
        if case.marker.exists():
            assert error, f"{case.root.name} ({label}): DCP's reading ran its payload, ckptaudit reported no error"
    print("differential, DCP .metadata:", dict(sorted(stats.items())))
    assert sum(c.marker.exists() for c, _l, _o in cases) > 0, "no payload ran: the sentinel proves nothing"
    for kind in ("respell", "order", "meta", "rename", "planner-entries"):
        assert stats[f"{kind}:clean"] > 0, (kind, stats)
    for kind in ("decoy", "chunks", "storage", "tensor-meta", "payload", "rename"):
        assert stats[f"{kind}:refused"] > 0, (kind, stats)
