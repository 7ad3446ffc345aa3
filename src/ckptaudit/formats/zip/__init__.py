"""``torch.save`` zip archives (a ``.pt`` file, and each item of a DCP ``.distcp`` file), read without
``torch.load``: :mod:`~ckptaudit.formats.zip.archive` (the archive checked and its ``data.pkl`` loaded into an
object tree with lazy tensors), :mod:`~ckptaudit.formats.zip.central` (the lean central-directory reader),
:mod:`~ckptaudit.formats.zip.miniz` (torch's own reading of an archive, restated, so that an archive the two
readings could part on is refused), :mod:`~ckptaudit.formats.zip.memo` (the checked structure the DCP items of one
shape share, remembered) and :mod:`~ckptaudit.formats.zip.rebuild` (``data.pkl``'s storages and tensors as lazy
references)."""
