"""``torch.save`` zip archives (a ``.pt`` file, and each item of a DCP ``.distcp`` file), read without
``torch.load``: :mod:`~ckptaudit.formats.zip.archive` (the archive checked and its ``data.pkl`` loaded into an
object tree with lazy tensors), :mod:`~ckptaudit.formats.zip.central` (the lean central-directory reader),
:mod:`~ckptaudit.formats.zip.miniz` (torch's own reading of an archive, restated, so that an archive the two
readings could part on is refused), :mod:`~ckptaudit.formats.zip.memo` (the checked structure the DCP items of one
shape share, remembered) and :mod:`~ckptaudit.formats.zip.rebuild` (``data.pkl``'s storages and tensors as lazy
references); :mod:`~ckptaudit.formats.zip.reader`, the archive as one part of a checkpoint, registered here."""

from ckptaudit.formats.contract import FileReader, register_reader

ZIP_MAGIC = b"PK\x03\x04"

# The first question torch.load asks of a file (is it a zip?), so the first reader by magic bytes.
register_reader(FileReader("torch.save", order=40, recognises=lambda probe: probe.head(4) == ZIP_MAGIC,
                    read="ckptaudit.formats.zip.reader:read_torch_save"))
