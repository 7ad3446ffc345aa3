"""On-disk conventions that the writer, the guard, ``latest`` and the offline checks share: the manifest of a
committed checkpoint (:mod:`~ckptaudit.ondisk.manifest`), the names of a checkpoint root's step directories and its
``latest`` pointer (:mod:`~ckptaudit.ondisk.layout`), and the names the guard gives a failing checkpoint and its
report (:mod:`~ckptaudit.ondisk.quarantine`). Names and reading only: the writes live with the writer
(:mod:`ckptaudit.store`) and the guard."""
