"""`bcx dev up` / `down`: the embedded servers and every service, state kept across restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import nats
import pytest

from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres


def bcx(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BC_NATS_URL", "BC_DATABASE_URL")}
    env["BC_STATE_DIR"] = str(state)
    return subprocess.run(
        [sys.executable, "-m", "better_compute.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "dev"
    yield path
    bcx(path, "dev", "down")


async def test_dev_up_status_down_and_up_again_reuses_state(state: Path) -> None:
    up = bcx(state, "dev", "up", "--json")
    assert up.returncode == 0, up.stderr
    urls = json.loads(up.stdout)
    status = json.loads(bcx(state, "status", "--json").stdout)["services"]
    assert sorted(r["service"] for r in status) == [
        "bc-command-queue", "bc-engine", "bc-pki", "bc-secrets",
    ]  # fmt: skip

    # something written now must be there after a full restart
    conn = await asyncpg.connect(urls["database"])
    try:
        await conn.execute("CREATE TABLE public.kept (v text); INSERT INTO public.kept VALUES ('x')")
    finally:
        await conn.close()
    nc = await nats.connect(urls["nats"])
    js = nc.jetstream()
    await js.add_stream(name="KEPT", subjects=["kept.>"])
    await js.publish("kept.one", b"survives")
    await nc.close()

    down = bcx(state, "dev", "down")
    assert down.returncode == 0, down.stderr
    assert "nats-server" in down.stdout
    assert "postgresql" in down.stdout
    assert EmbeddedPostgres(state).running_pid() is None
    assert EmbeddedNats(state).running_pid() is None
    assert bcx(state, "status").returncode == 1  # nothing to talk to

    again = bcx(state, "dev", "up", "--json")
    assert again.returncode == 0, again.stderr
    urls2 = json.loads(again.stdout)
    conn = await asyncpg.connect(urls2["database"])
    try:
        assert await conn.fetchval("SELECT v FROM public.kept") == "x"
        assert await conn.fetchval("SELECT count(*) FROM engine.instances") >= 1
    finally:
        await conn.close()
    nc = await nats.connect(urls2["nats"])
    try:
        msg = await nc.jetstream().get_last_msg("KEPT", "kept.one")
        assert msg.data == b"survives"
    finally:
        await nc.close()
    ps = json.loads(bcx(state, "dev", "ps", "--json").stdout)["processes"]
    assert all(p["alive"] for p in ps)
    assert len(ps) == 6


def test_status_without_a_stack_says_what_to_do(tmp_path: Path) -> None:
    out = bcx(tmp_path / "empty", "status")
    assert out.returncode == 1
    assert "error: UNAVAILABLE" in out.stderr
    assert "bcx dev up" in out.stderr
    js = bcx(tmp_path / "empty", "status", "--json")
    assert json.loads(js.stdout)["error"]["code"] == "UNAVAILABLE"
