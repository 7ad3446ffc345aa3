"""torch's plain values in pickles (dtypes, devices, sizes) read through the torch-free stand-ins of
``ckptaudit.formats.pickle.torch_values``: the same objects, to every reader and renderer, as torch's own, and at least
as strict. The references are torch itself: the real classes in the unpickler's table (what ``base_table`` held
before the stand-ins), and ``torch.save`` / ``pickle`` of real torch objects."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.auditing.judge import run_audit
from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.pickle.allowlist import TORCH_DTYPES
from ckptaudit.formats.pickle.torch_values import TorchDevice, TorchDtype, TorchSize
from ckptaudit.formats.pickle.unpickler import RestrictedUnpickler, base_table


def _torch_table() -> dict[str, Any]:
    """The unpickler's table with torch's real classes and dtypes, as ``base_table`` built it with torch."""
    table = dict(base_table())
    table["torch.Size"] = torch.Size
    table["torch.device"] = torch.device
    for d in TORCH_DTYPES:
        table[f"torch.{d}"] = getattr(torch, d)
    return table


def _outcome(data: bytes, table: dict[str, Any]) -> tuple[str, str]:
    """("ok", what the loaded object reads as) or ("refused", the exception's class)."""
    try:
        value = RestrictedUnpickler(io.BytesIO(data), table).load()
    except Exception as exc:  # any refusal; its kind is compared below
        return "refused", type(exc).__name__
    return "ok", _reads_as(value)


def _reads_as(value: Any) -> str:
    """Everything a reader or renderer sees of a value: type name, repr, str, and for containers their items."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_reads_as(k)}: {_reads_as(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_reads_as(v) for v in value) + "]"
    return f"{type(value).__name__}|{value!r}|{value}"


def _pickle(op: bytes) -> bytes:
    return b"\x80\x02" + op + b"."


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


GLOBAL_DEVICE, GLOBAL_SIZE, GLOBAL_F32 = b"ctorch\ndevice\n", b"ctorch\nSize\n", b"ctorch\nfloat32\n"

SAME = {
    # what torch.save / pickle write
    "dtypes": pickle.dumps([getattr(torch, d) for d in TORCH_DTYPES], protocol=2),
    "dtypes-p4": pickle.dumps([getattr(torch, d) for d in TORCH_DTYPES], protocol=4),
    "devices": pickle.dumps([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"),
                             torch.device("cpu", 0), torch.device("cuda:7")], protocol=2),
    "sizes": pickle.dumps([torch.Size([2, 3]), torch.Size([]), torch.Size([0, 2**62])], protocol=4),
    "dtype-keys": pickle.dumps({torch.float16: 1, torch.bfloat16: 2}, protocol=2),
    "size-keys": pickle.dumps({torch.Size([2, 3]): "a"}, protocol=2),
    # refused by both
    "device-key": pickle.dumps({torch.device("cpu"): 1}, protocol=2),
    "dtype-called": _pickle(GLOBAL_F32 + b")R"),
    "device-built": _pickle(GLOBAL_DEVICE + _s("cpu") + b"\x85R}b"),
    "device-newobj-empty": _pickle(GLOBAL_DEVICE + b")\x81"),
    "device-unknown-type": _pickle(GLOBAL_DEVICE + _s("evil") + b"\x85R"),
    "device-two-indices": _pickle(GLOBAL_DEVICE + _s("cuda:0") + b"K\x01\x86R"),
    "device-bad-string": _pickle(GLOBAL_DEVICE + _s("cuda:01") + b"\x85R"),
    "device-index-str": _pickle(GLOBAL_DEVICE + _s("cuda") + _s("0") + b"\x86R"),
    "device-negative": _pickle(GLOBAL_DEVICE + _s("cuda") + b"J\xff\xff\xff\xff\x86R"),
    "device-bare-index": _pickle(GLOBAL_DEVICE + b"K\x05\x85R"),
    "size-of-floats": _pickle(GLOBAL_SIZE + b"G?\xf0\x00\x00\x00\x00\x00\x00\x85\x85R"),
    "size-of-none": _pickle(GLOBAL_SIZE + b"N\x85R"),
    "size-of-str": _pickle(GLOBAL_SIZE + _s("ab") + b"\x85R"),
    # NEWOBJ and NEWOBJ_EX, as torch's own __new__ allows them
    "device-newobj": _pickle(GLOBAL_DEVICE + _s("cuda") + b"K\x02\x86\x81"),
    "device-newobj-kwargs": b"\x80\x04" + GLOBAL_DEVICE + b")}(" + _s("type") + _s("cuda") + _s("index")
    + b"K\x03u\x92.",
    "size-newobj": _pickle(GLOBAL_SIZE + b"K\x02K\x03\x86\x85\x81"),
}
STRICTER = {
    # torch takes these (negative sizes, booleans, an index it wraps into 8 bits); the stand-ins refuse them
    "size-negative": pickle.dumps(torch.Size([-1]), protocol=2),
    "size-bool": _pickle(GLOBAL_SIZE + b"\x88\x85\x85R"),
    "device-index-wraps": _pickle(GLOBAL_DEVICE + _s("cuda") + b"K\x80\x86R"),
}


@pytest.mark.parametrize("case", sorted(SAME))
def test_stand_ins_load_and_refuse_as_torch_does(case: str) -> None:
    data = SAME[case]
    ours, theirs = _outcome(data, base_table()), _outcome(data, _torch_table())
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "ok":
        assert ours == theirs


@pytest.mark.parametrize("case", sorted(STRICTER))
def test_stand_ins_refuse_what_torch_takes_leniently(case: str) -> None:
    assert _outcome(STRICTER[case], _torch_table())[0] == "ok"
    assert _outcome(STRICTER[case], base_table()) == ("refused", "UnpicklingError")


def test_stand_ins_compare_and_hash_as_torch_does() -> None:
    table = base_table()
    assert table["torch.float"] is table["torch.float32"] is TorchDtype.named("float32")
    assert table["torch.float32"] != table["torch.float64"]
    assert TorchDevice("cuda", 1) == TorchDevice("cuda:1") != TorchDevice("cuda")
    assert hash(TorchDevice("cuda", 1)) == hash(TorchDevice("cuda:1"))
    assert (TorchDevice("cpu") == "cpu") is (torch.device("cpu") == "cpu") is False
    assert TorchSize([2, 3]) == (2, 3) == torch.Size([2, 3]) and hash(TorchSize([2, 3])) == hash((2, 3))


def test_stand_ins_hold_their_declared_fields_only() -> None:
    dev, dt, size = TorchDevice("cuda", 1), TorchDtype.named("bfloat16"), TorchSize([2])
    for obj, attr in ((dev, "index"), (dev, "extra"), (dt, "name"), (dt, "extra"), (size, "extra")):
        with pytest.raises(AttributeError):
            setattr(obj, attr, 0)
    assert not any(hasattr(o, "__dict__") for o in (dev, dt, size))
    with pytest.raises(TypeError):
        TorchDtype()


def _values() -> dict[str, Any]:
    return {"dtype": torch.bfloat16, "alias": torch.float, "device": torch.device("cuda", 1),
            "cpu": torch.device("cpu"), "shape": torch.Size([2, 3]), "no_shape": torch.Size([]),
            "by_dtype": {torch.float16: 2}}


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_a_checkpoints_torch_values_read_as_torch_loads_them(kind: str, tmp_path: Path) -> None:
    if kind == "torch.save":
        path = tmp_path / "ckpt.pt"
        torch.save({"model": {"w": torch.ones(3)}, "meta": _values()}, path)
        expected = torch.load(path, weights_only=True)["meta"]
        # The zip reader rebuilds tuples as plain tuples (with torch's classes too): a shape reads as a tuple.
        expected = {**expected, "shape": (2, 3), "no_shape": ()}
    else:
        path = tmp_path / "meta.pkl"
        path.write_bytes(pickle.dumps(_values(), protocol=2))
        expected = pickle.loads(path.read_bytes())  # our own bytes, written just above
    with open_checkpoint(str(path)) as ckpt:
        assert not ckpt.findings, ckpt.findings
        tree = ckpt.parts[0].tree
        meta = tree["meta"] if kind == "torch.save" else tree
        assert _reads_as(dict(meta)) == _reads_as(expected)


def test_compare_names_torch_values_as_torch_writes_them(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"model": {"w": torch.ones(3)}, "config": {"dtype": torch.bfloat16}}, a)
    torch.save({"model": {"w": torch.ones(3)}, "config": {"dtype": torch.float16}}, b)
    from ckptaudit.comparing import run_compare

    report = run_compare(str(a), str(b))
    text = " ".join(f.message for f in report.findings)
    assert "torch.bfloat16 vs torch.float16" in text, [f.message for f in report.findings]


@pytest.mark.parametrize("payload", [b"ctorch\nSize\nJ\xff\xff\xff\xff\x85\x85R", b"ctorch\ndevice\nX\x04\x00\x00\x00evil\x85R",
                                     b"ctorch\ndevice\n)\x81"])
def test_a_bad_torch_value_is_a_finding_not_a_traceback(payload: bytes, tmp_path: Path) -> None:
    path = tmp_path / "state.pkl"
    path.write_bytes(b"\x80\x02}X\x01\x00\x00\x00v" + payload + b"s.")
    report = run_audit(str(path))
    assert [f.code for f in report.findings if f.code == "integrity.corrupt"], report.findings
    assert any("torch.Size" in f.message or "torch.device" in f.message for f in report.findings)
