"""A local Google Cloud Storage server (gcp-storage-emulator, in memory, a child process on 127.0.0.1 and a free
port) and the environment that points gcsfs at it, for the tests of checkpoints behind ``gs://`` URLs.

gcsfs takes its endpoint from ``STORAGE_EMULATOR_HOST`` (``gcsfs.core._location``) and its credentials from the
``token`` option: ``anon`` here (``FSSPEC_GS_TOKEN`` in a child's environment, fsspec's configuration in this
process). gcsfs >= 2026.x asks the Storage Control gRPC API for each bucket's layout unless
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``; no emulator serves it, and every operation would wait out its 60 s
retry: this module switches it off before gcsfs is imported.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

START_TIMEOUT_S = 30.0
"""How long the emulator may take to answer its first request."""
STOP_TIMEOUT_S = 5.0
"""How long it may take to exit after SIGTERM before it is killed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def gcs_server() -> Iterator[dict[str, str]]:
    """A running GCS emulator (a child process, always reaped), stopped on exit; yields the environment to reach it
    (``STORAGE_EMULATOR_HOST``, ``FSSPEC_GS_TOKEN=anon``, gcsfs's layout lookup off), for :func:`environment`
    or a child's ``env``. Buckets live in the child's memory: one server, one set of buckets."""
    import pytest

    pytest.importorskip("gcp_storage_emulator")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                                 "--port", str(port), "--in-memory", "-q"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
                    break
                except OSError as exc:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        state = (f"exited with {proc.returncode}" if proc.poll() is not None else
                                 f"did not answer in {START_TIMEOUT_S:.0f} s ({exc})")
                        pytest.fail(f"the GCS emulator on {url} {state}:\n"
                                    f"{log.read()[-3000:].decode(errors='replace')}")
                    time.sleep(0.05)
            yield {"STORAGE_EMULATOR_HOST": url, "FSSPEC_GS_TOKEN": "anon",
                   "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        finally:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def gcs_environment(env: dict[str, str]) -> Iterator[Any]:
    """This process pointed at the emulator of ``env`` (:func:`gcs_server`): the environment set (and restored),
    fsspec's ``gs`` configuration given the anonymous token (fsspec reads ``FSSPEC_*`` only when imported), no
    cached gcsfs instance reaching an earlier server before or after. Yields a gcsfs filesystem on it."""
    import fsspec.config
    import pytest

    gcsfs = pytest.importorskip("gcsfs")
    from gcsfs.core import GCSFileSystem

    if gcsfs.GCSFileSystem is not GCSFileSystem:
        pytest.fail("gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set: its bucket-layout "
                    "lookup waits 60 s per request on an emulator (import local_gcs before gcsfs)")
    from local_s3 import environment

    saved = fsspec.config.conf.get("gs")
    fsspec.config.conf["gs"] = {**(saved or {}), "token": "anon"}
    GCSFileSystem.clear_instance_cache()
    try:
        with environment(env):
            yield GCSFileSystem(token="anon", skip_instance_cache=True)
    finally:
        GCSFileSystem.clear_instance_cache()
        if saved is None:
            fsspec.config.conf.pop("gs", None)
        else:
            fsspec.config.conf["gs"] = saved


class ForwardingProxy:
    """A proxy in front of the emulator at ``upstream`` (``GET`` only: what a reader sends): each request goes to
    :meth:`intercept`, which answers it itself (returns ``True``) or lets it through to the emulator. A context
    manager (its thread and sockets closed)."""

    def __init__(self, upstream: str) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        self.upstream = upstream
        self.release = threading.Event()
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if proxy.intercept(self):
                    return
                status, headers, body = proxy.fetch(self.path, {
                    k: v for k, v in self.headers.items() if k.lower() in ("range", "accept", "accept-encoding")})
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() in ("content-type", "content-range", "etag", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def fetch(self, path: str, headers: dict[str, str]) -> tuple[int, Any, bytes]:
        """``GET path`` of the emulator: its status, headers and body."""
        request = urllib.request.Request(self.upstream + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, reply.headers, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers, exc.read()

    def intercept(self, handler: Any) -> bool:
        return False

    def __enter__(self) -> ForwardingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


class StallingProxy(ForwardingProxy):
    """Holds the first ranged read (a ``Range`` header) without answering until closed, as a stalled store does,
    and forwards every other request. ``stalled``: whether it held one."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.stalled = False

    def intercept(self, handler: Any) -> bool:
        with self._lock:
            hold = "Range" in handler.headers and not self.stalled
            self.stalled = self.stalled or hold
        if hold:
            self.release.wait(120)
            handler.close_connection = True
        return hold


class GenerationProxy(ForwardingProxy):
    """What Cloud Storage does and the emulator does not: a media read asking for a ``generation`` is answered
    404 when that is no longer the object's generation (a bucket without versioning keeps no other; the emulator
    ignores the parameter and serves whatever the object holds now). ``asked``: for each ranged media read, the
    object's name and the generation it asked (``None`` when it asked none)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.asked: list[tuple[str, str | None]] = []

    def intercept(self, handler: Any) -> bool:
        from urllib.parse import parse_qs, unquote, urlsplit

        parts = urlsplit(handler.path)
        prefix = "/download/storage/v1/b/"
        if not parts.path.startswith(prefix) or "/o/" not in parts.path:
            return False
        bucket, _, name = parts.path[len(prefix):].partition("/o/")
        asked = parse_qs(parts.query).get("generation", [None])[0]
        if "Range" in handler.headers:
            with self._lock:
                self.asked.append((unquote(name), asked))
        if asked is None:
            return False
        status, _, body = self.fetch(f"/storage/v1/b/{bucket}/o/{name}", {})
        if status == 200 and str(json.loads(body).get("generation")) == asked:
            return False
        reply = json.dumps({"error": {"code": 404, "message": f"No such object: {bucket}/{unquote(name)}"}}).encode()
        handler.send_response(404)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(reply)))
        handler.end_headers()
        handler.wfile.write(reply)
        return True
