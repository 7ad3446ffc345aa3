"""``torch.distributed.checkpoint`` directories: :mod:`~ckptaudit.formats.dcp.reader` (``.metadata`` plus the
``.distcp`` data files, every item's archive checked) and :mod:`~ckptaudit.formats.dcp.metadata` (``.metadata``
read as plain data through the DCP allowlist, the one view every check and loader shares); the DCP directory reader,
registered here."""

from ckptaudit.formats.contract import DirectoryReader, register_reader


def _recognises(path: str) -> bool:
    from ckptaudit.formats.dcp.reader import is_dcp_dir

    return is_dcp_dir(path)


# After DeepSpeed's (a DeepSpeed folder is never read as DCP); also a DCP folder inside a plain directory of files.
register_reader(DirectoryReader("dcp", order=20, recognises=_recognises, read="ckptaudit.formats.dcp.reader:read_dcp_into",
                         nested=True))
