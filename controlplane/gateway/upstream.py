"""A lean HTTP/1.1 client for the agents: pooled keep-alive connections, streamed bodies.

The gateway sends one kind of request (a POST with a small JSON body) to servers it
knows (the agents' uvicorn), and must pass the answer through as it arrives. httpx did
that at about a millisecond of Python per request plus a few layers per chunk, which
on a two-core host shows up directly in time to first token. This does only what the
gateway needs: one `write` per request on a pooled connection, a response head parser,
and a body reader for `Content-Length`, chunked, or read-until-close framing, driven by
an `asyncio.Protocol` (no stream reader layers).

A connection goes back to the pool only when its response was read to the end and the
server did not ask to close; idle ones are dropped after `keepalive_expiry_s` (shorter
than uvicorn's five seconds, so the server never closes one under a new request). A
request whose reused connection turns out closed before any response byte is sent again
once on a new connection. Closing a response early closes its connection: that is how
a client disconnect reaches the agent.

First tokens first: an engine ends a step with a token for each of its sequences at
once, and the gateway relays them one after another. A response whose stream has had its
first token can be marked `is_yielding`: its reader then wakes one turn of the event loop
later than the readers of the other responses that got bytes in the same turn, so those
still waiting for a first token are relayed ahead of those that already have one. The
later ones wait for a few relays (tens of microseconds each) on such a step; the
first-token wait, the figure a client notices most, loses its place in the queue.
"""

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
PAUSE_READING_BYTES = 1024 * 1024  # stop reading from the agent while this much is unread


class UpstreamError(Exception):
    """The agent failed after the request reached it (a broken or malformed response)."""


class UpstreamConnectError(UpstreamError):
    """The agent could not be reached, or closed the connection before any response byte."""


class UpstreamTimeout(UpstreamError):
    """The agent did not answer (or connect) in time."""


class _Connection(asyncio.Protocol):
    """One TCP connection; the bytes it receives wait in `buffer` for the reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.is_closed = False
        self.error: Exception | None = None
        self.is_paused = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.is_yielding = False  # wake the reader a turn later (see the module's docstring)
        # One timer per connection, moved lazily: a wait only sets `deadline`, and the timer
        # (when it fires early) re-arms itself for it. A timer started and cancelled on
        # every wait cost more than the rest of handing on a streamed token.
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > PAUSE_READING_BYTES and not self.is_paused and self.transport:
            self.is_paused = True
            self.transport.pause_reading()
        if self.is_yielding:
            self.loop.call_soon(self._wake)
        else:
            self._wake()

    def eof_received(self) -> bool:
        self.is_closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self.error = exc
        self._wake()
        self.stop_timer()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until more bytes arrive or the connection closes; UpstreamTimeout after timeout_s."""
        if self.is_paused and self.transport is not None:
            self.is_paused = False
            self.transport.resume_reading()
        loop = self.loop
        waiter = loop.create_future()
        self.waiter = waiter
        self.deadline = deadline = loop.time() + timeout_s
        timer = self.timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self.timer = loop.call_at(deadline, self._on_timer)
        try:
            await waiter
        finally:
            self.waiter = None

    def _on_timer(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting now: the next wait arms a new timer
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._on_timer)
            return
        waiter.set_exception(UpstreamTimeout("the agent did not answer in time"))

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def close(self) -> None:
        self.is_closed = True
        self.stop_timer()
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """Status, headers (lower-case names) and a body that streams as it arrives."""

    __slots__ = (
        "_connection",
        "_is_chunked",
        "_is_done",
        "_is_reusable",
        "_is_yielding",
        "_key",
        "_pool",
        "_read_timeout_s",
        "_remaining",
        "headers",
        "status",
    )

    def __init__(
        self,
        pool: "UpstreamPool",
        key: tuple[str, int],
        connection: _Connection,
        status: int,
        headers: dict[str, str],
    ) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._key = key
        self._connection = connection
        self._read_timeout_s = pool.read_timeout_s
        self._is_chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        # -1: the body ends when the connection closes.
        self._remaining = -1 if self._is_chunked or length is None else int(length)
        self._is_reusable = headers.get("connection", "").lower() != "close" and (
            self._is_chunked or length is not None
        )
        self._is_done = self._remaining == 0 or status in (204, 304)
        self._is_yielding = False

    @property
    def is_yielding(self) -> bool:
        """True: this response's bytes are handed on after those of responses that are not."""
        return self._is_yielding

    @is_yielding.setter
    def is_yielding(self, value: bool) -> None:
        self._is_yielding = self._connection.is_yielding = value

    async def _more(self) -> None:
        connection = self._connection
        if connection.is_closed:
            raise UpstreamError("the agent closed the connection mid-response")
        await connection.wait(self._read_timeout_s)

    async def read_some(self) -> bytes:
        """The body's next bytes, de-chunked, as soon as there are any; b"" at its end."""
        connection = self._connection
        buffer = connection.buffer
        while not self._is_done:
            if self._is_chunked:
                piece = self._take_chunked()
                if piece is None:
                    await self._more()
                    continue
                if piece:
                    return piece
            elif self._remaining < 0:
                if buffer:
                    piece = bytes(buffer)
                    buffer.clear()
                    return piece
                if connection.is_closed:
                    self._is_done = True
                else:
                    await connection.wait(self._read_timeout_s)
            else:
                if not buffer:
                    await self._more()
                    continue
                piece = bytes(buffer[: self._remaining])
                del buffer[: len(piece)]
                self._remaining -= len(piece)
                self._is_done = self._remaining == 0
                return piece
        return b""

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes, de-chunked, as they arrive."""
        while piece := await self.read_some():
            yield piece

    def _take_chunked(self) -> bytes | None:
        """Whatever de-chunked bytes the buffer holds (b"" at the end); None: need more."""
        buffer = self._connection.buffer
        if not buffer:
            return None
        if self._remaining == -1:
            # The usual case first: the buffer holds exactly one whole chunk.
            line_end = buffer.find(b"\r\n")
            if line_end > 0:
                try:
                    size = int(buffer[:line_end], 16)
                except ValueError:
                    size = 0  # an extension or a malformed line: the full parser says which
                start = line_end + 2
                if size > 0 and len(buffer) == start + size + 2 and buffer.endswith(b"\r\n"):
                    piece = bytes(buffer[start : start + size])
                    buffer.clear()
                    return piece
        out = bytearray()
        while True:
            if self._remaining > 0:  # inside a chunk's data
                if not buffer:
                    break
                take = min(self._remaining, len(buffer))
                out += buffer[:take]
                del buffer[:take]
                self._remaining -= take
                if self._remaining > 0:
                    break
                self._remaining = -2  # the CRLF after the data is next
            if self._remaining == -2:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise UpstreamError("malformed chunked body")
                del buffer[:2]
                self._remaining = -1
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                if len(buffer) > 1024:
                    raise UpstreamError("malformed chunk size line")
                break
            size_text = bytes(buffer[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise UpstreamError("malformed chunk size line") from None
            if size == 0:
                # The last chunk: skip optional trailers up to the blank line.
                trailer_end = buffer.find(b"\r\n\r\n", line_end)
                if buffer[line_end : line_end + 4] == b"\r\n\r\n":
                    trailer_end = line_end
                if trailer_end < 0:
                    break
                del buffer[: trailer_end + 4]
                self._is_done = True
                return bytes(out)
            del buffer[: line_end + 2]
            self._remaining = size
        if out:
            return bytes(out)
        return None

    async def read(self) -> bytes:
        parts = [piece async for piece in self.iter_bytes()]
        return b"".join(parts)

    def close(self) -> None:
        """Done with the response: the connection goes back to the pool only if it is clean."""
        connection = self._connection
        connection.stop_timer()
        connection.is_yielding = False
        if (
            self._is_done
            and self._is_reusable
            and not connection.is_closed
            and not connection.buffer
        ):
            self._pool._release(self._key, connection)
        else:
            connection.close()


class UpstreamPool:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_expiry_s: float = 4.0,
        max_idle_per_endpoint: int = 256,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_expiry_s = keepalive_expiry_s
        self.max_idle_per_endpoint = max_idle_per_endpoint
        self._idle: dict[tuple[str, int], list[_Connection]] = defaultdict(list)
        # endpoint URL -> (host, port, path prefix, Host header)
        self._targets: dict[str, tuple[str, int, bytes, bytes]] = {}

    def _target(self, endpoint: str) -> tuple[str, int, bytes, bytes]:
        target = self._targets.get(endpoint)
        if target is None:
            parts = urlsplit(endpoint)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamConnectError(f"unsupported agent endpoint {endpoint!r}")
            port = parts.port or 80
            host_header = parts.hostname if port == 80 else f"{parts.hostname}:{port}"
            prefix = parts.path.rstrip("/").encode()
            target = (parts.hostname, port, prefix, host_header.encode())
            self._targets[endpoint] = target
        return target

    async def _new_connection(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(loop), host, port)
        except TimeoutError:
            raise UpstreamConnectError(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return connection

    def _pooled(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.is_closed and now - connection.idle_since < self.keepalive_expiry_s:
                return connection
            connection.close()
        return None

    def _release(self, key: tuple[str, int], connection: _Connection) -> None:
        idle = self._idle[key]
        if len(idle) >= self.max_idle_per_endpoint:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def post(
        self, endpoint: str, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> UpstreamResponse:
        """POST `body` to endpoint + path; the response once its head has arrived.

        UpstreamConnectError: the agent was not reached in time or refused, or closed the
        connection before answering; UpstreamTimeout: no answer within the read timeout;
        UpstreamError: a malformed answer.
        """
        host, port, prefix, host_header = self._target(endpoint)
        head = [b"POST ", prefix, path.encode(), b" HTTP/1.1\r\nhost: ", host_header, b"\r\n"]
        for name, value in headers:
            head += [name.encode(), b": ", value.encode("latin-1"), b"\r\n"]
        head += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        request = b"".join(head)
        key = (host, port)
        connection = self._pooled(key)
        if connection is not None:
            try:
                return await self._exchange(key, connection, request)
            except UpstreamConnectError:
                pass  # a kept-alive connection the agent had closed: once more, on a new one
        connection = await self._new_connection(host, port)
        return await self._exchange(key, connection, request)

    async def _exchange(
        self, key: tuple[str, int], connection: _Connection, request: bytes
    ) -> UpstreamResponse:
        try:
            assert connection.transport is not None
            connection.transport.write(request)
            buffer = connection.buffer
            while True:
                end = buffer.find(b"\r\n\r\n")
                if end >= 0:
                    break
                if len(buffer) > MAX_HEAD_BYTES:
                    raise UpstreamError("response head too large")
                if connection.is_closed:
                    if buffer:
                        raise UpstreamError("the agent closed the connection mid-head")
                    raise UpstreamConnectError("the agent closed the connection")
                await connection.wait(self.read_timeout_s)
            lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
            del buffer[: end + 4]
            version, _, rest = lines[0].partition(" ")
            if not version.startswith("HTTP/1."):
                raise UpstreamError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
            try:
                status = int(rest[:3])
            except ValueError:
                raise UpstreamError(f"bad status line {lines[0][:80]!r}") from None
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
                headers["connection"] = "close"
            return UpstreamResponse(self, key, connection, status, headers)
        except BaseException:
            connection.close()
            raise

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
