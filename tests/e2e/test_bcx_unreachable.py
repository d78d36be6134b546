"""`bcx` when NATS is not there: a typed error in seconds, and `bcx dev up` brings it back."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from better_compute.runtime.embedded import (
    EmbeddedNats,
    free_port,
    nats_server_binary,
    pid_alive,
    stop_pid,
    wait_port,
)
from better_compute.testing import BcxRun, run_bcx

SECRET = "hunter2-pw"


def bcx(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> BcxRun:
    """bcx with none of this process's deployment: only what a test gives it."""
    return run_bcx(None, *args, env=env, isolated=True, timeout=timeout)


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word (a hung or wrong server)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        t.join()
        for s in held:
            s.close()
        srv.close()


@pytest.mark.parametrize("argv", [["status"], ["nodes", "list"]], ids=["status", "nodes-list"])
def test_unreachable_nats_fails_in_seconds_naming_the_url(argv: list[str]) -> None:
    url = f"nats://admin:{SECRET}@127.0.0.1:1"
    t0 = time.monotonic()
    out = bcx(*argv, "--nats-url", url, timeout=30)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stderr[-2000:]
    assert took < 10, f"took {took:.1f}s"
    assert out.stderr.startswith("error: UNAVAILABLE: "), out.stderr[-2000:]
    assert "nats://127.0.0.1:1" in out.stderr
    assert SECRET not in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_a_server_that_never_answers_fails_in_seconds_too() -> None:
    with silent_server() as port:
        t0 = time.monotonic()
        out = bcx("status", "--json", "--nats-url", f"nats://127.0.0.1:{port}", timeout=30)
        took = time.monotonic() - t0
    assert out.returncode == 1
    assert took < 15, f"took {took:.1f}s"
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "UNAVAILABLE"
    assert f"127.0.0.1:{port}" in err["message"]
    assert "Traceback" not in out.stderr


def test_dev_up_restarts_a_dead_nats_even_with_its_own_urls_exported(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    env = {"BC_STATE_DIR": str(state)}
    try:
        up = bcx("dev", "up", "--json", "--service", "bc-pki", env=env, timeout=120)
        assert up.returncode == 0, up.stderr
        urls = json.loads(up.stdout)
        nats = EmbeddedNats(state)
        dead = nats.running_pid()
        assert dead is not None
        stop_pid(dead)
        assert not pid_alive(dead)

        # what `bcx dev up` told the user to export
        exported = {**env, "BC_NATS_URL": urls["nats"], "BC_DATABASE_URL": urls["database"]}
        again = bcx("dev", "up", "--json", "--service", "bc-pki", env=exported, timeout=120)
        assert again.returncode == 0, again.stderr
        assert nats.running_pid() is not None
        assert json.loads(again.stdout)["nats"] == urls["nats"]  # same port: clients find it again
        status = bcx("status", "--json", "--service", "bc-pki", env=exported)
        assert status.returncode == 0, status.stderr
        assert [s["service"] for s in json.loads(status.stdout)["services"]] == ["bc-pki"]
    finally:
        bcx("dev", "down", env=env)


def test_refused_credentials_are_unauthenticated_and_the_hint_names_the_context(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "--user", "bcx", "--pass", SECRET],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_port(port, timeout=10, pid=server.pid)
        config = tmp_path / "bcx.toml"
        env = {"BCX_CONFIG": str(config)}
        wrong = f"nats://bcx:not-{SECRET}@127.0.0.1:{port}"
        assert bcx("context", "add", "lab", "--nats-url", wrong, env=env).returncode == 0
        out = bcx("status", env=env, timeout=30)
        assert out.returncode == 1
        assert out.stderr == (
            f"error: UNAUTHENTICATED: NATS at nats://127.0.0.1:{port} refused this connection's credentials"
            " (hint: check the credentials of context lab (it has none): bcx context show lab)\n"
        )
        assert SECRET not in out.stderr + out.stdout
        right = f"nats://bcx:{SECRET}@127.0.0.1:{port}"
        ok = bcx("status", "--json", "--nats-url", right, env=env)  # the flag wins over the context
        assert "error" not in json.loads(ok.stdout), ok.stdout
        assert len(json.loads(ok.stdout)["missing"]) == 4  # connected: only no services run there
        # a credentials file that is not there: its path and the setting, before any connection
        gone = tmp_path / "gone.creds"
        out = bcx("status", "--json", "--creds", str(gone), env=env)
        err = json.loads(out.stdout)["error"]
        assert (err["code"], err["details"]["path"], err["details"]["file"]) == (
            "INVALID_CONFIG", "nats_creds", str(gone),
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
