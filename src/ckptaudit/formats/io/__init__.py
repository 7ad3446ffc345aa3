"""Low-level safe I/O under every reader: regular files only, never a blocking open, never an unbounded read
(:mod:`~ckptaudit.formats.io.safeio`); JSON bounded before it is parsed (:mod:`~ckptaudit.formats.io.safejson`);
lazy tensors, where their bytes lie and how to stream them in bounded chunks (:mod:`~ckptaudit.formats.io.tensors`);
a data file's bytes read from the page cache under a lease (:mod:`~ckptaudit.formats.io.leased`); the JSON and
empty-file readers (:mod:`~ckptaudit.formats.io.plain`), registered here."""

from ckptaudit.formats.contract import FileReader, register_reader

# By name first (as the safetensors reader): a .json file is JSON whatever its bytes.
register_reader(FileReader("json", order=20, recognises=lambda probe: probe.endswith(".json"),
                    read="ckptaudit.formats.io.plain:read_json", claims=(".json",)))
# Every other file is judged by its first bytes, and an empty one has none: before the magic-byte readers.
register_reader(FileReader("empty", order=30, recognises=lambda probe: probe.size == 0,
                    read="ckptaudit.formats.io.plain:read_empty"))
