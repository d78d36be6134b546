"""`bcx dev up` / `down`: the embedded servers and every service, state kept across restarts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import asyncpg
import nats
import pytest

from better_compute.runtime.embedded import EmbeddedNats, EmbeddedPostgres
from better_compute.testing import BcxRun, run_bcx


def bcx(state: Path, *args: str, timeout: float = 120, ramdisk: Path | None = None) -> BcxRun:
    """bcx on the dev deployment kept in ``state`` (none of this process's), with the built
    ramdisk in ``ramdisk`` (default: none, whatever ``make ramdisk`` left in the checkout)."""
    env = {"BC_STATE_DIR": str(state), "BC_RAMDISK_DIR": str(ramdisk or state / "no-ramdisk")}
    return run_bcx(None, *args, env=env, isolated=True, timeout=timeout)


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


async def test_a_plain_restart_keeps_the_quorum_dev_up_was_given(state: Path, tmp_path: Path) -> None:
    """Issue 10 item 8: the quorum came only from the environment of whoever ran `dev up`; a
    plain `dev up` after `dev down` turned it off silently. The state folder keeps it now."""
    import base64

    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from better_compute.clients.cmdq import CommandQueueClient
    from better_compute.service import ApiClient
    from better_compute.wire.subjects import Subjects

    raw = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    approvers = tmp_path / "approvers.toml"
    approvers.write_text(
        f'threshold = 1\n[[approvers]]\nid = "alice"\npublicKey = "{base64.b64encode(raw).decode()}"\n'
    )

    async def quorum(url: str) -> tuple[bool, int, list[str]]:
        nc = await nats.connect(url)
        try:
            view = await CommandQueueClient(ApiClient(nc, Subjects(root="bc"))).quorum()
            return view.enabled, view.threshold, [a.id for a in view.approvers]
        finally:
            await nc.close()

    os.environ["BC_CMDQ_QUORUM_FILE"] = str(approvers)
    try:
        up = bcx(state, "dev", "up", "--json", "--service", "bc-command-queue")
    finally:
        del os.environ["BC_CMDQ_QUORUM_FILE"]
    assert up.returncode == 0, up.stderr
    assert await quorum(json.loads(up.stdout)["nats"]) == (True, 1, ["alice"])

    assert bcx(state, "dev", "down").returncode == 0
    approvers.unlink()  # the state folder holds its own copy
    again = bcx(state, "dev", "up", "--json", "--service", "bc-command-queue")
    assert again.returncode == 0, again.stderr
    assert await quorum(json.loads(again.stdout)["nats"]) == (True, 1, ["alice"])
    shown = bcx(state, "quorum", "show")
    assert shown.returncode == 0, shown.stderr
    assert "threshold 1 of 1" in shown.stdout
    assert "alice" in shown.stdout.split()


def test_the_command_queue_warns_when_the_quorum_is_off(state: Path) -> None:
    up = bcx(state, "dev", "up", "--service", "bc-command-queue")
    assert up.returncode == 0, up.stderr
    lines = (state / "logs" / "bc-command-queue-1.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    [off] = [e for e in events if e["event"] == "quorum_off"]
    assert off["level"] == "warning"
    shown = bcx(state, "quorum", "show", "--json")
    assert json.loads(shown.stdout)["enabled"] is False

    # --restart: the service stopped and started again (a plugin installed since would load),
    # the servers left running
    before = {p["name"]: p["pid"] for p in json.loads(bcx(state, "dev", "ps", "--json").stdout)["processes"]}
    again = bcx(state, "dev", "up", "--restart", "--service", "bc-command-queue")
    assert again.returncode == 0, again.stderr
    assert "bc-command-queue  stopped" in again.stdout, again.stdout
    after = {p["name"]: p["pid"] for p in json.loads(bcx(state, "dev", "ps", "--json").stdout)["processes"]}
    assert after["bc-command-queue-1"] != before["bc-command-queue-1"]
    assert (after["nats-server"], after["postgresql"]) == (before["nats-server"], before["postgresql"])


def test_dev_up_serves_the_built_ramdisk_to_the_shipped_profiles(state: Path, tmp_path: Path) -> None:
    """What ``bcx ramdisk build`` left in ``[ramdisk] dir`` becomes the ramdisk of the default
    app's lifecycle profiles: URLs by sha256 on a file server of the stack, which the site
    agent's cache fills from, and the sha256s it checks."""
    import hashlib
    import urllib.error
    import urllib.request

    built = tmp_path / "ramdisk"
    built.mkdir()
    files = {"kernel": ("vmlinuz", b"kernel bytes" * 100), "initrd": ("initrd.img", b"initrd bytes" * 300)}
    manifest: dict[str, object] = {"cmdline": "console=ttyS0,115200n8"}
    for part, (name, data) in files.items():
        (built / name).write_bytes(data)
        manifest[part] = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (built / "manifest.json").write_text(json.dumps(manifest))

    up = bcx(state, "dev", "up", "--service", "bc-engine", ramdisk=built)
    assert up.returncode == 0, up.stderr
    assert "ramdisk           served" in up.stdout
    got = bcx(state, "profiles", "get", "metal.inspect", "--json", ramdisk=built)
    assert got.returncode == 0, got.stderr
    steps = json.loads(got.stdout)["document"]["steps"]
    boot = next(s for s in steps if s["use"] == "metal.ensureRamdisk")["with"]
    assert boot["cmdline"] == "console=ttyS0,115200n8"
    for part, (_name, data) in files.items():
        assert boot[f"{part}Sha256"] == hashlib.sha256(data).hexdigest()
        with urllib.request.urlopen(boot[part], timeout=10) as resp:  # what the site agent fetches
            assert resp.read() == data
    ps = json.loads(bcx(state, "dev", "ps", "--json").stdout)["processes"]
    assert "bc-ramdisk-http" in {p["name"] for p in ps if p["alive"]}
    down = bcx(state, "dev", "down")
    assert down.returncode == 0, down.stderr
    with pytest.raises(urllib.error.URLError):  # the file server went with the stack
        urllib.request.urlopen(boot["kernel"], timeout=5)
