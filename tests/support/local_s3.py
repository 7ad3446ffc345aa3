"""A local S3 server (moto's server mode on 127.0.0.1 and a free port) and the environment that points an S3 client
at it, for the tests of checkpoints behind ``s3://`` URLs."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

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
