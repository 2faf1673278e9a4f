"""The gateway's HTTP/1.1 client for agents, against real TCP servers on loopback.

Each server answers every request it reads with the next scripted answer (raw bytes,
possibly in several writes), so framing, keep-alive and failure cases are exact.
"""

import asyncio
from collections.abc import Callable

import pytest
import uvloop

from controlplane.gateway.upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)

Answer = list[bytes] | Callable[[asyncio.StreamWriter], object]


class ScriptedServer:
    def __init__(self, answers: list[Answer], *, close_after_each: bool = False) -> None:
        self.answers = answers
        self.close_after_each = close_after_each
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> "ScriptedServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if callable(answer):
                    await answer(writer)  # type: ignore[misc]
                    continue
                for index, piece in enumerate(answer):
                    if index:
                        await asyncio.sleep(0.01)
                    writer.write(piece)
                    await writer.drain()
                if self.close_after_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def pool(**options) -> UpstreamPool:
    return UpstreamPool(
        connect_timeout_s=2, read_timeout_s=options.pop("read_timeout_s", 5), **options
    )


async def post(upstream: UpstreamPool, url: str) -> tuple[int, dict[str, str], list[bytes]]:
    response = await upstream.post(url, "/v1/chat/completions", b'{"a":1}', [("x-test", "1")])
    try:
        pieces = [piece async for piece in response.iter_bytes()]
    finally:
        response.close()
    return response.status, response.headers, pieces


def test_chunked_stream_arrives_piece_by_piece_and_the_connection_is_reused() -> None:
    events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
    # Chunk boundaries split across writes, a chunk extension and a trailer.
    first = [SSE_HEAD + chunk(events[0])[:5], chunk(events[0])[5:] + b"b;ext=1\r\n" + events[1]]
    first += [b"\r\n" + chunk(events[2]), b"0\r\nx-trailer: y\r\n\r\n"]
    second = [SSE_HEAD + chunk(events[0]) + b"0\r\n\r\n"]

    async def scenario() -> None:
        async with ScriptedServer([first, second]) as server:
            upstream = pool()
            status, headers, pieces = await post(upstream, server.url)
            assert (status, headers["content-type"]) == (200, "text/event-stream")
            assert b"".join(pieces) == b"".join(events)
            assert len(pieces) >= 3  # delivered as it arrived, not buffered to the end
            assert (await post(upstream, server.url))[2] == [events[0]]
            assert server.connections == 1
            request = server.requests[0]
            assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"x-test: 1\r\n" in request and request.endswith(b'\r\n\r\n{"a":1}')
            await upstream.aclose()

    asyncio.run(scenario())


def test_content_length_and_close_delimited_bodies() -> None:
    sized = [b"HTTP/1.1 404 Not Found\r\ncontent-length: 11\r\n\r\nnot ", b"found", b"!!"]

    async def until_close(writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{"x":')
        await asyncio.sleep(0.01)
        writer.write(b"1}")
        writer.close()  # an HTTP/1.0 body without a length ends when the server closes

    async def scenario() -> None:
        async with ScriptedServer([sized, until_close, sized]) as server:
            upstream = pool()
            status, _, pieces = await post(upstream, server.url)
            assert (status, b"".join(pieces)) == (404, b"not found!!")
            status, _, pieces = await post(upstream, server.url)
            assert (status, b"".join(pieces)) == (200, b'{"x":1}')
            assert server.connections == 1  # the first connection was kept alive
            status, _, pieces = await post(upstream, server.url)
            assert (status, server.connections) == (404, 2)  # and the closed one was not

    asyncio.run(scenario())


def test_kept_alive_connections_the_server_closed_are_replaced() -> None:
    answer = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]

    async def hang_up(writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def scenario() -> None:
        async with ScriptedServer([answer, answer], close_after_each=True) as server:
            upstream = pool()
            assert (await post(upstream, server.url))[2] == [b"ok"]
            await asyncio.sleep(0.05)  # the server has closed the idle connection
            assert (await post(upstream, server.url))[2] == [b"ok"]
            assert (server.connections, len(server.requests)) == (2, 2)
        # Closed under a new request before answering it: sent once more, on a new one.
        async with ScriptedServer([answer, hang_up, answer]) as server:
            upstream = pool()
            assert (await post(upstream, server.url))[2] == [b"ok"]
            assert (await post(upstream, server.url))[2] == [b"ok"]
            assert (server.connections, len(server.requests)) == (2, 3)

    asyncio.run(scenario())


def test_refused_broken_and_silent_agents_raise_distinct_errors() -> None:
    async def hang_up(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(b"data: one\n\n"))
        await writer.drain()
        writer.transport.abort()

    async def silence(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(1)

    async def scenario() -> None:
        with pytest.raises(UpstreamConnectError):
            await pool().post("http://127.0.0.1:9", "/v1/x", b"", [])
        async with ScriptedServer([hang_up]) as server:
            response = await pool().post(server.url, "/v1/x", b"", [])
            received = []
            with pytest.raises(UpstreamError):
                async for piece in response.iter_bytes():
                    received.append(piece)
            assert received == [b"data: one\n\n"]
            response.close()
        async with ScriptedServer([silence]) as server:
            with pytest.raises(UpstreamTimeout):
                await pool(read_timeout_s=0.2).post(server.url, "/v1/x", b"", [])

    asyncio.run(scenario())


def test_closing_an_unfinished_response_closes_its_connection() -> None:
    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        while not writer.is_closing():
            writer.write(chunk(b"data: tick\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        async with ScriptedServer([endless, [b"HTTP/1.1 204 No Content\r\n\r\n"]]) as server:
            upstream = pool()
            response = await upstream.post(server.url, "/v1/x", b"", [])
            async for _ in response.iter_bytes():
                break
            response.close()  # what a client disconnect does: the agent sees the close
            status, _, pieces = await post(upstream, server.url)
            assert (status, pieces) == (204, [])
            assert server.connections == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_yielding_response_is_handed_its_bytes_after_the_others(loop_factory) -> None:
    """Bytes for two responses arrive in one turn: the one not yielding is read first."""
    writers: list[asyncio.StreamWriter] = []
    done = asyncio.Event()

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(b"data: first\n\n"))
        writers.append(writer)
        await done.wait()

    async def scenario() -> list[str]:
        async with ScriptedServer([answer, answer]) as server:
            upstream = pool()
            first = await upstream.post(server.url, "/v1/chat/completions", b"{}", [])
            second = await upstream.post(server.url, "/v1/chat/completions", b"{}", [])
            assert await first.read_some() == await second.read_some() == b"data: first\n\n"
            first.is_yielding = True  # had its first token
            order: list[str] = []

            async def read(name: str, response) -> None:
                assert await response.read_some() == b"data: next\n\n"
                order.append(name)

            readers = [
                asyncio.ensure_future(read("first", first)),
                asyncio.ensure_future(read("second", second)),
            ]
            await asyncio.sleep(0.05)  # both readers wait
            for writer in writers:  # one turn: the yielding response's bytes are sent first
                writer.write(chunk(b"data: next\n\n") + b"0\r\n\r\n")
            await asyncio.gather(*readers)
            assert await first.read_some() == await second.read_some() == b""
            first.close()
            second.close()
            done.set()
            await upstream.aclose()
            return order

    loop = loop_factory()
    try:
        assert loop.run_until_complete(scenario()) == ["second", "first"]
    finally:
        loop.close()
