"""Pickles read without execution, one module per concept.

Three kinds of pickle reach ckptaudit: ``data.pkl`` inside ``torch.save`` zip archives (and inside every item
of a ``.distcp`` file), ``.metadata`` of ``torch.distributed.checkpoint`` directories, and plain pickles
(legacy ``torch.save`` files, ``*.pkl``). None of them is ever unpickled with plain :mod:`pickle`.

- :mod:`~ckptaudit.formats.pickle.allowlist`: the names a pickle may reference, and how;
- :mod:`~ckptaudit.formats.pickle.scan`: :func:`~ckptaudit.formats.pickle.scan.scan`, the opcode walk (never
  executing) and its report, over :mod:`~ckptaudit.formats.pickle.walk` (the symbolic walk),
  :mod:`~ckptaudit.formats.pickle.ops` (its opcode tables) and :mod:`~ckptaudit.formats.pickle.limits` (the limits
  and their errors);
- :mod:`~ckptaudit.formats.pickle.unpickler`: the restricted unpickler (declared attributes only, vetted keys,
  charged containers), with NumPy's values (:mod:`~ckptaudit.formats.pickle.numpy_values`) and torch's plain
  values (:mod:`~ckptaudit.formats.pickle.torch_values`) as torch-free stand-ins;
- :mod:`~ckptaudit.formats.pickle.object_tree`: the bound on what was loaded;
- the readers registered here (:mod:`ckptaudit.formats.contract`): the legacy ``torch.save`` formats, refused
  (:mod:`~ckptaudit.formats.pickle.legacy`), and plain pickles (:mod:`~ckptaudit.formats.pickle.plain`), whose
  unloaded globals :mod:`~ckptaudit.formats.pickle.report` names.

DCP's ``.metadata`` is loaded through the DCP allowlist in :mod:`ckptaudit.formats.dcp.metadata`.
"""

from ckptaudit.formats.contract import FileHead, FileReader, register_reader

__all__ = ["TORCH_EXTENSIONS"]

TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")
"""The names a directory listing reads as ``torch.save`` files or pickles (whatever their bytes turn out to be)."""


def _reads_as_tar(probe: FileHead) -> bool:
    from ckptaudit.formats.pickle.legacy import TAR_BLOCK, reads_as_tar

    return reads_as_tar(probe.head(TAR_BLOCK))


# After the zip (torch.load tries the zip first), before the pickle: torch.load takes the legacy tar path wherever
# tarfile reads a first header, and only then reads pickles from byte 0.
register_reader(FileReader("torch.save-legacy-tar", order=50, recognises=_reads_as_tar,
                    read="ckptaudit.formats.pickle.legacy:read_legacy_tar"))
register_reader(FileReader("pickle", order=90, recognises=lambda probe: True, read="ckptaudit.formats.pickle.plain:read_pickle",
                    claims=TORCH_EXTENSIONS))
