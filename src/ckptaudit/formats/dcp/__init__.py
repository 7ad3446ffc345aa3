"""``torch.distributed.checkpoint`` directories: :mod:`~ckptaudit.formats.dcp.reader` (``.metadata`` plus the
``.distcp`` data files, every item's archive checked) and :mod:`~ckptaudit.formats.dcp.metadata` (``.metadata``
read as plain data through the DCP allowlist, the one view every check and loader shares)."""
