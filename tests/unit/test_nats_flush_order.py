"""A flush's PING reaches the server after every command queued before it.

nats-py writes the PING of ``flush()`` straight to its socket while a SUB or PUB queued before it
still waits for its flusher task; the server then answers PONG before it has the SUB. The server
here is a recording one (it speaks just enough of the protocol for a client to connect); the
same rounds against a real nats-server are in ``tests/integration/test_flushed_subscriptions.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from better_compute.service import connect

pytestmark = pytest.mark.unit

INFO = b'INFO {"server_id":"rec","version":"2.15.1","proto":1,"headers":true,"max_payload":1048576}\r\n'


class RecordingServer:
    """Records each protocol line a client sends; answers PING with PONG."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RecordingServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(INFO)
        await writer.drain()
        while line := await reader.readline():
            self.lines.append(line.split(b" ", 1)[0].strip())
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
                await writer.drain()
            elif line.startswith(b"PUB"):
                await reader.readline()  # the payload
        writer.close()


@pytest.fixture
async def server() -> AsyncIterator[RecordingServer]:
    async with RecordingServer() as s:
        yield s


async def test_a_flush_follows_the_subscriptions_and_publishes_before_it(server: RecordingServer) -> None:
    nc = await connect(server.url, name="flush-order", allow_reconnect=False)
    try:
        for round_ in range(3):
            server.lines.clear()
            await nc.subscribe(f"svc.{round_}", queue="q")
            await nc.publish(f"svc.{round_}.hello", b"x")
            await nc.flush(timeout=5)
            assert server.lines == [b"SUB", b"PUB", b"PING"], f"round {round_}: {server.lines}"
    finally:
        await nc.close()
