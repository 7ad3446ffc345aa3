"""DeepSpeed checkpoints: :mod:`~ckptaudit.formats.deepspeed.reader` (a ``global_stepN/`` folder or the root above
it, read without executing anything) and :mod:`~ckptaudit.formats.deepspeed.zero` (ZeRO's partition arithmetic:
every parameter's fp32 master and moments rebuilt from the ranks' flat partitions as lazy tensors); the DeepSpeed
directory reader, registered here."""

from ckptaudit.formats.contract import DirectoryReader, register_reader


def _recognises(path: str) -> bool:
    from ckptaudit.formats.deepspeed.reader import recognises

    return recognises(path)


# First of the directory readers: a DeepSpeed tag folder or root is read as DeepSpeed even where it would also pass
# for DCP; never as a sub-directory of a plain directory of files.
register_reader(DirectoryReader("deepspeed", order=10, recognises=_recognises,
                         read="ckptaudit.formats.deepspeed.reader:read_deepspeed_into"))
