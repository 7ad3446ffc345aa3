"""Low-level safe I/O under every reader: regular files only, never a blocking open, never an unbounded read
(:mod:`~ckptaudit.formats.io.safeio`); JSON bounded before it is parsed (:mod:`~ckptaudit.formats.io.safejson`);
lazy tensors, where their bytes lie and how to stream them in bounded chunks (:mod:`~ckptaudit.formats.io.tensors`);
a data file's bytes read from the page cache under a lease (:mod:`~ckptaudit.formats.io.leased`)."""
