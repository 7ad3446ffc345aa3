"""Readers: turn a path (file or directory) into a :class:`Checkpoint` of parts, executing nothing.

One sub-package per container (:mod:`.zip` for ``torch.save`` archives, :mod:`.dcp`, :mod:`.deepspeed` for
DeepSpeed's ``global_stepN/`` folders, :mod:`.pickle` for the pickles inside them all and the plain and legacy
pickle files, :mod:`.safetensors`, :mod:`.io` for safe I/O, JSON and the empty file, :mod:`.remote` for URLs),
each registering its readers behind the contract of :mod:`.contract`; :func:`open_checkpoint`
(:mod:`.opening`) hands a path to the first reader that recognises it. Every failure of a reader becomes a
finding on the checkpoint; only a path that does not exist raises (``FileNotFoundError``).

Each reader's module is imported when a checkpoint needs it (a directory for DCP and DeepSpeed, the file's
extension and magic bytes for safetensors and ``torch.save``), so that auditing a small file starts fast.
"""

from __future__ import annotations

from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.formats.opening import open_checkpoint

__all__ = ["Checkpoint", "Part", "TensorData", "Unreadable", "open_checkpoint", "walk"]
