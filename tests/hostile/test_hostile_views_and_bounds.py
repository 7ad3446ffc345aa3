"""Hostile input, round 2 (issue 16): one view of every object, bounded work, damage that must not pass as intact.

Each attack is written as an attacker would write it (torch's own ``Metadata`` pickled with a crafted
``__reduce__``, or opcodes assembled by hand) and run through every entry point that reads it: ``audit`` (in a
child under ``RLIMIT_AS`` and a timeout, see :mod:`audit_worker`), ``check_metadata_safe``, ``vetted_dcp_load``
and the CLI. Payloads write a sentinel file; a control run of ``torch.distributed.checkpoint.load`` in a child
shows each payload is live, so a test cannot pass because the attack was inert.
"""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pytest

import hostile_files as hf
import real_checkpoints as rc
from audit_worker import AuditWorker
from ckptaudit.auditing.judge import run_audit
from ckptaudit.cli import main
from ckptaudit.formats.dcp.reader import UnsafeCheckpointError, check_metadata_safe
from ckptaudit.formats.pickle.scan import UnsafeGlobalError
from ckptaudit.formats.pickle.unpickler import RestrictedUnpickler, base_table
from ckptaudit.formats.torchload import vetted_dcp_load
from hostile_cases import (
    ATTACKS,
    BOUNDED,
    JSON_CASES,
    M61,
    Shadowed,
    case_collisions_data_pkl,
    case_memo_amplification,
    memo_mutated_index,
    payload_dcp,
    shadow,
)

# --------------------------------------------------------------------------------------------------------------
# One view: a pickle may not give an object an attribute that shadows a method a check reads it through


@pytest.mark.parametrize("how", ATTACKS)
def test_metadata_that_shows_checks_another_view_is_refused_everywhere(
        how: str, tmp_path: Path, worker: AuditWorker) -> None:
    import torch

    sentinel = tmp_path / "ran"
    ckpt = payload_dcp(tmp_path / "ckpt", str(sentinel))
    if how == "memo-mutated-MetadataIndex":
        memo_mutated_index(ckpt)
    else:
        shadow(ckpt, how)
    control = tmp_path / "control"
    shutil.copytree(ckpt, control)

    with pytest.raises(UnsafeCheckpointError, match=r"shadow|second BUILD|crafted"):
        check_metadata_safe(str(ckpt))
    with pytest.raises(UnsafeCheckpointError):
        vetted_dcp_load({"model": {"0.weight": torch.zeros(16, 8)}, "extra": 0}, str(ckpt))
    answer = worker.audit(str(ckpt))
    assert answer["ok"], answer.get("error")
    assert any(c == "security.unsafe-pickle" and s == ".metadata" for c, s, _ in answer["findings"]), \
        answer["findings"]
    assert answer["seconds"] < 30
    out, err = io.StringIO(), io.StringIO()
    assert main(["audit", str(ckpt), "--no-progress"], stdout=out, stderr=err) == 1
    assert ".metadata" in out.getvalue()
    assert not sentinel.exists(), "a payload ran inside ckptaudit"

    # Control (after every ckptaudit entry point, as the payload writes the same sentinel): torch's own loader
    # reaches the non-tensor item by key and runs it, whatever the shadowed method would have shown a check.
    if how == "items":
        hf.run_unsafely([("dcp", str(control))])
        assert sentinel.exists(), "the control did not run the payload"


def test_safe_dcp_load_restores_exactly_what_was_saved(bases: dict[str, Path]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    def template() -> dict[str, Any]:
        return {"model": {"0.weight": torch.zeros(16, 8), "2.bias": torch.zeros(4)}, "step": torch.tensor(0)}

    state, ref = template(), template()
    vetted_dcp_load(state, str(bases["dcp"]))
    dcp.load(ref, checkpoint_id=str(bases["dcp"]))  # torch's own reader on our own trusted checkpoint
    assert int(state["step"]) == int(ref["step"]) == 2
    for k in ref["model"]:
        assert torch.equal(state["model"][k], ref["model"][k]) and ref["model"][k].abs().sum() > 0
    with pytest.raises(TypeError, match="storage reader"):
        vetted_dcp_load(state, str(bases["dcp"]), storage_reader=object())


@pytest.mark.parametrize("how", ["items", "values"])
def test_torch_save_dict_with_a_shadowing_attribute_is_refused(how: str, tmp_path: Path) -> None:
    import torch

    path = tmp_path / "model.pt"
    torch.save({"model": Shadowed({f"w{i}": torch.ones(4) for i in range(3)}, how)}, path)
    report = run_audit(str(path))
    assert any(f.code == "integrity.corrupt" and how in f.message and "shadow" in f.message
               for f in report.findings), [(f.code, f.message) for f in report.findings]
    assert not report.tensors


# --------------------------------------------------------------------------------------------------------------
# The second allowlist check: the restricted unpickler resolves names only through its table (issue 15)


@pytest.mark.parametrize("kind", ["os.system", "stack_global_memo", "io.open"])
def test_restricted_unpickler_refuses_globals_outside_its_table_without_a_scan(kind: str, tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"
    data = hf.payload_pickle(kind, str(sentinel))
    with pytest.raises(UnsafeGlobalError):
        RestrictedUnpickler(io.BytesIO(data), base_table()).load()
    assert not sentinel.exists()
    # Control: the same bytes run the payload through plain pickle.
    hf.run_unsafely([("pickle", _write(tmp_path / "p.pkl", data))])
    assert sentinel.exists()


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


# --------------------------------------------------------------------------------------------------------------
# Bounded work: hash collisions, opcode amplification


@pytest.mark.parametrize("case", list(BOUNDED))
def test_quadratic_and_amplifying_pickles_end_in_a_finding_fast(
        case: str, bases: dict[str, Path], tmp_path: Path, worker: AuditWorker) -> None:
    build, fragment = BOUNDED[case]
    path = build(bases, tmp_path)
    start = time.perf_counter()
    answer = worker.audit(str(path))
    assert answer["ok"], answer.get("error")
    assert any(c == "integrity.corrupt" and fragment in m for c, _, m in answer["findings"]), answer["findings"]
    assert time.perf_counter() - start < 30, answer["seconds"]
    assert answer["maxrss_mib"] - worker.baseline_mib < 300, (answer["maxrss_mib"], worker.baseline_mib)


# --------------------------------------------------------------------------------------------------------------
# Layout: DCP shards must tile each tensor exactly


def test_dcp_shards_that_overlap_and_leave_a_hole_are_corrupt(tmp_path: Path) -> None:
    """Two ranks' shards of a (4, 2) tensor claim rows 0-1 and 1-2: the sizes add up, row 3 is never written
    (``torch.distributed.checkpoint.load`` silently leaves it as it was)."""
    import torch

    ckpt = rc.dcp_checkpoint(tmp_path / "ckpt", {"sharded": torch.arange(8.0).reshape(4, 2)})
    md = rc.read_dcp_metadata(ckpt)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    item = md.state_dict_metadata["sharded"]
    (key,) = [k for k in md.storage_data if k.fqn == "sharded"]
    info = md.storage_data.pop(key)
    # Rewrite as two shards of 2 rows each, at rows 0 and 1, both pointing at a real (2, 2) shard's bytes.
    half = rc.dcp_checkpoint(tmp_path / "half", {"sharded": torch.arange(4.0).reshape(2, 2)})
    half_md = rc.read_dcp_metadata(half)
    (hkey,) = [k for k in half_md.storage_data if k.fqn == "sharded"]
    hinfo = half_md.storage_data[hkey]
    for rank in (8, 9):  # each shard in its own file, so no two items share bytes
        shutil.copy(half / hinfo.relative_path, ckpt / f"__{rank}_0.distcp")
    item.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                   ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 2]))]
    for rank, row in ((8, 0), (9, 1)):
        md.storage_data[MetadataIndex("sharded", [row, 0])] = type(info)(f"__{rank}_0.distcp", hinfo.offset,
                                                                         hinfo.length)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    report = run_audit(str(ckpt))
    bad = [f for f in report.findings if f.code == "integrity.corrupt" and f.subject == "sharded"]
    assert bad and "overlap" in bad[0].message, [(f.code, f.subject, f.message) for f in report.findings]


# --------------------------------------------------------------------------------------------------------------
# JSON: bounded size, containers and nesting; files that are not regular never block


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_json_bombs_end_in_a_finding_within_bounds(
        case: str, bases: dict[str, Path], tmp_path: Path, worker: AuditWorker) -> None:
    build, fragment = JSON_CASES[case]
    path = build(bases, tmp_path)
    answer = worker.audit(str(path))
    assert answer["ok"], answer.get("error")
    assert any(c == "integrity.corrupt" and fragment in m for c, _, m in answer["findings"]), answer["findings"]
    assert answer["seconds"] < 30
    assert answer["maxrss_mib"] - worker.baseline_mib < 300, (answer["maxrss_mib"], worker.baseline_mib)


@pytest.mark.parametrize("where", ["latest-pointer", "manifest.json", "manifest.json->/dev/zero"])
def test_latest_never_blocks_on_a_fifo_or_reads_a_device(where: str, bases: dict[str, Path], tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = tmp_path / "run"
    step = root / "step-000010"
    shutil.copytree(bases["dcp"], step)
    if where == "latest-pointer":
        os.mkfifo(root / "latest")
    elif where == "manifest.json":
        os.mkfifo(step / "manifest.json")
    else:
        (step / "manifest.json").symlink_to("/dev/zero")
    proc = subprocess.run([sys.executable, "-m", "ckptaudit", "latest", str(root), "--format", "json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------------------------
# Every value printable: integers past Python's int-to-string limit, NaN, infinities, NumPy arrays


PRINT_CASES: dict[str, Any] = {
    "step-of-5000-digits": lambda m: {"model": m.state_dict(), "step": 10**5000},
    "lightning-global-step-of-5000-digits": lambda m: {
        "state_dict": m.state_dict(), "global_step": 10**5000, "epoch": float("inf"),
        "loops": {"fit_loop": {"state_dict": {}}}, "optimizer_states": [], "lr_schedulers": []},
    "nan-and-infinities": lambda m: {"model": m.state_dict(), "step": float("nan"), "loss": float("-inf")},
    "numpy-rng-state": lambda m: {"model": m.state_dict(), "rng_state": {"numpy": _np_state(), "v": _np_array()}},
    "numpy-array-as-the-rng-state": lambda m: {"model": m.state_dict(), "rng_state": _np_array(),
                                               "scheduler": _np_array(), "dataloader": _np_array()},
    "numpy-array-as-lightning-loader-state": lambda m: {
        "state_dict": m.state_dict(), "global_step": 3, "epoch": 0, "optimizer_states": [], "lr_schedulers": [],
        "loops": {"fit_loop": {"state_dict": {"combined_loader": _np_array()}}}},
}


def _np_state() -> Any:
    import numpy as np

    return np.random.RandomState(0).get_state()


def _np_array() -> Any:
    import numpy as np

    return np.arange(5, dtype=np.int64)


@pytest.mark.parametrize("case", list(PRINT_CASES))
def test_values_python_cannot_print_are_rendered_not_raised(case: str, tmp_path: Path) -> None:
    import json

    import torch

    path = tmp_path / "ckpt.pt"
    torch.save(PRINT_CASES[case](torch.nn.Linear(2, 2)), path)
    for fmt in ("json", "table"):
        out, err = io.StringIO(), io.StringIO()
        assert main(["audit", str(path), "--no-progress", "--format", fmt], stdout=out, stderr=err) in (0, 1), \
            err.getvalue()
        if fmt == "json":
            json.loads(out.getvalue())  # strict JSON: no NaN, no Infinity literals
    out, err = io.StringIO(), io.StringIO()
    assert main(["compare", str(path), str(path), "--no-progress", "--format", "json"], stdout=out,
                stderr=err) in (0, 1), err.getvalue()
    json.loads(out.getvalue())


def test_printable_spells_what_json_cannot_hold() -> None:
    from ckptaudit.findings import printable

    assert printable(10**5000) == "<integer of about 5001 digits>"
    assert [printable(float(x)) for x in ("nan", "inf", "-inf")] == ["NaN", "Infinity", "-Infinity"]
    assert printable(7) == 7 and printable(1.5) == 1.5 and printable(True) is True


def test_a_serving_gate_holding_infinity_is_reported(bases: dict[str, Path], tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    gate = '{"passed": false, "max_abs_error": Infinity, "failures": ["error Infinity"]}'
    save_file(load_file(str(bases["st"])), str(path), metadata={"artifact": "serving", "quality_gate": gate})
    out, err = io.StringIO(), io.StringIO()
    assert main(["audit", str(path), "--no-progress", "--expect", "serving", "--format", "json"], stdout=out,
                stderr=err) == 1, err.getvalue()
    doc = json.loads(out.getvalue())
    (failed,) = [f for f in doc["findings"] if f["code"] == "artifact.gate-failed"]
    assert failed["evidence"]["gate"]["max_abs_error"] == "Infinity"


# --------------------------------------------------------------------------------------------------------------
# safetensors: the tensors tile the data section, names are unique


def _rewrite_safetensors(src: Path, dst: Path, header_text: bytes, data: bytes) -> Path:
    dst.write_bytes(struct.pack("<Q", len(header_text)) + header_text + data)
    return dst


@pytest.mark.parametrize("damage", ["gap", "trailing-bytes", "duplicate-key"])
def test_safetensors_that_the_library_refuses_are_corrupt(damage: str, tmp_path: Path) -> None:
    import json

    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "ok.safetensors"
    save_file({"a": torch.ones(4), "b": torch.full((4,), 2.0)}, str(src))
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    (first, second) = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    if damage == "gap":  # the second tensor moves 16 bytes on; bytes 16..32 belong to nobody
        header[second]["data_offsets"] = [32, 48]
        data = data[:16] + b"\0" * 16 + data[16:]
        text = json.dumps(header).encode()
    elif damage == "trailing-bytes":
        data += b"\0" * 64
        text = json.dumps(header).encode()
    else:  # the second name also holds the first tensor: json.loads would keep one of the two silently
        body = json.dumps({k: v for k, v in header.items() if k != second})
        text = (body[:-1] + ", " + json.dumps(first) + ": " + json.dumps(header[second]) + "}").encode()
    bad = _rewrite_safetensors(src, tmp_path / "model.safetensors", text, data)
    with pytest.raises(Exception):  # the reference library refuses it too (with its own error type)
        load_file(str(bad))
    report = run_audit(str(bad))
    assert any(f.code == "integrity.corrupt" and {"gap": "gap", "trailing-bytes": "no tensor holds",
                                                  "duplicate-key": "twice"}[damage] in f.message
               for f in report.findings), [(f.code, f.message) for f in report.findings]


# --------------------------------------------------------------------------------------------------------------
# Manifests: sparse files, malformed entries


def test_a_sparse_8gib_file_is_hashed_without_mapping_it(tmp_path: Path) -> None:
    """Hashing runs in a child whose address space is capped at +512 MiB: mapping the 8 GiB file (the old way)
    fails there; reading it through one buffer, holes fed as zeros, takes about a second."""
    import subprocess
    import sys

    path = tmp_path / "__0_0.distcp"
    with open(path, "wb") as fh:
        fh.truncate(8 << 30)
        fh.seek(1 << 30)
        fh.write(b"x" * 4096)
    script = f"""
import resource, time, xxhash
from ckptaudit.ondisk.manifest import hash_file
with open("/proc/self/status") as fh:
    vm = next(int(l.split()[1]) for l in fh if l.startswith("VmSize:")) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
start = time.perf_counter()
size, digest, (item,) = hash_file({str(path)!r}, [((1 << 30), 4096)])
ref, zeros = xxhash.xxh3_128(), bytes(1 << 20)
for block in range(8192):  # 1 MiB at a time: the reference must fit under the cap too
    ref.update(b"x" * 4096 + zeros[4096:] if block == 1024 else zeros)
assert size == 8 << 30 and digest == ref.hexdigest(), digest
assert item == xxhash.xxh3_128(b"x" * 4096).hexdigest()
print(time.perf_counter() - start)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_malformed_manifest_entries_are_skipped_not_raised(tmp_path: Path) -> None:
    from ckptaudit.ondisk.manifest import items_by_file, verify_files

    (tmp_path / "a.distcp").write_bytes(b"x" * 10)
    manifest: dict[str, Any] = {
        "files": {"a.distcp": {"size": 10, "xxh3_128": "0" * 32}},
        "tensors": {"w": {"shards": 5}, "v": {"shards": [{"file": "a.distcp", "offset": "abc", "length": 1e309}]},
                    "u": {"shards": [{"file": "a.distcp", "offset": float("nan"), "length": 2**80}]}},
        "objects": {"o": {"file": "a.distcp", "offset": [1], "length": None}},
    }
    assert sorted(label for label, _ in items_by_file(manifest)["a.distcp"]) == ["o", "u", "v"]
    (bad,) = verify_files(str(tmp_path), manifest)
    assert bad.code == "integrity.corrupt" and "content differs" in bad.message


# --------------------------------------------------------------------------------------------------------------
# Links that leave the checkpoint: reported with their target, never refused; `latest` never judges through one


def test_a_file_linked_from_outside_is_read_and_reported(bases: dict[str, Path], tmp_path: Path) -> None:
    outside = tmp_path / "cache" / "blob"
    outside.parent.mkdir()
    shutil.copy(bases["st"], outside)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").symlink_to(outside)  # how the Hugging Face cache lays out a snapshot
    report = run_audit(str(ckpt))
    (link,) = [f for f in report.findings if f.code == "integrity.link-outside"]
    assert link.subject == "model.safetensors" and link.evidence["target"] == str(outside.resolve())
    assert report.tensors and all(t.hash is not None for t in report.tensors)


def test_latest_never_judges_a_candidate_that_links_elsewhere(bases: dict[str, Path], tmp_path: Path) -> None:
    from ckptaudit.latest import find_latest

    elsewhere = tmp_path / "other-run" / "step-000099"
    shutil.copytree(bases["dcp"], elsewhere)
    root = tmp_path / "run"
    shutil.copytree(bases["dcp"], root / "step-000010")
    (root / "step-000099").symlink_to(elsewhere)
    result = find_latest(str(root), verify="sizes")
    seen = [ch.candidate.name for ch in result.checked] + [c.name for c in result.unchecked]
    assert "step-000099" not in seen and "step-000010" in seen, seen


# --------------------------------------------------------------------------------------------------------------
# Zip: central directory and local headers agree one to one


def _shared_local_header_zip(src: Path, dst: Path, entries: int) -> Path:
    """``src``'s first member, then a central directory listing it ``entries`` times under distinct names (all
    pointing at the one local header), as a hostile archive would."""
    import zipfile

    with zipfile.ZipFile(src) as zf:
        first = zf.infolist()[0]
    raw = src.read_bytes()
    (name_len, extra_len) = struct.unpack_from("<HH", raw, 26)
    local_end = 30 + name_len + extra_len + first.compress_size
    local = raw[:local_end]
    central = []
    for i in range(entries):
        name = f"{first.filename}.{i}".encode()
        central.append(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, first.CRC,
                                   first.compress_size, first.file_size, len(name), 0, 0, 0, 0, 0, 0) + name)
    cd = b"".join(central)
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, min(entries, 0xFFFF), min(entries, 0xFFFF), len(cd),
                       len(local), 0)
    dst.write_bytes(local + cd + eocd)
    return dst


def test_central_entries_sharing_one_local_header_are_corrupt(
        bases: dict[str, Path], tmp_path: Path, worker: AuditWorker) -> None:
    path = _shared_local_header_zip(bases["pt"], tmp_path / "model.pt", 60_000)
    answer = worker.audit(str(path))
    assert answer["ok"], answer.get("error")
    assert any(c == "integrity.corrupt" and "share local headers" in m for c, _, m in answer["findings"]), \
        answer["findings"]
    assert answer["seconds"] < 30


def test_a_non_tensor_dcp_item_that_would_hang_torch_load_is_refused_before_loading(tmp_path: Path) -> None:
    """A DCP item (saved by DCP itself) holding a dict of 5000 integer keys that all hash alike: torch.load would
    build it in quadratic time (200k keys: minutes); the guard loads it restricted first and refuses it."""
    import torch

    colliding: dict[int, int] = {}
    for i in range(1, 5001):  # 12.5M comparisons to build here, once
        colliding[i * M61] = 0
    ckpt = rc.dcp_checkpoint(tmp_path / "ckpt", {"extra": (colliding,)})  # a tuple: one item, not flattened
    start = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match="share the hash value"):
        check_metadata_safe(str(ckpt))
    with pytest.raises(UnsafeCheckpointError, match="share the hash value"):
        vetted_dcp_load({"model": {"0.weight": torch.zeros(16, 8)}, "extra": {}}, str(ckpt))
    assert time.perf_counter() - start < 30


def test_a_manifest_claiming_2_31_ranks_is_bounded_by_what_is_on_disk(tmp_path: Path) -> None:
    import json

    from ckptaudit.launch import RankContext
    from ckptaudit.recipes.tinygpt import plain_recipe
    from ckptaudit.store import save_checkpoint

    job = plain_recipe.setup(RankContext(rank=0, world_size=1, backend="gloo", shared_dir=""))
    saved = Path(save_checkpoint(job, tmp_path / "run").path)
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["world_size"] = 2**31
    (saved / "manifest.json").write_text(json.dumps(manifest))
    start = time.perf_counter()
    report = run_audit(str(saved))
    assert time.perf_counter() - start < 30
    lost = [f for f in report.findings if f.code == "component.missing" and "2147483648 ranks" in f.message]
    assert lost and all(len(f.evidence["ranks"]) <= 64 for f in lost), [(f.code, f.message) for f in report.findings]


# --------------------------------------------------------------------------------------------------------------
# The live loader (vetted_torch_load: the writer's loader, resume, compare's values) refuses what the audit refuses


def test_the_live_loader_refuses_the_bounded_work_attacks_before_torch_load(
        bases: dict[str, Path], tmp_path: Path) -> None:
    """``vetted_torch_load`` reads the archive as the audit does (same scan, same restricted unpickler and limits)
    before ``torch.load`` sees it: 200k colliding keys in ``data.pkl`` and 4M memo entries are refused in a
    second or so with an error naming the file and the limit; the ordinary checkpoint (NumPy and Python RNG
    states included) still loads. Run in a child with a timeout: the unguarded ``torch.load`` of the colliding
    dict takes minutes."""
    import json
    import subprocess
    import sys

    (tmp_path / "collisions").mkdir()
    (tmp_path / "memo").mkdir()
    cases = {"collisions": case_collisions_data_pkl(bases, tmp_path / "collisions"),
             "memo": case_memo_amplification(bases, tmp_path / "memo")}
    script = f"""
import json, time
import torch
from ckptaudit.formats.torchload import vetted_torch_load
out = {{}}
for name, path in {json.dumps({k: str(v) for k, v in cases.items()})}.items():
    start = time.process_time()
    try:
        vetted_torch_load(path)
        out[name] = ["loaded", "", time.process_time() - start]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc), time.process_time() - start]
state = vetted_torch_load({str(bases["pt"])!r})
out["normal"] = [sorted(state), state["step"], type(state["rng"]["numpy"][1]).__name__,
                 str(state["model"]["0.weight"].dtype)]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    kind, message, cpu_s = out["collisions"]
    assert kind == "UnsafeCheckpointError", out
    assert str(cases["collisions"]) in message and "more than 64 keys of one dict share the hash value" in message
    assert "refusing to load it" in message and "docs/security.md" in message
    assert cpu_s < 20, cpu_s  # CPU seconds in the child; the refusal itself is ~1 s on a quiet machine
    kind, message, cpu_s = out["memo"]
    assert kind == "UnsafeCheckpointError" and str(cases["memo"]) in message and "amplification" in message, out
    assert out["normal"][:2] == [["model", "optimizer", "rng", "scheduler", "step"], 2]
    assert out["normal"][2:] == ["ndarray", "torch.float32"], out["normal"]
