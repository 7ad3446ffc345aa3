"""DeepSpeed checkpoints: :mod:`~ckptaudit.formats.deepspeed.reader` (a ``global_stepN/`` folder or the root above
it, read without executing anything) and :mod:`~ckptaudit.formats.deepspeed.zero` (ZeRO's partition arithmetic:
every parameter's fp32 master and moments rebuilt from the ranks' flat partitions as lazy tensors)."""
