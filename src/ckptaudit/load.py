"""Loading a checkpoint safely: what ``torch.load`` / ``torch.distributed.checkpoint.load`` / safetensors return,
for checkpoints you did not write yourself. The stable names (docs/api.md, "Loading a checkpoint safely")::

    from ckptaudit.load import UnsafeCheckpointError, dcp_reader, load, load_dcp

    state = load("ckpt.pt")                  # what torch.load(weights_only=True) returns
    tensors = load("model.safetensors")      # what safetensors.torch.load_file returns
    state = load("ckpts/step-8")             # a DCP directory: its whole state dict, nested as saved
    files = load("out/checkpoint-500")       # a stack's folder: {file: what loading it returns}
    load_dcp(state_dict, "ckpts/step-8")     # in place, on every rank, as torch.distributed.checkpoint.load
    dcp.load(state_dict, storage_reader=dcp_reader("ckpts/step-8"))

Each loads only what ckptaudit vetted in the same reading: the bytes are checked as the audit checks them (the
pickle's globals against the allowlist, its limits, DCP's ``.metadata`` and every item) and handed to torch from
the descriptor that was checked, never read again by path. What torch would run (a pickle calling anything but
tensor and container constructors, a DCP directory whose metadata leaves it, ...) is refused with
:class:`UnsafeCheckpointError`, whose message names the file and the audit's finding. Needs torch
(``pip install '.[torch]'`` in a clone of ckptaudit).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from ckptaudit.formats.dcp.reader import UnsafeCheckpointError

__all__ = ["UnsafeCheckpointError", "dcp_reader", "load", "load_dcp"]

LOADABLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
"""The files :func:`load` of a folder loads (besides DCP sub-directories); everything else (JSON, text) is left to
the reader of your choice."""


def load(path: str | os.PathLike[str]) -> Any:
    """Load the checkpoint at ``path`` safely, returning what torch (or safetensors) would return.

    - a ``torch.save`` file (``.pt``, ``.bin``, a Lightning ``.ckpt``, a DeepSpeed ``*_states.pt``...): what
      ``torch.load(path, weights_only=True, map_location="cpu")`` returns (NumPy RNG states included);
    - a ``.safetensors`` file: what ``safetensors.torch.load_file`` returns (``dict[str, torch.Tensor]``);
    - a DCP directory (``.metadata`` + ``*.distcp``): its whole state dict on CPU, nested as it was saved (no
      template needed; to load into your model's own tensors, use :func:`load_dcp`);
    - any other directory (a Hugging Face ``checkpoint-N``, DeepSpeed's ``global_stepN``, ...): a dict from each
      loadable file's path relative to ``path`` (:data:`LOADABLE_SUFFIXES`, DCP sub-directories) to what loading
      it returns, in sorted order.

    Raises :class:`UnsafeCheckpointError` (naming the file and the finding) for what torch would execute or read
    outside the checkpoint, ``ValueError`` for a file that is not a checkpoint of these kinds,
    ``FileNotFoundError`` when ``path`` does not exist.
    """
    from ckptaudit.extras import require_torch

    require_torch("ckptaudit.load.load")
    from ckptaudit.formats.dcp.reader import is_dcp_dir

    root = os.fspath(path)
    if not os.path.lexists(root):
        raise FileNotFoundError(f"ckptaudit.load.load: {root!r} does not exist; give a checkpoint file or directory")
    if is_dcp_dir(root):
        return _refusing(root, _load_whole_dcp, root)
    if os.path.isdir(root):
        return _load_folder(root)
    return _load_file(root)


def load_dcp(state_dict: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=path, **kwargs)``, safely: ``state_dict`` (your
    model's and optimizer's, e.g. from ``get_state_dict``) is filled in place from the DCP directory ``path``, after
    its ``.metadata`` and every item were vetted, through the metadata that check rebuilt (never torch's second
    reading of the pickle). Resharding works as in DCP: any number of ranks may load what any number saved.

    (all ranks) call it on every rank that loads, as ``torch.distributed.checkpoint.load``; each rank checks
    what it reads itself. Other keywords (``planner``, ``process_group``) go to DCP; ``storage_reader`` and
    ``checkpoint_id`` are chosen here (``TypeError``). Raises :class:`UnsafeCheckpointError` before anything
    of the checkpoint is unpickled when it is refused.
    """
    from ckptaudit.extras import require_torch

    require_torch("ckptaudit.load.load_dcp")
    from ckptaudit.formats.torchload import vetted_dcp_load

    if "storage_reader" in kwargs or "checkpoint_id" in kwargs:
        raise TypeError("ckptaudit.load.load_dcp chooses the storage reader itself (the one that serves the vetted "
                        "metadata); pass the directory as path, not storage_reader= or checkpoint_id=")
    _refusing(os.fspath(path), vetted_dcp_load, state_dict, path, **kwargs)


def dcp_reader(path: str | os.PathLike[str]) -> Any:
    """A ``torch.distributed.checkpoint`` storage reader of the DCP directory ``path`` for your own
    ``dcp.load(state_dict, storage_reader=dcp_reader(path))`` (or ``dcp.state_dict_loader``): it serves the
    metadata ckptaudit vetted and vets every item it reads. Raises :class:`UnsafeCheckpointError` when ``path``'s
    metadata is refused. (all ranks) create one on every rank that loads."""
    from ckptaudit.extras import require_torch

    require_torch("ckptaudit.load.dcp_reader")
    from ckptaudit.formats.torchload import vetted_dcp_reader

    return _refusing(os.fspath(path), vetted_dcp_reader, path)


def _load_file(path: str) -> Any:
    if path.endswith(".safetensors"):
        return _load_safetensors(path)
    from ckptaudit.formats.torchload import vetted_torch_load

    return _refusing(path, vetted_torch_load, path)


def _load_safetensors(path: str) -> dict[str, Any]:
    """safetensors' own loader (it runs no code), from the descriptor opened here: a file renamed over the path
    afterwards is not what it reads."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ckptaudit.formats.io.safeio import NotRegularFile, open_regular

    try:
        fh = open_regular(path)
    except NotRegularFile as exc:
        raise ValueError(f"{path} is not a safetensors file ({exc.strerror})") from None
    with fh:
        same = f"/proc/self/fd/{fh.fileno()}"
        try:
            return dict(load_file(same if os.path.exists(same) else path, device="cpu"))
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc}); `ckptaudit audit {path}` "
                             "says what is wrong with it") from None


def _load_folder(root: str) -> dict[str, Any]:
    from ckptaudit.formats.dcp.reader import is_dcp_dir

    out: dict[str, Any] = {}
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for d in list(dirs):
            full = os.path.join(folder, d)
            if os.path.islink(full):
                dirs.remove(d)  # never followed out of the checkpoint
            elif is_dcp_dir(full):
                dirs.remove(d)
                out[os.path.relpath(full, root)] = _refusing(full, _load_whole_dcp, full)
        for name in sorted(names):
            full = os.path.join(folder, name)
            if name.endswith(LOADABLE_SUFFIXES) and not os.path.islink(full):
                out[os.path.relpath(full, root)] = _load_file(full)
    return dict(sorted(out.items()))


def _load_whole_dcp(root: str) -> dict[str, Any]:
    """The whole state dict of a DCP directory, with no template: the template is built from the vetted metadata
    (an empty tensor of each saved size and dtype, a placeholder for each non-tensor item), loaded in one process
    through the vetted reader, then nested back as saved (the metadata's ``planner_data``)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptaudit.formats.torchload import vetted_dcp_reader

    reader = vetted_dcp_reader(root)
    md = reader.read_metadata()
    flat: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        flat[fqn] = (torch.empty(tuple(item.size), dtype=item.properties.dtype)
                     if isinstance(item, TensorStorageMetadata) else None)
    # Neither flattening: the planner then fills this very dict, non-tensor items included.
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    nested: dict[str, Any] = {}
    for fqn, value in flat.items():
        where = (md.planner_data or {}).get(fqn)
        _set(nested, tuple(where) if isinstance(where, tuple | list) and where else (fqn,), value)
    return nested


def _set(root: dict[str, Any], keys: tuple[Any, ...], value: Any) -> None:
    """``root[k0][k1]... = value``, making dicts (lists for integer keys, as DCP's own unflattening does)."""
    node: Any = root
    for key, nxt in itertools.pairwise(keys):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        while len(node) <= keys[-1]:
            node.append(None)
    node[keys[-1]] = value


def _refusing(path: str, load_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``load_fn(*args, **kwargs)``; a refusal re-raised naming the file and the finding the audit reports for it."""
    try:
        return load_fn(*args, **kwargs)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc}{_findings_of(path)}") from None


def _findings_of(path: str) -> str:
    """The audit's security and integrity findings of ``path``, for a refusal's message (``""`` if it has none)."""
    try:
        from ckptaudit.api import audit

        report = audit(path, quick=True, jobs=1)
    except Exception:  # noqa: BLE001 - the refusal stands without the audit's words
        return ""
    found = [f for f in report.findings if f.code.split(".", 1)[0] in ("security", "integrity")]
    if not found:
        return ""
    return "; the audit's finding: " + "; ".join(f"{f.code} ({f.subject}: {f.message})" for f in found[:3]) + (
        f" and {len(found) - 3} more" if len(found) > 3 else "")
