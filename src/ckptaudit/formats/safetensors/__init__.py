"""safetensors files: :mod:`~ckptaudit.formats.safetensors.reader` (the header checked as the safetensors library
checks it, tensors described lazily), registered here."""

from ckptaudit.formats.contract import FileReader, register_reader

# By name (the safetensors library opens any file it is given): first of the file readers.
register_reader(FileReader("safetensors", order=10, recognises=lambda probe: probe.endswith(".safetensors"),
                    read="ckptaudit.formats.safetensors.reader:read_safetensors_part", claims=(".safetensors",)))
