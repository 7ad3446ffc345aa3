"""Fuzzing every reader with damaged real checkpoints: no input may crash, hang or blow up memory.

Real checkpoints of every supported format (a ``torch.save`` file, a safetensors file, a
``torch.distributed.checkpoint`` directory, a Hugging Face ``save_pretrained`` directory with a shard index) are
damaged two ways:

- a deterministic sweep that truncates every file at the start, middle and end of each of its regions (zip local
  headers, member data, central directory and end record; safetensors length, header and tensors; every DCP
  item; pickles; JSON);
- a Hypothesis search (derandomized: the same inputs every run) over byte flips near headers and anywhere,
  random overwrites, header edits that understand the format (zip size/offset fields, safetensors offsets,
  shapes and dtypes, DCP metadata offsets, lengths, paths and shapes, index JSON), and files replaced by pipes,
  devices, directories, dangling or looping links, sparse giants, or deleted.

Each input is audited in :class:`audit_worker.AuditWorker` (a child process under ``RLIMIT_AS``): the audit
must return a report that renders as JSON and as a table, within a time bound, and the worker's peak RSS may
grow by at most :data:`RSS_GROWTH_MIB`. The number of inputs tried is printed (``pytest -s`` not needed).

    .venv/bin/python -m pytest -q tests/formats/test_fuzz_readers.py
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import real_checkpoints as rc
from audit_worker import AuditWorker
from ckptaudit.formats.dcp.metadata import dcp_metadata_loads

EXAMPLES_PER_KIND = 6
"""Hypothesis inputs per kind of damage and file (about 60 kinds; 0.1 s each on a loaded 2-core machine)."""
STRUCTURE_EXAMPLES = 150
"""Hypothesis trees saved as torch.save / JSON files of the common layouts."""
TIME_BOUND_S = 30.0
"""Per input; a healthy audit of these checkpoints takes well under a second."""
RSS_GROWTH_MIB = 300
"""Peak RSS growth allowed over the worker's warm baseline, across all inputs."""

INTERESTING = [0, 1, 7, 8, 255, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]


# --------------------------------------------------------------------------------------------------------------
# The real checkpoints and the regions of their files


@dataclass
class Base:
    root: Path
    files: list[str]
    """Relative paths of its files (``""`` for a single-file checkpoint)."""
    regions: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)
    """Per file: (region name, start, end)."""

    def path_of(self, root: Path, rel: str) -> Path:
        return root / rel if rel else root


def _zip_regions(path: Path, base: int = 0, length: int | None = None) -> list[tuple[str, int, int]]:
    data = path.read_bytes()
    length = len(data) - base if length is None else length
    blob = data[base:base + length]
    out: list[tuple[str, int, int]] = []
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        infos = zf.infolist()
        picks = {i.filename: i for i in infos if i.filename.endswith("data.pkl")}
        storages = [i for i in infos if "/data/" in i.filename]
        if storages:
            picks[storages[0].filename] = storages[0]
            picks[storages[-1].filename] = storages[-1]
        for info in picks.values():
            h = info.header_offset
            name_len, extra_len = struct.unpack("<HH", blob[h + 26:h + 30])
            start = h + 30 + name_len + extra_len
            out.append((f"local header {info.filename}", base + h, base + start))
            out.append((f"data {info.filename}", base + start, base + start + info.compress_size))
        eocd = blob.rfind(b"PK\x05\x06")
        out.append(("central directory", base + zf.start_dir, base + eocd))
        out.append(("end record", base + eocd, base + len(blob)))
    return out


def _safetensors_regions(path: Path) -> list[tuple[str, int, int]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    return [("length", 0, 8), ("header", 8, 8 + n), ("first tensor", 8 + n + spans[0][0], 8 + n + spans[0][1]),
            ("last tensor", 8 + n + spans[-1][0], 8 + n + spans[-1][1])]


def _regions(base_root: Path, rel: str) -> list[tuple[str, int, int]]:
    path = base_root / rel if rel else base_root
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        return _safetensors_regions(path)
    if path.suffix == ".distcp":
        md = dcp_metadata_loads((path.parent / ".metadata").read_bytes())
        items = sorted((i.offset, i.length) for i in md.storage_data.values() if i.relative_path == path.name)
        regions = [(f"item at {o}", o, o + n) for o, n in (items[0], items[len(items) // 2], items[-1])]
        return regions + _zip_regions(path, items[0][0], items[0][1])
    if path.name == ".metadata" or path.suffix == ".json":
        return [("whole", 0, size)]
    return _zip_regions(path)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    d = tmp_path_factory.mktemp("fuzz-bases")
    roots = {
        "torch.save": rc.torch_save_checkpoint(d / "ckpt.pt"),
        "safetensors": rc.safetensors_file(d / "model.safetensors"),
        "dcp": rc.dcp_checkpoint(d / "dcp"),
        "hf-sharded": rc.hf_sharded_directory(d / "hf"),
    }
    out: dict[str, Base] = {}
    for name, root in roots.items():
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else [""]
        out[name] = Base(root, files, {rel: _regions(root, rel) for rel in files})
    return out


@pytest.fixture(scope="module")
def worker(bases: dict[str, Base]):  # type: ignore[no-untyped-def]
    w = AuditWorker(headroom_mib=1536, timeout_s=TIME_BOUND_S * 3)
    w.start([str(b.root) for b in bases.values()])
    yield w
    w.close()


# --------------------------------------------------------------------------------------------------------------
# Mutations


@dataclass
class Mutation:
    base: str
    rel: str
    op: str
    args: dict[str, Any]

    def __str__(self) -> str:
        shown = {k: (v if not isinstance(v, bytes | list) or len(v) < 40 else f"<{len(v)} items>")
                 for k, v in self.args.items()}
        return f"{self.base}:{self.rel or '(file)'} {self.op} {shown}"


def _flip(path: Path, args: dict[str, Any]) -> None:
    data = bytearray(path.read_bytes())
    for pos, mask in zip(args["positions"], args["masks"], strict=True):
        data[pos % len(data)] ^= mask
    path.write_bytes(bytes(data))


def _overwrite(path: Path, args: dict[str, Any]) -> None:
    data = bytearray(path.read_bytes())
    pos = args["pos"] % len(data)
    data[pos:pos + len(args["bytes"])] = args["bytes"]
    path.write_bytes(bytes(data))


def _truncate(path: Path, args: dict[str, Any]) -> None:
    os.truncate(path, args["at"])


def _zip_field(path: Path, args: dict[str, Any]) -> None:
    """Set a size/offset field of a zip record (central directory, local header or end record)."""
    data = bytearray(path.read_bytes())
    sig = {"central": b"PK\x01\x02", "local": b"PK\x03\x04", "end": b"PK\x05\x06"}[args["record"]]
    hits, at = [], data.find(sig)
    while at >= 0:
        hits.append(at)
        at = data.find(sig, at + 1)
    if not hits:
        return
    at = hits[args["which"] % len(hits)]
    fields = {"central": [(20, "<I"), (24, "<I"), (42, "<I"), (28, "<H"), (30, "<H"), (10, "<H")],
              "local": [(18, "<I"), (22, "<I"), (26, "<H"), (28, "<H"), (8, "<H")],
              "end": [(10, "<H"), (12, "<I"), (16, "<I"), (20, "<H")]}[args["record"]]
    offset, fmt = fields[args["field"] % len(fields)]
    value = args["value"] % (1 << (8 * struct.calcsize(fmt)))
    if at + offset + struct.calcsize(fmt) <= len(data):
        data[at + offset:at + offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))


def _safetensors_edit(path: Path, args: dict[str, Any]) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if args["what"] == "length":
        path.write_bytes(struct.pack("<Q", args["value"] % (1 << 64)) + raw[8:])
        return
    header = json.loads(raw[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = names[args["which"] % len(names)]
    if args["what"] == "offsets":
        header[name]["data_offsets"][args["which"] % 2] = args["value"] * (-1 if args["negative"] else 1)
    elif args["what"] == "shape":
        header[name]["shape"] = [args["value"], -1 if args["negative"] else 2]
    elif args["what"] == "dtype":
        header[name]["dtype"] = args["text"]
    elif args["what"] == "metadata":
        header["__metadata__"] = {"format": [1, {"a": None}]} if args["negative"] else args["text"]
    else:  # rename: names that collide, are empty, or hold control characters
        header[args["text"]] = header.pop(name)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _metadata_edit(path: Path, args: dict[str, Any]) -> None:
    md = rc.read_dcp_metadata(path.parent)
    infos = list(md.storage_data.values())
    info = infos[args["which"] % len(infos)]
    what, value = args["what"], args["value"] * (-1 if args["negative"] else 1)
    if what == "offset":
        info.offset = value
    elif what == "length":
        info.length = value
    elif what == "path":
        info.relative_path = args["text"]
    elif what == "shape":
        items = [v for v in md.state_dict_metadata.values() if hasattr(v, "chunks")]
        item = items[args["which"] % len(items)]
        if args["negative"] and item.chunks:
            item.chunks[0].sizes = tuple([value] * len(item.chunks[0].sizes))
        else:
            item.size = tuple([value] * max(1, len(item.size)))
    elif what == "type":
        key = sorted(md.state_dict_metadata)[args["which"] % len(md.state_dict_metadata)]
        md.state_dict_metadata[key] = [value, args["text"]]
    elif what == "planner":
        md.planner_data = {k: tuple(["x"] * (value % 5000)) for k in md.state_dict_metadata}
    else:  # drop the storage entry of one item
        del md.storage_data[list(md.storage_data)[args["which"] % len(md.storage_data)]]
    path.write_bytes(pickle.dumps(md))


def _json_edit(path: Path, args: dict[str, Any]) -> None:
    doc = json.loads(path.read_text())
    what = args["what"]
    if what == "weight_map" and isinstance(doc.get("weight_map"), dict):
        keys = sorted(doc["weight_map"])
        key = keys[args["which"] % len(keys)]
        doc["weight_map"][key] = [args["text"], args["value"], None, {"x": [[[]]]}][args["which"] % 4]
    elif what == "nest":
        depth = [50, 101, 990, 2500, 200_000][args["which"] % 5]
        path.write_text('{"weight_map": ' + "[" * depth + "]" * depth + "}")
        return
    else:
        doc = [doc] if args["negative"] else args["text"]
    path.write_text(json.dumps(doc))


def _replace(path: Path, args: dict[str, Any]) -> None:
    kind = args["kind"]
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        if kind == "sparse-giant":
            os.truncate(path, path.stat().st_size + (1 << 34))  # 16 GiB of holes after the real bytes
            return
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "dangling":
        path.symlink_to(path.parent / "does-not-exist")
    elif kind == "loop":
        path.symlink_to(path)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "sparse-giant":
        with open(path, "wb") as fh:
            fh.truncate(1 << 34)
    # "delete": nothing more to do


EDITS: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "flip": _flip, "overwrite": _overwrite, "truncate": _truncate, "zip-field": _zip_field,
    "safetensors-edit": _safetensors_edit, "metadata-edit": _metadata_edit, "json-edit": _json_edit,
    "replace": _replace,
}


def apply(m: Mutation, bases: dict[str, Base], work: Path) -> Path:
    """A fresh copy of the base with the mutation applied; returns the path to audit."""
    base = bases[m.base]
    dst = work / base.root.name
    if base.root.is_dir():
        shutil.copytree(base.root, dst)
    else:
        shutil.copy(base.root, dst)
    EDITS[m.op](base.path_of(dst, m.rel), m.args)
    return dst


REPLACEMENTS = ["fifo", "directory", "dev-zero", "dangling", "loop", "empty", "sparse-giant", "delete"]
FORMAT_EDITS = {
    "zip": [("zip-field", r) for r in ("central", "local", "end")],
    "safetensors": [("safetensors-edit", w) for w in ("length", "offsets", "shape", "dtype", "metadata", "rename")],
    "metadata": [("metadata-edit", w) for w in ("offset", "length", "path", "shape", "type", "planner", "drop")],
    "json": [("json-edit", w) for w in ("weight_map", "nest", "replace")],
}
FUZZED_FILES = {
    "torch.save": [""],
    "safetensors": [""],
    "dcp": [".metadata", "__0_0.distcp"],
    "hf-sharded": ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "config.json"],
}
"""Which files of each base are damaged (every file of every base is truncated by the sweep)."""


def _kind(path: Path) -> str:
    return ("safetensors" if path.suffix == ".safetensors" else "metadata" if path.name == ".metadata"
            else "json" if path.suffix == ".json" else "zip")


def plan(bases: dict[str, Base]) -> list[tuple[str, str, str, str | None]]:
    """Every (base, file, operation, variant) the Hypothesis search covers: random byte damage and each
    format-aware edit for every fuzzed file (Hypothesis then draws the positions and values)."""
    out: list[tuple[str, str, str, str | None]] = []
    for name, rels in FUZZED_FILES.items():
        for rel in rels:
            kind = _kind(bases[name].path_of(bases[name].root, rel))
            out += [(name, rel, op, None) for op in ("flip", "overwrite", "truncate")]
            out += [(name, rel, op, what) for op, what in FORMAT_EDITS[kind]]
    return out


def replacements(bases: dict[str, Base]) -> list[Mutation]:
    return [Mutation(name, rel, "replace", {"kind": kind})
            for name, rels in FUZZED_FILES.items() for rel in rels for kind in REPLACEMENTS
            if rel or kind != "delete"]


def mutations(base: Base, name: str, rel: str, op: str, what: str | None) -> st.SearchStrategy[Mutation]:
    """The arguments of one kind of damage to one file, drawn by Hypothesis."""
    path = base.path_of(base.root, rel)
    size = path.stat().st_size
    hot = [p for _, a, b in base.regions[rel] for p in (a, b - 1) if 0 <= p < size]
    position = st.one_of(st.integers(0, size - 1), st.sampled_from(hot).flatmap(
        lambda p: st.integers(max(0, p - 16), min(size - 1, p + 16))))
    value = st.one_of(st.sampled_from(INTERESTING), st.integers(0, 1 << 64))
    text = st.sampled_from(["../outside.distcp", "/etc/passwd", "", "a\x00b", "x" * 300, "\x1b[31m[/b]", "F16",
                            "BF16", "U8", "nested/deeper/file.distcp", "__0_0.distcp"])
    args: st.SearchStrategy[dict[str, Any]]
    if op == "flip":
        args = st.integers(1, 6).flatmap(lambda n: st.fixed_dictionaries({
            "positions": st.lists(position, min_size=n, max_size=n),
            "masks": st.lists(st.integers(1, 255), min_size=n, max_size=n)}))
    elif op == "overwrite":
        args = st.fixed_dictionaries({"pos": position, "bytes": st.binary(min_size=1, max_size=64)})
    elif op == "truncate":
        args = st.fixed_dictionaries({"at": st.integers(0, max(0, size - 1))})
    elif op == "zip-field":
        args = st.fixed_dictionaries({"record": st.just(what), "which": st.integers(0, 50),
                                      "field": st.integers(0, 5), "value": value})
    else:
        args = st.fixed_dictionaries({"what": st.just(what), "which": st.integers(0, 50), "value": value,
                                      "negative": st.booleans(), "text": text})
    return args.map(lambda a: Mutation(name, rel, op, a))


def sweep(bases: dict[str, Base]) -> list[Mutation]:
    """Truncation at the start, middle and end of every region of every file."""
    out: list[Mutation] = []
    for name, base in bases.items():
        for rel in base.files:
            size = base.path_of(base.root, rel).stat().st_size
            cuts = sorted({c for _, a, b in base.regions[rel] for c in (a, (a + b) // 2, b - 1) if 0 <= c < size})
            out += [Mutation(name, rel, "truncate", {"at": c}) for c in cuts]
    return out


# --------------------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    inputs: int = 0
    slowest: float = 0.0
    peak_mib: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)


def check(m: Mutation, bases: dict[str, Base], worker: AuditWorker, work: Path, tally: Tally) -> None:
    case = work / f"case{tally.inputs}"
    case.mkdir()
    path = apply(m, bases, case)
    answer = worker.audit(str(path), timeout_s=TIME_BOUND_S * 3)
    tally.inputs += 1
    assert answer["ok"], f"{m}\n{answer['error']}"
    assert answer["seconds"] < TIME_BOUND_S, f"{m}: {answer['seconds']:.1f} s"
    growth = answer["maxrss_mib"] - worker.baseline_mib
    assert growth < RSS_GROWTH_MIB, f"{m}: peak RSS grew by {growth:.0f} MiB"
    op = m.op + (f"/{m.args.get('what') or m.args.get('kind') or m.args.get('record')}"
                  if m.op not in ("flip", "overwrite", "truncate") else "")
    tally.ops[op] = tally.ops.get(op, 0) + 1
    tally.slowest = max(tally.slowest, answer["seconds"])
    tally.peak_mib = max(tally.peak_mib, growth)
    for code in answer["codes"]:
        tally.codes[code] = tally.codes.get(code, 0) + 1
    shutil.rmtree(case, ignore_errors=True)


def test_damaged_checkpoints_never_crash_hang_or_blow_up(
    bases: dict[str, Base], worker: AuditWorker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tally = Tally()
    fixed = sweep(bases) + replacements(bases)
    for m in fixed:
        check(m, bases, worker, tmp_path, tally)
    combos = plan(bases)
    for name, rel, op, what in combos:

        @settings(max_examples=EXAMPLES_PER_KIND, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture])
        @given(mutations(bases[name], name, rel, op, what))
        def fuzz(m: Mutation) -> None:
            check(m, bases, worker, tmp_path, tally)

        fuzz()
    with capsys.disabled():
        print(f"\nfuzz: {tally.inputs} damaged checkpoints audited ({len(fixed)} fixed truncations and "
              f"replacements + {tally.inputs - len(fixed)} drawn by Hypothesis over {len(combos)} kinds of damage), "
              f"0 crashes, 0 hangs; slowest {tally.slowest:.2f} s, peak RSS growth {tally.peak_mib:.0f} MiB\n"
              "fuzz: findings: " + ", ".join(f"{c} x{n}" for c, n in sorted(tally.codes.items()))
              + "\nfuzz: damage: " + ", ".join(f"{o} x{n}" for o, n in sorted(tally.ops.items())))
    # The damage was real: most inputs were reported broken.
    broken = tally.codes.get("integrity.corrupt", 0) + tally.codes.get("integrity.incomplete", 0)
    assert broken > tally.inputs // 2, tally.codes


# --------------------------------------------------------------------------------------------------------------
# Structure: well-formed files whose content is arbitrary (what a byte fuzzer rarely produces)

KEYS = ["model", "state_dict", "optimizer", "optim", "optimizer_states", "state", "param_groups", "params",
        "param_names", "lr", "step", "exp_avg", "exp_avg_sq", "scheduler", "lr_schedulers", "rng", "loops",
        "global_step", "weight_map", "0.weight", "module.layer.bias", "", "\x1b[2J", "[/x]"]


def _leaves() -> st.SearchStrategy[Any]:
    import torch

    tensors = st.sampled_from([(), (0,), (3,), (2, 3), (1, 1, 1)]).flatmap(
        lambda shape: st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]).map(
            lambda dt: torch.zeros(shape, dtype=dt)))
    return st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                     st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(KEYS), tensors)


def _trees() -> st.SearchStrategy[Any]:
    keys = st.one_of(st.sampled_from(KEYS), st.integers(-3, 5), st.booleans(), st.floats(-1, 1),
                     st.tuples(st.integers(0, 2)))
    return st.recursive(_leaves(), lambda kids: st.one_of(
        st.lists(kids, max_size=5), st.dictionaries(keys, kids, max_size=6),
        st.tuples(kids, kids)), max_leaves=30)


def _training_trees() -> st.SearchStrategy[Any]:
    """Trees shaped like training checkpoints (model / optimizer state and groups / scheduler / step) whose
    keys, values and nesting are arbitrary."""
    anything = _trees()
    keys = st.one_of(st.sampled_from(KEYS), st.integers(-3, 5), st.booleans(), st.floats(-1, 1),
                     st.tuples(st.integers(0, 2)), st.text(max_size=8))
    state_entry = st.one_of(anything, st.dictionaries(st.one_of(st.sampled_from(["exp_avg", "exp_avg_sq", "step",
                                                                                  "momentum_buffer"]), keys),
                                                      st.one_of(_leaves(), anything), max_size=4))
    group = st.one_of(anything, st.fixed_dictionaries(
        {"params": st.one_of(st.lists(st.one_of(keys, anything), max_size=6), anything)},
        optional={"param_names": st.one_of(st.lists(st.one_of(keys, anything), max_size=6), anything),
                  "lr": _leaves(), "weight_decay": _leaves()}))
    optimizer = st.one_of(anything, st.fixed_dictionaries(
        {"state": st.one_of(st.dictionaries(keys, state_entry, max_size=6), st.lists(state_entry, max_size=4),
                            anything)},
        optional={"param_groups": st.one_of(st.lists(group, max_size=3), anything)}))
    model = st.one_of(anything, st.dictionaries(keys, st.one_of(_leaves(), anything), max_size=8))
    return st.fixed_dictionaries({}, optional={
        "model": model, "state_dict": model, "optimizer": optimizer, "optimizer_states": st.lists(optimizer, max_size=2),
        "scheduler": anything, "lr_schedulers": anything, "rng": anything, "step": _leaves(),
        "global_step": _leaves(), "loops": anything, "weight_map": st.dictionaries(keys, anything, max_size=4),
    })


def test_well_formed_files_with_arbitrary_structure_never_crash(
    worker: AuditWorker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    tally = Tally()

    @settings(max_examples=STRUCTURE_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(st.one_of(_training_trees(), _trees()), st.sampled_from(["checkpoint.pt", "dir/optimizer.pt", "dir/trainer_state.json",
                                      "dir/model.safetensors.index.json", "model.ckpt"]))
    def fuzz(tree: Any, name: str) -> None:
        tally.slowest += 1  # used as a case counter here
        case = tmp_path / f"tree{int(tally.slowest)}"
        target = case / name
        target.parent.mkdir(parents=True)
        if target.suffix == ".json":
            target.write_text(json.dumps(tree, skipkeys=True,
                                         default=lambda t: t.tolist() if hasattr(t, "tolist") else str(t)))
        else:
            torch.save(tree if not isinstance(tree, dict) else {**tree}, target)
        audited = case / "dir" if name.startswith("dir/") else target
        answer = worker.audit(str(audited), timeout_s=TIME_BOUND_S * 3)
        tally.inputs += 1
        assert answer["ok"], f"{name}: {tree!r}\n{answer['error']}"
        assert answer["seconds"] < TIME_BOUND_S
        shutil.rmtree(case, ignore_errors=True)

    fuzz()
    with capsys.disabled():
        print(f"\nfuzz: {tally.inputs} well-formed files of arbitrary structure audited, 0 crashes")


METADATA_EXAMPLES = 60
"""Hypothesis DCP metadata objects and manifests (structure-aware: torch's own classes and our schema, with
arbitrary values where the readers expect particular ones)."""


def _metadata_edits() -> st.SearchStrategy[dict[str, Any]]:
    """Which field of torch's ``Metadata`` to replace, and with what (values of any shape)."""
    anything = _trees()
    return st.fixed_dictionaries({
        "field": st.sampled_from(["planner_data", "storage_data.key", "storage_data.value", "sd.entry",
                                  "chunk.offsets", "chunk.sizes", "size", "properties", "version", "storage_meta"]),
        "which": st.integers(0, 1000),
        "value": st.one_of(anything, st.sampled_from(INTERESTING), st.tuples(st.integers(-2, 1 << 40)))})


def _edit_metadata(md: Any, edit: dict[str, Any]) -> None:
    import torch.distributed.checkpoint.metadata as m

    field_, which, value = edit["field"], edit["which"], edit["value"]
    keys = list(md.storage_data)
    tensors = [v for v in md.state_dict_metadata.values() if isinstance(v, m.TensorStorageMetadata)]
    if field_ == "planner_data":
        md.planner_data = value if which % 2 else {k: value for k in list(md.state_dict_metadata)[:3]}
    elif field_ == "storage_data.key":
        key = keys[which % len(keys)]
        md.storage_data[value if which % 3 == 0 else m.MetadataIndex(str(value), None)] = md.storage_data.pop(key)
    elif field_ == "storage_data.value":
        md.storage_data[keys[which % len(keys)]] = value
    elif field_ == "sd.entry":
        name = list(md.state_dict_metadata)[which % len(md.state_dict_metadata)]
        md.state_dict_metadata[name] = value
    elif field_ in ("chunk.offsets", "chunk.sizes"):
        chunk = tensors[which % len(tensors)].chunks[0]
        setattr(chunk, field_.split(".")[1], value)
    elif field_ == "size":
        tensors[which % len(tensors)].size = value
    elif field_ == "properties":
        tensors[which % len(tensors)].properties = value
    else:
        setattr(md, field_, value)


def _json_values() -> st.SearchStrategy[Any]:
    """Arbitrary JSON values (a manifest is JSON: string keys only, no tensors), NaN and infinities included."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                       st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(KEYS))
    keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
    return st.recursive(leaves, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                       st.dictionaries(keys, kids, max_size=6)), max_leaves=30)


def _manifest_trees(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Our manifest with one field replaced by an arbitrary JSON value (counts, sizes, offsets, shards, ranks)."""
    anything = st.one_of(_json_values(), st.sampled_from(INTERESTING), st.just(2**31), st.just(float("inf")),
                         st.just(float("nan")), st.just("abc"), st.just(-1))
    paths = st.sampled_from([("world_size",), ("step",), ("files", 0, "size"), ("files", 0, "xxh3_128"),
                             ("tensors", 0, "shards"), ("tensors", 0, "shards", 0, "offset"),
                             ("tensors", 0, "shards", 0, "length"), ("objects", 0, "offset"), ("components",),
                             ("contract",), ("files", 0), ("tensors", 0)])
    return st.tuples(paths, anything).map(lambda pv: _set_path(json.loads(json.dumps(base)), *pv))


def _set_path(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    node: Any = doc
    for i, p in enumerate(path):
        last = i == len(path) - 1
        if isinstance(p, int):
            if isinstance(node, dict) and node:
                k = sorted(node)[p % len(node)]
            elif isinstance(node, list) and node:
                k = p % len(node)
            else:
                return doc
        else:
            k = p
        if last:
            node[k] = value
        else:
            node = node[k]
    return doc


def test_structure_aware_metadata_and_manifests_never_crash(
    worker: AuditWorker, bases: dict[str, Base], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP ``.metadata`` built by torch's own classes and our manifests, each with one field set to an arbitrary
    value: the audit returns a report and ``check_metadata_safe`` either accepts or raises
    ``UnsafeCheckpointError``, never anything else."""
    from ckptaudit.formats.dcp.reader import UnsafeCheckpointError, check_metadata_safe
    from ckptaudit.store import save_checkpoint

    dcp_root = bases["dcp"].root
    tally = Tally()
    store_root = tmp_path / "store"
    from ckptaudit.launch import RankContext
    from ckptaudit.recipes.tinygpt import plain_recipe

    job = plain_recipe.setup(RankContext(rank=0, world_size=1, backend="gloo", shared_dir=""))
    saved = Path(save_checkpoint(job, store_root).path)
    manifest = json.loads((saved / "manifest.json").read_text())

    @settings(max_examples=METADATA_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(st.one_of(_metadata_edits().map(lambda e: ("metadata", e)),
                     _manifest_trees(manifest).map(lambda m: ("manifest", m))))
    def fuzz(case: tuple[str, Any]) -> None:
        kind, payload = case
        tally.inputs += 1
        where = tmp_path / f"case{tally.inputs}"
        if kind == "metadata":
            shutil.copytree(dcp_root, where)
            md = rc.read_dcp_metadata(where)
            try:
                _edit_metadata(md, payload)
                data = pickle.dumps(md)
            except Exception:  # an edit torch's classes cannot hold or pickle: nothing to test
                shutil.rmtree(where, ignore_errors=True)
                return
            (where / ".metadata").write_bytes(data)
            try:
                check_metadata_safe(str(where))
            except UnsafeCheckpointError:
                pass
        else:
            shutil.copytree(saved, where)
            (where / "manifest.json").write_text(json.dumps(payload))
        answer = worker.audit(str(where), timeout_s=TIME_BOUND_S * 3)
        assert answer["ok"], f"{kind}: {payload!r}\n{answer['error']}"
        assert answer["seconds"] < TIME_BOUND_S
        shutil.rmtree(where, ignore_errors=True)

    fuzz()
    with capsys.disabled():
        print(f"\nfuzz: {tally.inputs} structure-aware metadata objects and manifests audited, 0 crashes")
