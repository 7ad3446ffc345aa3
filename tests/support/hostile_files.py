"""Crafted hostile and broken checkpoint files for the security tests (real bytes, written the way an attacker
or a broken disk would write them).

Every payload's side effect is creating a *sentinel* file: a test asserts the sentinel never appears when
ckptaudit reads the file, and a control run (plain ``pickle`` / ``torch.load(weights_only=False)`` /
``torch.distributed.checkpoint.load`` in a child process) shows that the same bytes do create it when executed,
so a test cannot pass because the payload was inert.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

EXT_CODE = 0x4A42
"""The copyreg extension code the EXT payload uses (the control registers it, as a victim process could)."""


class Reduce:
    """An object whose unpickling calls ``func(*args)``: the classic ``__reduce__`` payload."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _op_str(s: str) -> bytes:
    data = s.encode()
    return b"\x8c" + bytes([len(data)]) + data if len(data) < 256 else b"X" + struct.pack("<I", len(data)) + data


def payload_object(kind: str, sentinel: str) -> Any:
    """A Python object whose pickle runs the payload ``kind`` when unpickled."""
    import torch

    if kind == "os.system":
        return Reduce(os.system, f"touch {sentinel}")
    if kind == "subprocess":
        return Reduce(subprocess.call, ["touch", sentinel])
    if kind == "exec":
        return Reduce(builtins.exec, f"open({sentinel!r}, 'w').close()")
    if kind == "io.open":
        return Reduce(io.open, sentinel, "w")
    if kind == "load_from_bytes":
        # torch.storage._load_from_bytes runs torch.load(weights_only=False) on its argument.
        inner = io.BytesIO()
        torch.save(Reduce(os.system, f"touch {sentinel}"), inner)
        return Reduce(torch.storage._load_from_bytes, inner.getvalue())
    raise ValueError(kind)


OBJECT_KINDS = ("os.system", "subprocess", "exec", "io.open", "load_from_bytes")
OPCODE_KINDS = ("stack_global_memo", "ext", "inst", "obj")
ALL_KINDS = OBJECT_KINDS + OPCODE_KINDS


def payload_pickle(kind: str, sentinel: str) -> bytes:
    """The bytes of a pickle that runs ``kind`` when unpickled (hand-assembled for the opcode tricks)."""
    cmd = f"touch {sentinel}"
    if kind in OBJECT_KINDS:
        return pickle.dumps({"model": {"w": [1.0, 2.0]}, "extra": payload_object(kind, sentinel)}, protocol=2)
    if kind == "stack_global_memo":
        # The module and attribute names are memoized, popped, and fetched back for STACK_GLOBAL.
        return (b"\x80\x04" + _op_str("os") + b"\x94" + _op_str("system") + b"\x94" + b"00"
                + b"h\x00h\x01\x93" + _op_str(cmd) + b"\x85R.")
    if kind == "ext":
        return b"\x80\x02" + b"\x83" + struct.pack("<H", EXT_CODE) + _op_str(cmd) + b"\x85R."
    if kind == "inst":
        return b"(S'" + cmd.encode() + b"'\nios\nsystem\n."
    if kind == "obj":
        return b"\x80\x02(cos\nsystem\n" + _op_str(cmd) + b"o."
    raise ValueError(kind)


def replace_data_pkl(src: Path, dst: Path, data_pkl: bytes) -> None:
    """Copy the ``torch.save`` archive ``src`` to ``dst`` with its ``data.pkl`` replaced (stored, as torch does)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = data_pkl if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(info.filename, data)


def torch_save_payload(kind: str, sentinel: str, dst: Path, template: Path) -> None:
    """A ``torch.save`` file whose ``data.pkl`` runs ``kind``: saved by torch itself for object payloads,
    assembled into a real archive (``template``) for opcode payloads."""
    import torch

    if kind in OBJECT_KINDS:
        state = {"model": {"w": torch.ones(2)}, "extra": payload_object(kind, sentinel)}
        torch.save(state, dst)
    else:
        replace_data_pkl(template, dst, payload_pickle(kind, sentinel))


def run_unsafely(jobs: list[tuple[str, str]], timeout: float = 240) -> None:
    """Control: in a child process, load each ``(how, path)`` the unsafe way real code would.

    ``how``: ``pickle`` (``pickle.load``), ``torch`` (``torch.load(weights_only=False)``) or ``dcp``
    (``torch.distributed.checkpoint.load``). Errors after the payload ran are ignored.
    """
    script = f"""
import copyreg, pickle, sys, warnings
warnings.filterwarnings("ignore")
copyreg.add_extension("os", "system", {EXT_CODE})
import torch, torch.distributed.checkpoint as dcp
for how, path in {jobs!r}:
    try:
        if how == "pickle":
            with open(path, "rb") as fh:
                pickle.load(fh)
        elif how == "torch":
            torch.load(path, weights_only=False)
        else:
            sd = {{"extra": 0}}
            dcp.load(sd, checkpoint_id=path)
    except BaseException as exc:  # the payload has run (or not) by now
        print(how, path, type(exc).__name__, str(exc)[:200], file=sys.stderr)
"""
    subprocess.run([sys.executable, "-c", script], timeout=timeout, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
