"""A fault-injecting HTTP proxy in front of the tests' S3 server: the faults a real object store
and network give, injected for real on the wire, so ckptfmt's client (obstore and its retries) is
exercised unmodified.

The proxy listens on 127.0.0.1 and relays HTTP/1.1 requests to the server one by one (it parses
just the request line, the headers and the body's framing); a client points at it with
``AWS_ENDPOINT_URL`` (:meth:`S3Proxy.env`). Rules, set at any time from the test's process
(processes it launches go through the same proxy, so the test controls their faults too):

* :meth:`answer_error`: answer the next ``n`` matching requests with an S3 error of the status,
  code and fields given (``400 AuthorizationHeaderMalformed`` naming the bucket's region, say),
  without passing them on;
* :meth:`slowdown`: answer the next ``n`` matching requests ``503 SlowDown`` (S3's throttling
  answer, with its XML body) without passing them on;
* :meth:`reset_mid_body`: read part of the body of the next ``n`` matching requests (PUTs by
  default), then reset the connection (RST: ``SO_LINGER`` 0), nothing reaching the server;
* :meth:`down` / :meth:`up`: the server is gone: every new connection, and every request on an
  open one, is reset at once; then back; :meth:`down_after`: gone once ``n`` matching requests
  have been answered (in the middle of a flush's uploads, say);
* :meth:`flip_byte`: flip one byte in the body of GET answers for keys containing a string;
* :meth:`refuse`: answer the next ``n`` matching requests with an error status (``403
  AccessDenied`` by default) and S3's XML error body, without passing them on (a store that
  refuses the request: a policy, a quota, a failed precondition);
* :meth:`drop_answer`: pass the next ``n`` matching requests on, then reset the connection
  instead of relaying the server's answer (the request took effect; the client never hears);
* :meth:`stall`: take the next ``n`` matching requests whole, then never answer (the
  connection stays open and silent until the client gives up: a server that hangs);
* :meth:`delay`: hold every request that long before relaying it (a remote store's round trip;
  a local server answers in a millisecond, which hides what waiting for answers one at a time
  costs).

:attr:`S3Proxy.requests` counts the requests relayed or answered, by method; :attr:`body_bytes`
their body bytes (what a client uploaded), by method; :attr:`copies` the paths of server-side
copies asked (``x-amz-copy-source``); :attr:`faults`
the faults injected, by rule; :attr:`deleted` the keys asked to be deleted, in order;
:meth:`peak_in_flight` tells how many matching requests were
being relayed at once, at most (whether a client overlaps its requests). ``Expect:
100-continue`` is not supported (obstore never sends it).
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from urllib.parse import urlsplit

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>ckptfmt-proxy</RequestId></Error>"
)


@dataclass
class _Rule:
    kind: str  # "slowdown", "error", "refuse", "reset", "flip", "drop", "stall", "down_after"
    left: int | None  # None: every matching request
    method: str | None = None
    path_contains: str | None = None
    min_body: int = 0
    answer: bytes = b""  # "error": the whole answer sent
    status: int = 0  # "refuse": the status answered

    def matches(self, method: str, path: str, length: int) -> bool:
        if self.left is not None and self.left <= 0:
            return False
        if self.method is not None and method != self.method:
            return False
        if self.path_contains is not None and self.path_contains not in path:
            return False
        return length >= self.min_body

    def take(self) -> None:
        if self.left is not None:
            self.left -= 1


class _Conn:
    """A socket with a read buffer: lines, exact lengths, chunked bodies."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(1 << 16)
        if not data:
            return False
        self.buf += data
        return True

    def until(self, delim: bytes) -> bytes | None:
        while delim not in self.buf:
            if not self._fill():
                return None
        head, _, self.buf = self.buf.partition(delim)
        return head + delim

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("closed in the middle of a body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        while self._fill():
            pass
        out, self.buf = self.buf, b""
        return out

    def chunked(self) -> bytes:
        """A chunked body, raw (sizes, data, trailers), as it came."""
        out = b""
        while True:
            line = self.until(b"\r\n")
            if line is None:
                raise ConnectionError("closed in the middle of a chunked body")
            out += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:
                    trailer = self.until(b"\r\n")
                    if trailer is None:
                        raise ConnectionError("closed in a chunked trailer")
                    out += trailer
                    if trailer == b"\r\n":
                        return out
            out += self.exact(size + 2)


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            fields[k.strip().lower()] = v.strip()
    return lines[0], fields


_ERROR_CODES = {
    403: ("Forbidden", "AccessDenied"),
    412: ("Precondition Failed", "PreconditionFailed"),
}


def _error_answer(status: int) -> bytes:
    """An S3 error answer of ``status``, with its XML body."""
    phrase, code = _ERROR_CODES.get(status, ("Internal Server Error", "InternalError"))
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>refused by the test proxy</Message>"
        f"<RequestId>ckptfmt-proxy</RequestId></Error>"
    ).encode()
    return (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    ).encode() + body


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST (as a crashed peer or a middlebox does), not a FIN."""
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class S3Proxy:
    """The proxy: :attr:`endpoint` is its ``http://127.0.0.1:<port>``."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.requests: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.seen: list[tuple[str, str]] = []
        self.spans: list[tuple[str, str, float, float]] = []  # method, path, relayed from, to
        self.deleted: list[str] = []  # keys asked to be deleted, in order (DELETE, batch POST)
        self.body_bytes: Counter[str] = Counter()  # request body bytes relayed, by method
        self.copies: list[str] = []  # paths of server-side copies asked (x-amz-copy-source)
        self._delay = 0.0
        self._rules: list[_Rule] = []
        self._down = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="s3-proxy", daemon=True)
        self._thread.start()

    # --- rules -------------------------------------------------------------------------------

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` (an S3 environment) with the endpoint pointing at this proxy."""
        return {**base, "AWS_ENDPOINT_URL": self.endpoint}

    def answer_error(
        self,
        n: int,
        status: str,
        code: str,
        message: str,
        fields: dict[str, str] | None = None,
        method: str | None = None,
        path_contains: str | None = None,
    ) -> None:
        """Answer the next ``n`` matching requests ``status`` (``"400 Bad Request"``) with S3's
        error document of ``code``, ``message`` and the other ``fields`` (``{"Region": ...}``)."""
        extra = "".join(f"<{k}>{v}</{k}>" for k, v in (fields or {}).items())
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>{extra}"
            "<RequestId>ckptfmt-proxy</RequestId></Error>"
        ).encode()
        answer = (
            f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
        ).encode() + body
        self._add(_Rule("error", n, method, path_contains, answer=answer))

    def slowdown(self, n: int, method: str | None = None, path_contains: str | None = None) -> None:
        """Answer the next ``n`` matching requests ``503 SlowDown``."""
        self._add(_Rule("slowdown", n, method, path_contains))

    def refuse(
        self,
        n: int,
        status: int = 403,
        method: str | None = None,
        path_contains: str | None = None,
    ) -> None:
        """Answer the next ``n`` matching requests ``status`` (with S3's error body: code
        ``AccessDenied`` for 403, ``PreconditionFailed`` for 412, ``InternalError`` otherwise),
        nothing reaching the server."""
        self._add(_Rule("refuse", n, method, path_contains, status=status))

    def reset_mid_body(
        self, n: int, method: str = "PUT", min_body: int = 1, path_contains: str | None = None
    ) -> None:
        """Reset the connection half way through the body of the next ``n`` matching requests
        whose body has at least ``min_body`` bytes."""
        self._add(_Rule("reset", n, method, path_contains, max(1, min_body)))

    def flip_byte(self, key_contains: str, n: int | None = None) -> None:
        """Flip the middle byte of the body of GET answers (whole or ranged) for paths containing
        ``key_contains``: the next ``n``, or every one when ``n`` is None."""
        self._add(_Rule("flip", n, "GET", key_contains))

    def drop_answer(
        self, n: int, method: str | None = None, path_contains: str | None = None
    ) -> None:
        """Pass the next ``n`` matching requests to the server, then reset the connection in
        place of its answer: the request took effect, and the client sees a dropped
        connection (as when a load balancer or the network fails after the server acted)."""
        self._add(_Rule("drop", n, method, path_contains))

    def stall(
        self, n: int | None, method: str | None = None, path_contains: str | None = None
    ) -> None:
        """Read the next ``n`` matching requests (every one when ``n`` is None) and answer
        none of them, the connection left open (nothing reaches the server)."""
        self._add(_Rule("stall", n, method, path_contains))

    def delay(self, seconds: float) -> None:
        """Hold every request ``seconds`` before it is relayed (0: none)."""
        with self._lock:
            self._delay = seconds

    def peak_in_flight(self, method: str, path_contains: str) -> int:
        """The most requests of ``method`` whose path contains ``path_contains`` that were in
        the proxy at once (from the request's arrival to its answer's end)."""
        with self._lock:
            spans = [(a, b) for m, p, a, b in self.spans if m == method and path_contains in p]
        edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
        peak = now = 0
        for _, step in edges:  # at equal times an end (-1) sorts before a start
            now += step
            peak = max(peak, now)
        return peak

    def down(self) -> None:
        """The server is gone: reset every connection, open or new, until :meth:`up`."""
        with self._lock:
            self._down = True
            open_now = list(self._open)
        for sock in open_now:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def down_after(
        self, n: int, method: str | None = None, path_contains: str | None = None
    ) -> None:
        """Go :meth:`down` once the ``n``-th matching request from now has been answered."""
        self._add(_Rule("down_after", n, method, path_contains))

    def up(self) -> None:
        with self._lock:
            self._down = False

    def clear(self) -> None:
        """Drop every rule and the delay (not the counters); the server is up."""
        with self._lock:
            self._rules.clear()
            self._delay = 0.0
            self._down = False

    @contextmanager
    def gone(self) -> Iterator[None]:
        self.down()
        try:
            yield
        finally:
            self.up()

    def close(self) -> None:
        self._stopped = True
        self.down()
        self._listener.close()

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _take(self, kind: str, method: str, path: str, length: int) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.kind == kind and rule.matches(method, path, length):
                    rule.take()
                    self.faults[kind] += 1
                    return rule
        return None

    # --- relaying ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down:
                self.faults["down"] += 1
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        with self._lock:
            self._open.add(client)
        try:
            upstream = socket.create_connection(self.upstream, timeout=60)
            with self._lock:
                self._open.add(upstream)
            c, u = _Conn(client), _Conn(upstream)
            while self._relay_one(c, u):
                pass
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            with self._lock:
                self._open.discard(client)
                if upstream is not None:
                    self._open.discard(upstream)
            for sock in (client, upstream):
                if sock is not None:
                    with suppress(OSError):
                        sock.close()

    def _relay_one(self, c: _Conn, u: _Conn) -> bool:
        head = c.until(b"\r\n\r\n")
        if head is None:
            return False
        request_line, fields = _headers(head)
        method, path = request_line.split(" ")[:2]
        length = int(fields.get("content-length", "0") or 0)
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        arrived = time.monotonic()
        with self._lock:
            self.requests[method] += 1
            self.seen.append((method, path))
            down = self._down
            delay = self._delay
        if down:
            self.faults["down"] += 1
            _reset(c.sock)
            return False
        if self._take("reset", method, path, length) is not None:
            c.exact(max(1, length // 2))  # part of the body, then the connection dies
            _reset(c.sock)
            return False
        body = c.chunked() if chunked else c.exact(length)
        with self._lock:
            self.body_bytes[method] += len(body)
            if "x-amz-copy-source" in fields:
                self.copies.append(path)
        self._note_deletes(method, path, body)
        if self._take("stall", method, path, length) is not None:
            while not self._stopped and c.sock.recv(1 << 16):  # silent until the client hangs up
                pass
            return False
        error = self._take("error", method, path, length)
        if error is not None:
            c.sock.sendall(error.answer)
            return True
        if self._take("slowdown", method, path, length) is not None:
            c.sock.sendall(
                b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(SLOWDOWN_BODY)}\r\n".encode()
                + b"Connection: keep-alive\r\n\r\n"
                + SLOWDOWN_BODY
            )
            return True
        refused = self._take("refuse", method, path, length)
        if refused is not None:
            c.sock.sendall(_error_answer(refused.status))
            return True
        if delay:
            time.sleep(delay)
        u.sock.sendall(head + body)
        answer = u.until(b"\r\n\r\n")
        if answer is None:
            return False
        if self._take("drop", method, path, length) is not None:
            _reset(c.sock)
            return False
        status_line, rfields = _headers(answer)
        status = int(status_line.split(" ")[1])
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            rbody = b""
        elif "chunked" in rfields.get("transfer-encoding", "").lower():
            rbody = u.chunked()
        elif "content-length" in rfields:
            rbody = u.exact(int(rfields["content-length"]))
            if status in (200, 206) and rbody and self._take("flip", method, path, 0):
                i = len(rbody) // 2
                rbody = rbody[:i] + bytes([rbody[i] ^ 0xFF]) + rbody[i + 1 :]
        else:
            rbody = u.rest()
            c.sock.sendall(answer + rbody)
            self._span(method, path, arrived)
            return False
        c.sock.sendall(answer + rbody)
        self._span(method, path, arrived)
        rule = self._take("down_after", method, path, length)
        if rule is not None and rule.left == 0:
            self.down()
            return False
        return rfields.get("connection", "").lower() != "close"

    def _note_deletes(self, method: str, path: str, body: bytes) -> None:
        if method == "DELETE":
            keys = [urlsplit(path).path.split("/", 2)[-1]]
        elif method == "POST" and urlsplit(path).query.startswith("delete"):
            keys = [k.decode() for k in re.findall(rb"<Key>([^<]*)</Key>", body)]
        else:
            return
        with self._lock:
            self.deleted += keys

    def _span(self, method: str, path: str, arrived: float) -> None:
        with self._lock:
            self.spans.append((method, path, arrived, time.monotonic()))
