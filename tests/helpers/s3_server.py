"""A real S3 endpoint on loopback (moto's server) and a fault-injecting HTTP proxy in front of it.

`S3Server` runs moto's threaded server in this process; ranks in other processes reach it over
127.0.0.1. `FaultProxy` forwards every request to it unchanged and, for requests matching a rule,
answers with an S3 error instead (optionally after forwarding, as when a write lands but its response
is lost). Both speak plain HTTP, so s3fs, aiobotocore and botocore run exactly their production code.
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REGION = "us-east-1"
ACCESS_KEY = "testing"  # moto accepts any credentials unless `enforce_auth` is on
SECRET_KEY = "testing"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


class S3Server:
    """moto's S3 server on 127.0.0.1, one per test session."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.host, self.port = host, port
        self.endpoint = f"http://{host}:{port}"
        self._fs: Any = None

    def storage_options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """What a caller passes as `storage_options` to reach this server (or a proxy in front of it)."""
        options: dict[str, Any] = {
            "endpoint_url": endpoint or self.endpoint,
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"region_name": REGION},
        }
        options.update(extra)
        return options

    @property
    def fs(self) -> Any:
        """An s3fs filesystem of the test's own (never cached, never shared with the code under test)."""
        if self._fs is None:
            import s3fs

            self._fs = s3fs.S3FileSystem(**self.storage_options(), use_listings_cache=False, skip_instance_cache=True)
        return self._fs

    def create_bucket(self, name: str) -> None:
        self.fs.call_s3("create_bucket", Bucket=name)

    def object_bytes(self, bucket: str, key: str) -> bytes:
        return self.fs.cat_file(f"{bucket}/{key}")

    def multipart_uploads(self, bucket: str) -> list[dict[str, Any]]:
        """Multipart uploads started and neither completed nor aborted (they cost storage until reaped)."""
        return self.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])

    @contextmanager
    def enforce_auth(self) -> Iterator[None]:
        """Make moto check credentials (it accepts any by default): unknown keys get InvalidAccessKeyId."""
        previous = self._post_or_put("POST", "/moto-api/reset-auth", b"0")
        import json

        try:
            yield
        finally:
            self._post_or_put(
                "POST", "/moto-api/reset-auth", json.loads(previous)["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"].encode()
            )

    def stop(self) -> None:
        self._server.stop()

    def _post_or_put(self, method: str, path: str, body: bytes) -> bytes:
        status, data = self._request(method, path, body)
        if status >= 300:
            raise RuntimeError(f"{method} {path} -> HTTP {status}: {data[:300]!r}")
        return data

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(method, path, body=body)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


@dataclass
class Fault:
    """Answer `status`/`code` to requests whose method and path (with query) match, `times` times."""

    method: str
    pattern: str  # regular expression searched in "/bucket/key?query"
    status: int = 503
    code: str = "ServiceUnavailable"
    times: int | None = 1  # None: every matching request, for as long as the rule is installed
    after_forward: bool = False  # forward first (the write lands), then answer the error: a lost response
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            method == self.method
            and re.search(self.pattern, path) is not None
            and (self.times is None or self.hits < self.times)
        )


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    faulted: bool = False


class FaultProxy:
    """A loopback HTTP proxy in front of an S3 endpoint that fails requests on command and records them."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.faults: list[Fault] = []
        self.seen: list[SeenRequest] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    def fail(self, method: str, pattern: str, **kwargs: Any) -> Fault:
        fault = Fault(method, pattern, **kwargs)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.seen.clear()

    def requests(self, method: str | None = None, pattern: str = "") -> list[SeenRequest]:
        with self._lock:
            return [r for r in self.seen if (method is None or r.method == method) and re.search(pattern, r.path)]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _match(self, method: str, path: str, headers: dict[str, str]) -> Fault | None:
        with self._lock:
            fault = next((f for f in self.faults if f.matches(method, path)), None)
            if fault is not None:
                fault.hits += 1
            self.seen.append(SeenRequest(method, path, headers, faulted=fault is not None))
            return fault


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore expects; every response carries its length
    owner: FaultProxy

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _handle(self) -> None:
        body = self._read_body()
        headers = {name.lower(): value for name, value in self.headers.items()}
        fault = self.owner._match(self.command, self.path, headers)
        if fault is not None and not fault.after_forward:
            self._send_error(fault)
            return
        status, reason, response_headers, response_body = self._forward(body, headers)
        if fault is not None:
            self._send_error(fault)
            return
        self.send_response(status, reason)
        length = None
        for name, value in response_headers:
            if name.lower() in _HOP_BY_HOP:
                continue
            if name.lower() == "content-length":
                length = value
                continue
            self.send_header(name, value)
        # HEAD answers carry the object's length with no body
        self.send_header(
            "Content-Length", length if self.command == "HEAD" and length is not None else str(len(response_body))
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response_body)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes, headers: dict[str, str]) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            out = {
                name: value for name, value in headers.items() if name not in _HOP_BY_HOP and name != "content-length"
            }
            if body or self.command in ("PUT", "POST"):
                out["content-length"] = str(len(body))
            conn.request(self.command, self.path, body=body or None, headers=out)
            response = conn.getresponse()
            return response.status, response.reason, response.getheaders(), response.read()
        finally:
            conn.close()

    def _send_error(self, fault: Fault) -> None:
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{fault.code}</Code><Message>injected by FaultProxy</Message>"
            f"<RequestId>{uuid.uuid4().hex}</RequestId></Error>"
        ).encode()
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
