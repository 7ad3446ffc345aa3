"""Writers: the serving export behind a quality gate (:mod:`ckptaudit.store.serving`, :mod:`ckptaudit.store.gate`)."""
