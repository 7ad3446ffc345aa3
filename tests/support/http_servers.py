"""Local HTTP servers that serve one object, honestly or the way a broken or hostile server would (issue 25):
real sockets on 127.0.0.1, a thread per connection, for ``tests/hostile/test_hostile_remote.py`` and
``tests/support/hostile_figures.py``.

Behaviours (``mode``), each applied to ranged ``GET`` s of more than ``honest_below`` bytes (smaller ones, the
metadata a stager reads, are answered honestly unless ``honest_below`` is 0):

- ``honest``: ``206`` with the range, ``ETag``, ``If-Match`` refused with ``412`` when it no longer matches;
- ``lying-length``: ``206`` promising the range, half of it sent, then the connection held open;
- ``trickle``: ``206`` with the range, one byte every ``trickle_s`` seconds;
- ``no-ranges``: ``200`` and the whole object followed by ``flood`` more bytes, ignoring ``Range``;
- ``ignores-if-match``: honest, but serves the current bytes whatever ``If-Match`` says (its ``ETag`` tells).

``query``: every request must carry exactly this query string (a presigned URL's signature), else ``403``; the
request targets are kept in ``targets``.

The server counts requests and the body bytes it managed to send (``sent``), so a test can bound the work a
client made it do.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


class ObjectServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, data: bytes, mode: str = "honest", *, honest_below: int = 64 << 10, trickle_s: float = 0.1,
                 flood: int = 150 << 20, query: str | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode, self.honest_below, self.trickle_s, self.flood = mode, honest_below, trickle_s, flood
        self.query = query
        self.targets: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.requests = 0
        self.big_requests = 0
        self.sent = 0
        self.replace(data)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def replace(self, data: bytes) -> None:
        """Serve ``data`` from now on (a new ETag)."""
        with self.lock:
            self.data = data
            self.etag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> ObjectServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ObjectServer

    def log_message(self, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # A small send buffer: what the server counts as sent is close to what the client took.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)

    def _count(self, n: int) -> None:
        with self.server.lock:
            self.server.sent += n

    def _send(self, data: bytes) -> bool:
        for pos in range(0, len(data), 16 << 10):  # counted piece by piece: what the client did not take is not
            try:
                self.wfile.write(data[pos:pos + (16 << 10)])
                self.wfile.flush()
            except OSError:  # the client hung up
                return False
            self._count(len(data[pos:pos + (16 << 10)]))
        return True

    def _refused(self) -> bool:
        """Without the query the server asks for: ``403``, as a store refuses an unsigned request."""
        with self.server.lock:
            self.server.targets.append(self.path)
        if self.server.query is None or self.path.partition("?")[2] == self.server.query:
            return False
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def do_HEAD(self) -> None:
        if self._refused():
            return
        with self.server.lock:
            self.server.requests += 1
            size, etag = len(self.server.data), self.server.etag
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        if self._refused():
            return
        srv = self.server
        with srv.lock:
            srv.requests += 1
            data, etag = srv.data, srv.etag
        m = _RANGE.match(self.headers.get("Range", ""))
        start, end = (int(m.group(1)), min(int(m.group(2)) + 1, len(data))) if m else (0, len(data))
        n = end - start
        mode = srv.mode if n > srv.honest_below else "honest"
        if n > srv.honest_below:
            with srv.lock:
                srv.big_requests += 1
        if srv.mode != "ignores-if-match" and self.headers.get("If-Match") not in (None, etag):
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode == "no-ranges":
            self.send_response(200)
            self.send_header("Content-Length", str(len(data) + srv.flood))
            self.send_header("ETag", etag)
            self.end_headers()
            if not self._send(data):
                return
            block = bytes(64 << 10)
            for _ in range(srv.flood // len(block)):
                if srv.stopping.is_set() or not self._send(block):
                    return
            return
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(n))
        self.send_header("ETag", etag)
        self.end_headers()
        body = data[start:end]
        if mode == "lying-length":
            self._send(body[: n // 2])
            srv.stopping.wait(120)  # the rest never comes; the connection stays open
            return
        if mode == "trickle":
            for i in range(n):
                if srv.stopping.is_set() or not self._send(body[i:i + 1]):
                    return
                time.sleep(srv.trickle_s)
            return
        self._send(body)
