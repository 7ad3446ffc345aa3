"""Checkpoints behind fsspec URLs (``s3://``, ``gs://``, ``https://``...), read with ranged reads and never
downloaded: :mod:`~ckptaudit.formats.remote.staging` builds a local stand-in the readers parse,
:mod:`~ckptaudit.formats.remote.dcp` stages a DCP directory's metadata with batched ranged reads, and
:mod:`~ckptaudit.formats.remote.http` bounds every ``http(s)://`` request (deadline, reply capped, ETag pinned)."""
