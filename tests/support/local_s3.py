"""A local S3 server (moto's server mode on 127.0.0.1 and a free port) and the environment that points an S3 client
at it, for the tests of checkpoints behind ``s3://`` URLs: :func:`local_s3` is what a test module uses (server,
environment, fsspec's cache, a filesystem on it, its buckets), :func:`s3_server` the server alone (for a child's
``env``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
"""What moto's server accepts; the endpoint is added per server (``AWS_ENDPOINT_URL``)."""


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``values`` set, restored on exit as it was (unset names unset again)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """A running moto S3 server, stopped on exit; yields the environment to reach it (:data:`CREDENTIALS` and
    ``AWS_ENDPOINT_URL``), for :func:`environment` or a child's ``env``. moto keeps its buckets in this process's
    memory, shared by every server it starts: each module uses buckets of its own names."""
    from moto import server as moto_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server._server.server_port}"}
    finally:
        server.stop()


@dataclass(frozen=True)
class LocalS3:
    """A running local S3 server, as :func:`local_s3` yields it."""

    fs: Any
    """A fresh s3fs filesystem on the server (never fsspec's cached instance, which ckptaudit reads through)."""
    env: dict[str, str]
    """:data:`CREDENTIALS` and ``AWS_ENDPOINT_URL``: what reaches the server (a child's ``env``)."""

    @property
    def endpoint(self) -> str:
        return self.env["AWS_ENDPOINT_URL"]


@contextmanager
def local_s3(*buckets: str) -> Iterator[LocalS3]:
    """A moto S3 server holding the new ``buckets`` (moto keeps every server's buckets in this process's memory:
    each module uses names of its own), this process pointed at it (the environment restored on exit), and fsspec's
    cached S3 filesystems dropped on entry and on exit: ckptaudit reads through fsspec's cached instance, whose client
    keeps the endpoint it was made with, so another module's server must never be the one reached, nor this one
    after it stopped. Skips the test where moto's server or s3fs is not installed."""
    import pytest

    pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with s3_server() as env, environment(env):
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            for bucket in buckets:
                fs.mkdir(bucket)
            yield LocalS3(fs, env)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
