"""The test run survives its own trouble: a test that overruns its time limit fails alone and the
run goes on to report it, and every process a test started (embedded nats-server and PostgreSQL,
a service) dies with the run even when pytest itself is SIGKILLed.

Each test runs pytest in a subprocess, with this project's configuration (pyproject.toml: its
plugins, pytest-timeout, asyncio mode), on a small test file written here."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from better_compute.runtime.embedded import pid_alive
from better_compute.testing import until

ROOT = Path(__file__).resolve().parents[2]

OVERRUNS = """
import asyncio
import time

import pytest

STATE = {}


def test_a_sync_test_that_sleeps_too_long():
    time.sleep(60)


def test_the_next_test_runs():
    pass


async def test_an_async_test_whose_service_task_is_busy_when_time_runs_out():
    async def busy():
        while True:
            sum(range(100_000))  # a service in the test's event loop, at work
            await asyncio.sleep(0)

    task = asyncio.create_task(busy())
    try:
        await asyncio.Event().wait()  # waits on a condition that never comes
    finally:
        task.cancel()
        STATE["cleaned"] = True


async def test_the_overrun_test_was_stopped_and_cleaned_up_before_the_next():
    await asyncio.sleep(0)
    assert STATE.get("cleaned")


@pytest.fixture
def slow_teardown():
    yield
    time.sleep(60)


def test_a_teardown_that_hangs(slow_teardown):
    pass


def test_the_last_test_runs():
    pass
"""


def _pytest(tmp_path: Path, test_file: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_tiny.py").write_text(test_file)
    env = {**os.environ, "BC_TEST_SETUP_TIMEOUT": "3"}
    # its own --basetemp: a pytest given none makes /tmp/pytest-of-<user> 0700 again at its start,
    # and an embedded PostgreSQL of the outer run (its own user, under that folder) then could not
    # reach its data folder: test_dev_stack failed so once, "initdb failed: … denied"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "--basetemp", str(tmp_path / "inner-tmp"), "-p", "no:cacheprovider", "-o", "timeout=3", "-q", *args,
         str(tmp_path / "test_tiny.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_test_past_its_time_limit_fails_alone_and_the_run_reports_it(tmp_path: Path, workers: str) -> None:
    done = _pytest(tmp_path, OVERRUNS, "-n", workers, timeout=180)
    out = done.stdout + done.stderr
    assert "INTERNALERROR" not in out, out[-4000:]
    assert done.returncode == 1, out[-4000:]  # tests failed; not 2 (interrupted) or 3 (internal error)
    assert "2 failed, 4 passed, 1 error" in out, out[-4000:]
    assert "FAILED test_tiny.py::test_a_sync_test_that_sleeps_too_long" in out
    assert "FAILED test_tiny.py::test_an_async_test_whose_service_task_is_busy_when_time_runs_out" in out
    assert "ERROR test_tiny.py::test_a_teardown_that_hangs" in out
    assert out.count("Timeout") >= 2


STARTS_EVERYTHING = """
import asyncio
from pathlib import Path

PIDS = Path(__file__).parent / "pids"


async def test_that_starts_servers_and_a_service(bc_servers, bc_processes):
    import server_pids  # written next to this file

    proc = bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    PIDS.write_text(" ".join(str(p) for p in [proc.pid, *server_pids.servers()]))
    await asyncio.Event().wait()
"""

FIND_SERVERS = '''
"""The pids of this process's embedded servers, found by their state folders."""
import json, os
from pathlib import Path


def servers():
    found = []
    for state in Path(os.environ.get("TMPDIR", "/tmp")).glob("bc-test-*"):
        meta = state / "nats" / "server.json"
        if meta.exists():
            found.append(json.loads(meta.read_text())["pid"])
        pidfile = state / "pg" / "data" / "postmaster.pid"
        if pidfile.exists():
            found.append(int(pidfile.read_text().splitlines()[0]))
    return found
'''


@pytest.mark.long  # a second pytest that starts its own PostgreSQL, nats-server and bc-pki: 60-120 s
@pytest.mark.timeout(420)  # under a loaded suite (make test-long)
async def test_every_process_a_test_started_dies_when_pytest_is_sigkilled(tmp_path: Path) -> None:
    (tmp_path / "server_pids.py").write_text(FIND_SERVERS)
    (tmp_path / "test_tiny.py").write_text(STARTS_EVERYTHING)
    temp = tmp_path / "tmp"
    temp.mkdir()
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": path}
    pytest_run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
        "-p", "no:cacheprovider", "-o", "timeout=600", "-q", "-n", "0", str(tmp_path / "test_tiny.py"),
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    pids: list[int] = []
    try:
        await until(lambda: (tmp_path / "pids").exists(), timeout=240, what="the test started its servers")
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert len(pids) == 3, pids  # bc-pki, nats-server, postgres
        assert all(pid_alive(p) for p in pids)
        pytest_run.kill()  # SIGKILL: no teardown, no atexit
        await pytest_run.wait()
        try:
            await until(lambda: not any(pid_alive(p) for p in pids), timeout=60, what="every process gone")
        except AssertionError:
            left = [p for p in pids if pid_alive(p)]
            raise AssertionError(f"still running after pytest was killed: {left}") from None
    finally:
        if pytest_run.returncode is None:
            pytest_run.kill()
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
