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
- :mod:`~ckptaudit.formats.pickle.object_tree`: the bound on what was loaded.

DCP's ``.metadata`` is loaded through the DCP allowlist in :mod:`ckptaudit.formats.dcp.metadata`.
"""
