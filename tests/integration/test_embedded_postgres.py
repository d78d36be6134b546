"""The embedded PostgreSQL of ``bcx dev up`` and the test kit starts even when its port is taken
between the moment it was found free and the moment the postmaster binds it (a busy machine)."""

from __future__ import annotations

import socket
from pathlib import Path

import asyncpg
import pytest

from better_compute.runtime import embedded
from better_compute.runtime.embedded import EmbeddedPostgres


async def test_a_port_taken_before_the_postmaster_binds_it_gives_a_fresh_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg = EmbeddedPostgres(tmp_path, durable=False)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    try:
        pg.dir.mkdir(parents=True)
        embedded._write_json(pg.dir / "server.json", {"port": taken})
        # the check said free; the squatter got there first
        monkeypatch.setattr(embedded, "port_free", lambda port: True)
        url = pg.start()
        try:
            assert pg.port != taken
            conn = await asyncpg.connect(url)
            try:
                assert await conn.fetchval("SELECT 1") == 1
            finally:
                await conn.close()
        finally:
            pg.stop()
    finally:
        squatter.close()
