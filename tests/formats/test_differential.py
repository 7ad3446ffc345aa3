"""The standing differential test: ckptaudit's reading of a container against the consumer's own reader.

Real checkpoints (written by ``torch.save``, ``torch.distributed.checkpoint.save`` and ``safetensors``) are mutated
structurally, seeded: entry order, counts, name case, prefixes, top folders, storage references, offsets, flags,
records, header JSON. Each mutant is read by ckptaudit (the readers behind ``ckptaudit audit``) and by the
consumer (``torch._C.PyTorchFileReader`` and ``torch.load(weights_only=True)``; DCP's ``FileSystemReader`` through
``torch.distributed.checkpoint.load``; ``safetensors.torch.load_file``), and two properties are held:

- **clean means the same**: whenever ckptaudit reports nothing wrong with a file, the consumer reads it, and
  what it returns is what ckptaudit described: the same tree, every tensor of the same dtype and shape and, bit
  for bit, the same bytes (ckptaudit's per-tensor hash against a hash of what torch returns);
- **code means an error**: mutants carrying a payload (a pickle that creates a marker file when unpickled) are
  loaded, in a child process, the way that runs code (``torch.load(weights_only=False)``, DCP's default planner);
  wherever a marker appears, ckptaudit must have reported an error for that file.

Thousands of cases a run (``CKPTAUDIT_DIFF_SEED`` picks another seed); it fails when any one of the checks of
:mod:`ckptaudit.formats.zip.miniz` and :mod:`ckptaudit.formats.zip.archive` that keep the two readings one is removed.
Run it alone::

    .venv/bin/python -m pytest -q tests/formats/test_differential.py
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct
import subprocess
import sys
import textwrap
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from ckptaudit.auditing.tensor_scan import scan_tensor
from ckptaudit.findings import Severity
from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.base import walk
from ckptaudit.formats.dcp.reader import read_dcp
from ckptaudit.formats.io.tensors import TensorData
from zip_mutants import Reduce, Zip, members_of, payload, stored, torch_pickle, torch_save_bytes

SEED = int(os.environ.get("CKPTAUDIT_DIFF_SEED", "20250"))
ZIP_CASES = 2400
DCP_CASES = 240
ST_CASES = 900
CHILD_TIMEOUT = 240


# ----------------------------------------------------------------------------------------------------------------
# The consumer's reading and ckptaudit's, flattened to {path: leaf}


def _tensor_leaf(t: torch.Tensor) -> tuple[Any, ...]:
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), xxhash.xxh3_128(raw).hexdigest())


def flat_torch(obj: Any, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    out: dict[tuple[Any, ...], Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = _tensor_leaf(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_torch(v, (*prefix, k)))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(flat_torch(v, (*prefix, i)))
    else:
        out[prefix] = (type(obj).__name__, obj)
    return out


def flat_ours(tree: Any, maps: Any, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    out: dict[tuple[Any, ...], Any] = {}
    for path, leaf in walk(tree, prefix):
        if isinstance(leaf, TensorData):
            out[path] = ("tensor", leaf.dtype.name, tuple(leaf.shape), scan_tensor(leaf, maps).hash)
        else:
            out[path] = (type(leaf).__name__, leaf)
    return out


def _problems(findings: list[Any]) -> list[Any]:
    """The reader's findings that say a file is not clean (any but information)."""
    return [f for f in findings if f.severity >= Severity.WARNING]


def _errors(findings: list[Any]) -> list[Any]:
    return [f for f in findings if f.severity >= Severity.ERROR and (f.code.startswith(("security.", "integrity.")))]


@dataclass
class Outcome:
    label: str
    path: Path
    clean: bool
    error: bool
    codes: tuple[str, ...]
    marker: Path | None


# ----------------------------------------------------------------------------------------------------------------
# The real checkpoints


def _bases() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4, 3, generator=g)
    model = {"w": w, "b": torch.randn(3, generator=g).to(torch.bfloat16), "tied": w[1:3],
             "idx": torch.arange(5), "h": torch.randn(2, 2, generator=g).to(torch.float16)}
    return {
        "state": {"model": model, "step": 7, "names": ["x", "y"], "lr": 0.1, "flag": True, "none": None},
        "shared": {"a": torch.zeros(0, dtype=torch.bfloat16), "w": torch.arange(8, dtype=torch.float32) / 3},
        "tensor": torch.randn(6, generator=g),
        "other": {"w": torch.full((4, 3), 2.5), "step": 1},
    }


# ----------------------------------------------------------------------------------------------------------------
# Zip mutations: each takes (rng, base name, Zip of the real archive, objects, marker) and changes the Zip


ZipMutation = Callable[[random.Random, "ZipCase"], None]


@dataclass
class ZipCase:
    base: str
    z: Zip
    objs: dict[str, Any]
    marker: Path
    names: list[str] = field(default_factory=list)
    payload: bool = False

    def index(self, suffix: str) -> int | None:
        for i, m in enumerate(self.z.members):
            if m.name.lower().endswith(suffix.encode()):
                return i
        return None

    def top(self) -> bytes:
        return self.z.members[0].name.split(b"/")[0]


def _swap_case(rng: random.Random, s: bytes) -> bytes:
    chars = bytearray(s)
    letters = [i for i, c in enumerate(chars) if chr(c).isalpha()]
    for i in rng.sample(letters, k=min(len(letters), rng.randint(1, 3))):
        chars[i] ^= 0x20
    return bytes(chars)


def m_reorder(rng: random.Random, c: ZipCase) -> None:
    n = len(c.z.members)
    c.z.local_order = rng.sample(range(n), n) if rng.random() < 0.6 else list(range(n))
    c.z.central_order = rng.sample(range(n), n) if rng.random() < 0.6 else list(range(n))


def m_count(rng: random.Random, c: ZipCase) -> None:
    if rng.random() < 0.5:
        c.z.count_delta = rng.choice((-2, -1, 1))
    else:
        c.z.zip64_count_delta = rng.choice((-1, 1))


def m_case(rng: random.Random, c: ZipCase) -> None:
    i = rng.randrange(len(c.z.members))
    m = c.z.members[i]
    top, _, rest = m.name.partition(b"/")
    if rng.random() < 0.7:
        c.z.members[i] = replace(m, name=top + b"/" + _swap_case(rng, rest))
    else:
        c.z.members[i] = replace(m, name=_swap_case(rng, top) + b"/" + rest)


def m_shadow(rng: random.Random, c: ZipCase) -> None:
    """A second data.pkl, equal to the first but for letter case, placed first or last, holding a payload or
    another checkpoint's pickle, sometimes hidden from miniz's count."""
    pkl = c.index("/data.pkl")
    if pkl is None:
        return
    if rng.random() < 0.5:
        shadow = payload(c.marker)
        c.payload = True
    else:
        shadow, _ = torch_pickle(c.objs["other"])
    name = c.top() + b"/" + rng.choice((b"DATA.pkl", b"Data.pkl", b"data.PKL"))
    c.z.members.append(stored(name, shadow))
    n = len(c.z.members)
    order = list(range(n - 1))
    if rng.random() < 0.5:
        order = [n - 1, *order]
        if rng.random() < 0.5:  # the real data.pkl last and left out of the count
            order.remove(pkl)
            order.append(pkl)
            c.z.count_delta = -1
    else:
        order.append(n - 1)
    c.z.central_order = order


def m_prefix(rng: random.Random, c: ZipCase) -> None:
    kind = rng.random()
    if kind < 0.4:
        c.z.prefix = payload(c.marker)
        c.payload = True
    elif kind < 0.7:  # a legacy-format torch.save of other tensors: torch.load reads it instead
        c.z.prefix = torch_save_bytes(c.objs["other"], _use_new_zipfile_serialization=False)
    else:
        c.z.prefix = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    c.z.relative = rng.random() < 0.5


def m_tail(rng: random.Random, c: ZipCase) -> None:
    kind = rng.random()
    if kind < 0.3:
        c.z.suffix = bytes(rng.randrange(256) for _ in range(rng.randint(1, 30)))
    elif kind < 0.6:
        c.z.comment = b"PK\x05\x06" + bytes(18) if rng.random() < 0.5 else b"hello"
    elif kind < 0.8:
        c.z.between = bytes(rng.randint(1, 24))
    else:
        c.z.zip64 = rng.random() < 0.5
        c.z.locator_delta = rng.choice((0, -4, 8, 1000))


def m_folder(rng: random.Random, c: ZipCase) -> None:
    i = rng.randrange(len(c.z.members))
    m = c.z.members[i]
    _top, _, rest = m.name.partition(b"/")
    c.z.members[i] = replace(m, name=rng.choice((b"other/", b"", b"archive/sub/", b"/")) + rest)


def m_storage(rng: random.Random, c: ZipCase) -> None:
    """data.pkl rewritten: a storage referenced with another dtype, size or key than its record."""
    pkl = c.index("/data.pkl")
    if pkl is None:
        return
    obj = c.objs[c.base]
    _clean, records = torch_pickle(obj)
    keys = sorted(records)
    key = rng.choice(keys)
    other = rng.choice(keys)
    nbytes = records[other]
    type_name, itemsize = rng.choice((("BFloat16Storage", 2), ("FloatStorage", 4), ("LongStorage", 8),
                                      ("HalfStorage", 2), ("ByteStorage", 1), ("UntypedStorage", 1)))
    numel = rng.choice((nbytes // itemsize, None, nbytes // itemsize + 1, 0))
    new, _ = torch_pickle(obj, {key: (rng.choice((other, other, "99")), type_name, numel)},
                          first_only=rng.random() < 0.5)
    c.z.members[pkl] = stored(c.z.members[pkl].name, new)


def m_offsets(rng: random.Random, c: ZipCase) -> None:
    i = rng.randrange(len(c.z.members))
    m = c.z.members[i]
    kind = rng.random()
    if kind < 0.25:  # an extra field in the local header: the data moves, both readers follow it
        c.z.members[i] = replace(m, local_extra=struct.pack("<HH", 0x4246, 4) + b"ZZZZ")
    elif kind < 0.4:  # sizes and offset in a zip64 extended information field (what archives over 4 GiB hold)
        for j in rng.sample(range(len(c.z.members)), k=rng.randint(1, len(c.z.members))):
            c.z.members[j] = replace(c.z.members[j], zip64=True)
    elif kind < 0.6:
        c.z.members[i] = replace(m, local_name=_swap_case(rng, m.name) if rng.random() < 0.5 else m.name + b"x")
    else:
        c.z.header_delta[i] = rng.choice((-30, -1, 1, 2, 64))


def m_attrs(rng: random.Random, c: ZipCase) -> None:
    i = rng.randrange(len(c.z.members))
    m = c.z.members[i]
    kind = rng.random()
    if kind < 0.35:  # deflated: torch inflates data.pkl; storages must stay stored
        comp = zlib.compressobj(6, zlib.DEFLATED, -15)
        raw = m.data
        c.z.members[i] = replace(m, method=8, data=comp.compress(raw) + comp.flush())
    elif kind < 0.55:
        c.z.members[i] = replace(m, external=0x10)
    elif kind < 0.75:
        c.z.members[i] = replace(m, flags=rng.choice((0x1, 0x20, 0x40, 0x2000, 0x800, 0x8)))
    elif kind < 0.9:
        c.z.members[i] = replace(m, size=m.size + rng.choice((-1, 1)) if m.size else 1)
    else:
        c.z.members[i] = replace(m, crc=m.crc ^ 1)


def m_records(rng: random.Random, c: ZipCase) -> None:
    top = c.top() + b"/"
    kind = rng.random()
    if kind < 0.15:
        v = c.index("/version")
        if v is not None:
            del c.z.members[v]
    elif kind < 0.4:
        v = c.index("/version")
        if v is not None:
            c.z.members[v] = stored(c.z.members[v].name, rng.choice(
                (b"3", b" 3\n", b"+3", b"3abc", b"10", b"11\n", b"0\n", b"-1", b"abc", b"99999999999999999999999")))
    elif kind < 0.5:
        c.z.members.append(stored(top + b".data/version", rng.choice((b"3\n", b"12\n"))))
    elif kind < 0.65:
        b = c.index("/byteorder")
        if b is not None:
            c.z.members[b] = stored(c.z.members[b].name, rng.choice((b"big", b"little\n", b" little", b"LITTLE")))
    elif kind < 0.75:
        a = c.index("/.storage_alignment")
        if a is not None:
            c.z.members[a] = stored(c.z.members[a].name, rng.choice((b"x", b" 64\n", b"32")))
    elif kind < 0.85:
        c.z.members.append(stored(top + rng.choice((b"constants.pkl", b"CONSTANTS.pkl")), pickle.dumps((), 2)))
    else:  # another pickle among the members (torch never unpickles it; ckptaudit refuses it)
        c.z.members.append(stored(top + rng.choice((b"extra.pkl", b"data/77", b"notes")), payload(c.marker)))


def m_payload(rng: random.Random, c: ZipCase) -> None:
    pkl = c.index("/data.pkl")
    if pkl is None:
        return
    c.z.members[pkl] = stored(c.z.members[pkl].name, payload(c.marker))
    c.payload = True


ZIP_MUTATIONS: dict[str, ZipMutation] = {
    "reorder": m_reorder, "count": m_count, "case": m_case, "shadow": m_shadow, "prefix": m_prefix,
    "tail": m_tail, "folder": m_folder, "storage": m_storage, "offsets": m_offsets, "attrs": m_attrs,
    "records": m_records, "payload": m_payload,
}


def _ours_file(path: Path) -> tuple[bool, bool, tuple[str, ...], dict[tuple[Any, ...], Any] | None]:
    """(clean, error, codes, flattened tree) of ckptaudit's reading of one file."""
    with open_checkpoint(str(path)) as ckpt:
        problems = _problems(ckpt.findings)
        codes = tuple(sorted({f.code for f in problems}))
        if problems or len(ckpt.parts) != 1:
            return False, bool(_errors(ckpt.findings)), codes, None
        return True, False, codes, flat_ours(ckpt.parts[0].tree, ckpt.maps)


def _torch_file(path: Path) -> tuple[str, dict[tuple[Any, ...], Any] | None]:
    """torch's reading: ``PyTorchFileReader`` opens it and ``torch.load(weights_only=True)`` loads it (neither
    runs code), or why not."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) == b"PK\x03\x04":
                reader = torch._C.PyTorchFileReader(str(path))
                reader.get_record("data.pkl")
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {str(exc)[:120]}", None
    return "read", flat_torch(obj)


def _check_clean_means_same(label: str, path: Path, ours: dict[Any, Any], consumer: tuple[str, Any]) -> None:
    verdict, theirs = consumer
    assert theirs is not None, f"{label}: ckptaudit calls {path.name} clean, torch {verdict}"
    assert ours == theirs, (f"{label}: ckptaudit calls {path.name} clean but reads it otherwise than torch:\n"
                            f"ckptaudit: {_diff(ours, theirs)}\ntorch:     {_diff(theirs, ours)}")


def _diff(a: dict[Any, Any], b: dict[Any, Any]) -> dict[Any, Any]:
    return {k: v for k, v in a.items() if b.get(k) != v}


def _run_child(script: str, args: list[str], tmp: Path) -> str:
    """Run ``script`` in a fresh interpreter (the unsafe loads happen there, never in the test process)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, cwd=tmp, check=False)
    assert proc.returncode == 0, f"child failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc.stdout


_UNSAFE_TORCH_LOADS = """
import sys, warnings, torch
warnings.simplefilter("ignore")
for path in open(sys.argv[1]).read().split("\\n"):
    if path:
        try:
            torch.load(path, map_location="cpu", weights_only=False)
        except BaseException:
            pass
print("done")
"""


def test_torch_save_mutants_read_as_torch_reads_them(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    objs = _bases()
    archives = {name: torch_save_bytes(objs[name]) for name in ("state", "shared", "tensor")}
    stats: Counter[str] = Counter()
    outcomes: list[Outcome] = []
    # The pristine archives, as torch.save wrote them and as re-laid out by the writer above: clean, and equal.
    for name, raw in archives.items():
        for label, data in ((f"{name} as saved", raw), (f"{name} re-laid", Zip(members_of(raw)).build())):
            path = tmp_path / f"pristine-{len(outcomes)}.pt"
            path.write_bytes(data)
            clean, _err, codes, ours = _ours_file(path)
            assert clean, (label, codes)
            assert ours is not None
            _check_clean_means_same(label, path, ours, _torch_file(path))
            outcomes.append(Outcome(label, path, True, False, (), None))
    kinds = list(ZIP_MUTATIONS)
    for n in range(ZIP_CASES):
        base = rng.choice(list(archives))
        case = ZipCase(base, Zip(members_of(archives[base])), objs, tmp_path / f"marker-{n}")
        chosen = rng.sample(kinds, k=rng.choice((1, 1, 1, 2, 2, 3)))
        for kind in chosen:
            ZIP_MUTATIONS[kind](rng, case)
        label = f"case {n} ({base}: {'+'.join(chosen)})"
        path = tmp_path / f"case-{n}.pt"
        path.write_bytes(case.z.build())
        clean, error, codes, ours = _ours_file(path)
        for kind in chosen:
            stats[f"{kind}:{'clean' if clean else 'refused'}"] += 1
        if clean:
            assert ours is not None
            _check_clean_means_same(label, path, ours, _torch_file(path))
        outcomes.append(Outcome(label, path, clean, error, codes, case.marker if case.payload else None))
    print("differential, torch.save:", dict(sorted(stats.items())))
    # Every kind of mutation produced files both readers read alike and files ckptaudit refused.
    for kind in ("reorder", "offsets", "attrs", "records", "tail", "storage", "case", "folder"):
        assert stats[f"{kind}:clean"] > 0, (kind, stats)
    for kind in kinds:
        assert stats[f"{kind}:refused"] > 0, (kind, stats)
    _code_means_an_error(outcomes, tmp_path, rng)


def _code_means_an_error(outcomes: list[Outcome], tmp_path: Path, rng: random.Random) -> None:
    """Load a sample of the mutants the unsafe way in a child: every marker that appears belongs to a file
    ckptaudit reported an error for."""
    armed = [o for o in outcomes if o.marker is not None]
    sample = rng.sample(armed, k=min(len(armed), 160))
    listing = tmp_path / "unsafe-loads.txt"
    by_marker = {str(o.marker): o for o in sample}
    listing.write_text("\n".join(str(o.path) for o in sample))
    assert _run_child(_UNSAFE_TORCH_LOADS, [str(listing)], tmp_path).strip() == "done"
    ran = [o for m, o in by_marker.items() if os.path.exists(m)]
    assert ran, "no payload ran under torch.load(weights_only=False): the sentinel proves nothing"
    for o in ran:
        assert o.error, f"{o.label}: torch.load(weights_only=False) ran its payload, ckptaudit reported {o.codes}"
    print(f"differential: {len(ran)} of {len(sample)} armed mutants ran code under torch.load(weights_only=False); "
          "ckptaudit reported an error for each")


# ----------------------------------------------------------------------------------------------------------------
# Legacy formats: torch.load reads them with its legacy loader


def _legacy_tar(storages: bytes, tensors: bytes, pickled: bytes) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("storages", storages), ("tensors", tensors), ("pickle", pickled)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_legacy_formats_are_refused_and_their_payloads_are_errors(tmp_path: Path) -> None:
    empty = pickle.dumps(0, 2)
    files: dict[str, tuple[bytes, Path | None]] = {}
    for i in range(4):
        marker = tmp_path / f"legacy-marker-{i}"
        files[f"tar-{i}"] = (_legacy_tar(empty + pickle.dumps([], 2), empty,
                                         payload(marker) if i % 2 else pickle.dumps({"w": 1}, 2)), marker)
        files[f"stream-{i}"] = (torch_save_bytes({"w": torch.ones(2), "x": Reduce(io.open, str(marker) + "s", "w")}
                                                 if i % 2 else {"w": torch.ones(2)},
                                                 _use_new_zipfile_serialization=False), Path(str(marker) + "s"))
    outcomes = []
    for name, (data, marker) in files.items():
        path = tmp_path / f"case-{name}.pt"
        path.write_bytes(data)
        clean, error, codes, _ours = _ours_file(path)
        assert not clean and error and "security.unvetted-pickle" in codes, (name, codes)
        outcomes.append(Outcome(f"case {name}", path, clean, error, codes, marker))
    _code_means_an_error(outcomes, tmp_path, random.Random(SEED))


# ----------------------------------------------------------------------------------------------------------------
# DCP: one item of a real checkpoint mutated, DCP's FileSystemReader against ckptaudit's DCP reader


@pytest.fixture(scope="module")
def dcp_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    state = {"model": {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
             "step": 3, "extra": {"k": [1, 2], "name": "run"}}
    root = tmp_path_factory.mktemp("dcp-base") / "ckpt"
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    return root


def _dcp_items(root: Path) -> tuple[Any, list[tuple[Any, Any]]]:
    with open(root / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    return md, sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))


def _write_dcp(base: Path, dest: Path, item_key: Any, new_item: bytes) -> None:
    """Copy ``base`` to ``dest`` with one item's bytes replaced (the items after it moved, ``.metadata`` updated)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md, items = _dcp_items(base)
    dest.mkdir()
    files: dict[str, bytearray] = {}
    for key, info in items:
        data = (base / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        if key == item_key:
            data = new_item
        out = files.setdefault(info.relative_path, bytearray())
        md.storage_data[key] = _StorageInfo(info.relative_path, len(out), len(data), info.transform_descriptors)
        out += data
    for rel, data in files.items():
        (dest / rel).write_bytes(bytes(data))
    with open(dest / ".metadata", "wb") as fh:
        pickle.dump(md, fh)


def _dcp_template(md: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        # a placeholder DCP replaces (it skips None)
        out[fqn] = torch.zeros(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) \
            else ""
    return out


def _torch_dcp(root: Path) -> tuple[str, dict[tuple[Any, ...], Any] | None]:
    """DCP's own reading: ``torch.distributed.checkpoint.load`` through ``FileSystemReader`` (tensors with
    ``weights_only=True`` as DCP loads them; non-tensor items with ``weights_only=True`` too, so nothing runs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    md, _items = _dcp_items(root)
    state = _dcp_template(md)
    try:
        dcp.load(state, storage_reader=FileSystemReader(str(root)), planner=Planner(flatten_state_dict=False),
                 no_dist=True)
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {str(exc)[:160]}", None
    out: dict[tuple[Any, ...], Any] = {}
    for fqn, value in state.items():
        out.update(flat_torch(value, tuple(md.planner_data.get(fqn, (fqn,)))))
    return "read", out


def _ours_dcp(root: Path) -> tuple[bool, bool, tuple[str, ...], dict[tuple[Any, ...], Any] | None]:
    from ckptaudit.formats.io.tensors import FileMaps

    read = read_dcp(str(root))
    problems = _problems(read.findings)
    codes = tuple(sorted({f.code for f in problems}))
    if problems or read.part is None:
        return False, bool(_errors(read.findings)), codes, None
    maps = FileMaps()
    try:
        flat = flat_ours(read.part.tree, maps)
    finally:
        maps.close()
    # ckptaudit turns int-keyed runs into lists and nests by planner data, as DCP's unflatten does
    return True, False, codes, flat


_UNSAFE_DCP_LOADS = """
import sys, pickle, warnings, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
warnings.simplefilter("ignore")
for root in open(sys.argv[1]).read().split("\\n"):
    if not root:
        continue
    try:
        md = pickle.load(open(root + "/.metadata", "rb"))
        state = {fqn: torch.zeros(it.size, dtype=it.properties.dtype) if isinstance(it, TensorStorageMetadata)
                 else "" for fqn, it in md.state_dict_metadata.items()}
        dcp.load(state, checkpoint_id=root, no_dist=True)
    except BaseException:
        pass
print("done")
"""


def test_dcp_mutants_read_as_dcp_reads_them(dcp_base: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ckptaudit.formats.dcp.reader import UnsafeCheckpointError, check_metadata_safe

    rng = random.Random(SEED + 1)
    md, items = _dcp_items(dcp_base)
    raw = {key: (dcp_base / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
           for key, info in items}
    is_bytes = {key: isinstance(md.state_dict_metadata[key.fqn], BytesStorageMetadata) for key, _ in items}
    objs = _bases()
    clean, theirs = _ours_dcp(dcp_base), _torch_dcp(dcp_base)
    assert clean[0] and clean[3] is not None, clean
    assert clean[3] == theirs[1], (clean[3], theirs)
    stats: Counter[str] = Counter()
    armed: list[tuple[Path, Path, bool]] = []
    kinds = [k for k in ZIP_MUTATIONS if k != "storage"]
    for n in range(DCP_CASES):
        key = rng.choice([k for k, _ in items])
        case = ZipCase("tensor", Zip(members_of(raw[key])), objs, tmp_path / f"dcp-marker-{n}")
        chosen = rng.sample(kinds, k=rng.choice((1, 1, 2)))
        for kind in chosen:
            ZIP_MUTATIONS[kind](rng, case)
        root = tmp_path / f"dcp-{n}"
        _write_dcp(dcp_base, root, key, case.z.build())
        ok, error, codes, ours = _ours_dcp(root)
        label = f"dcp case {n} ({key.fqn}, {'bytes' if is_bytes[key] else 'tensor'} item: {'+'.join(chosen)})"
        for kind in chosen:
            stats[f"{kind}:{'clean' if ok else 'refused'}"] += 1
        if ok:
            assert ours is not None
            verdict, dcp_flat = _torch_dcp(root)
            assert dcp_flat is not None, f"{label}: ckptaudit calls it clean, DCP {verdict}"
            assert ours == dcp_flat, f"{label}:\nckptaudit: {_diff(ours, dcp_flat)}\nDCP:       {_diff(dcp_flat, ours)}"
        if error and any(c.startswith("security.") for c in codes) and is_bytes[key]:
            # the live loader refuses what the audit refuses
            with pytest.raises(UnsafeCheckpointError):
                check_metadata_safe(str(root))
        if case.payload:
            armed.append((root, case.marker, error))
    print("differential, DCP:", dict(sorted(stats.items())))
    assert stats["reorder:clean"] > 0 and stats["prefix:refused"] > 0 and stats["shadow:refused"] > 0, stats
    listing = tmp_path / "unsafe-dcp-loads.txt"
    listing.write_text("\n".join(str(r) for r, _m, _e in armed))
    assert _run_child(_UNSAFE_DCP_LOADS, [str(listing)], tmp_path).strip() == "done"
    ran = [(r, e) for r, m, e in armed if m.exists()]
    assert ran, "no payload ran under torch.distributed.checkpoint.load: the sentinel proves nothing"
    for root, error in ran:
        assert error, f"{root.name}: DCP's load ran its payload, ckptaudit reported no error"
    print(f"differential: {len(ran)} of {len(armed)} armed DCP mutants ran code under DCP's load; ckptaudit "
          "reported an error for each")


# ----------------------------------------------------------------------------------------------------------------
# safetensors: the header JSON and the data mutated, the safetensors library against ckptaudit's reader


def _st_parts(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_build(header_text: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(header_text)) + header_text + body


def _st_mutant(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    header, body = _st_parts(data)
    names = [k for k in header if k != "__metadata__"]
    kind = rng.choice(("order", "dup", "offsets", "trailing", "padding", "metadata", "dtype", "shape", "numbers",
                       "text", "length"))
    entries = list(header.items())
    if kind == "order":
        rng.shuffle(entries)
        return kind, _st_build(json.dumps(dict(entries)).encode(), body)
    if kind == "dup":
        name = rng.choice(names)
        other = dict(header[rng.choice(names)])
        text = json.dumps(dict(entries))[:-1] + f', {json.dumps(name)}: {json.dumps(other)}}}'
        return kind, _st_build(text.encode(), body)
    if kind == "offsets":
        a, b = rng.sample(names, 2)
        sub = rng.random()
        if sub < 0.4:
            header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
        else:
            begin, end = header[a]["data_offsets"]
            d = rng.choice((-2, -1, 1, 2))
            header[a]["data_offsets"] = [max(0, begin + d), end + d] if sub < 0.7 else [begin, end + d]
        return kind, _st_build(json.dumps(header).encode(), body)
    if kind == "trailing":
        return kind, data + bytes(rng.randint(1, 8)) if rng.random() < 0.5 else data[:-rng.randint(1, 3)]
    if kind == "padding":
        text = json.dumps(header).encode()
        pad = rng.choice((b" " * 7, b"\t", b"\n", b"\r\n", b"\x00", b" \x0b"))
        return kind, _st_build(pad + text if rng.random() < 0.5 else text + pad, body)
    if kind == "metadata":
        header["__metadata__"] = rng.choice((None, [], "", {}, {"x": 1}, {"x": "1"}, {"x": None}, 0, False))
        return kind, _st_build(json.dumps(header).encode(), body)
    if kind == "dtype":
        name = rng.choice(names)
        header[name]["dtype"] = rng.choice(("F32", "BF16", "F16", "I64", "U8", "I8", "f32", "F64", "BOOL"))
        return kind, _st_build(json.dumps(header).encode(), body)
    if kind == "shape":
        name = rng.choice(names)
        shape = header[name]["shape"]
        header[name]["shape"] = rng.choice(([*shape, 1], list(reversed(shape)), [1, *shape], [0, 1 << 64],
                                            [1 << 40, 1 << 40, 0], shape[:-1]))
        return kind, _st_build(json.dumps(header).encode(), body)
    if kind == "numbers":
        name = rng.choice(names)
        text = json.dumps(header)
        begin, end = header[name]["data_offsets"]
        old = f'"data_offsets": [{begin}, {end}]'
        new = rng.choice((f'"data_offsets": [{begin}.0, {end}]', f'"data_offsets": [-0, {end}]' if begin == 0 else old,
                          f'"data_offsets": [{begin}, {end}e0]', f'"data_offsets": [{begin}, {end}]'))
        return kind, _st_build(text.replace(old, new).encode(), body)
    if kind == "text":
        name = rng.choice(names)
        text = json.dumps(header)
        new = rng.choice(("\\ud800", "\\u00e9", "\\u0000", "\\ud83d\\ude00", name.upper(), ""))
        text = text.replace(json.dumps(name), f'"{new}"', 1)
        raw = text.encode()
        if rng.random() < 0.2:
            raw = rng.choice((b"\xef\xbb\xbf" + raw, raw.decode().encode("utf-16"), raw.replace(b'"', b"'", 2)))
        return kind, _st_build(raw, body)
    # "length": the header length field off by a little (the JSON then ends early or late)
    text = json.dumps(header).encode() + b"  "
    n = len(text) + rng.choice((-2, -1, 1))
    return kind, struct.pack("<Q", n) + text + body


def test_safetensors_mutants_read_as_the_safetensors_library_reads_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    rng = random.Random(SEED + 2)
    g = torch.Generator().manual_seed(11)
    tensors = {"a": torch.randn(3, 2, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16),
               "c": torch.zeros(0, dtype=torch.int64), "d": torch.arange(3, dtype=torch.int16),
               "e": torch.randn(2, generator=g).to(torch.float16)}
    base = tmp_path / "base.safetensors"
    save_file(tensors, str(base), metadata={"format": "pt"})
    data = base.read_bytes()
    stats: Counter[str] = Counter()
    for n in range(ST_CASES):
        kind, mutant = _st_mutant(rng, data)
        path = tmp_path / f"st-{n}.safetensors"
        path.write_bytes(mutant)
        clean, _error, _codes, ours = _ours_file(path)
        stats[f"{kind}:{'clean' if clean else 'refused'}"] += 1
        if not clean:
            continue
        assert ours is not None
        try:
            theirs = {(k,): _tensor_leaf(v) for k, v in load_file(str(path)).items()}
        except Exception as exc:
            pytest.fail(f"st case {n} ({kind}): ckptaudit calls it clean, the safetensors library refuses it: {exc}")
        assert ours == theirs, f"st case {n} ({kind}):\nckptaudit: {_diff(ours, theirs)}\nlibrary: {_diff(theirs, ours)}"
    print("differential, safetensors:", dict(sorted(stats.items())))
    assert all(stats[f"{kind}:clean"] > 0 for kind in ("order", "padding", "metadata", "text", "shape")), stats
    assert all(stats[f"{kind}:refused"] > 0 for kind in ("padding", "metadata", "offsets", "text", "dup", "trailing",
                                                          "length", "numbers")), stats


def test_the_differential_test_can_fail(tmp_path: Path) -> None:
    """The comparison is not vacuous: a file read differently by the two readers is caught by it (here a hand-made
    difference: a tensor ckptaudit would read as float32 that torch hands back as bfloat16)."""
    objs = _bases()
    path = tmp_path / "shared.pt"
    path.write_bytes(torch_save_bytes(objs["shared"]))
    clean, _e, _c, ours = _ours_file(path)
    assert clean and ours is not None
    forged = dict(ours)
    forged[("w",)] = ("tensor", "bfloat16", (16,), "0")
    with pytest.raises(AssertionError, match="reads it otherwise than torch"):
        _check_clean_means_same("forged", path, forged, _torch_file(path))
