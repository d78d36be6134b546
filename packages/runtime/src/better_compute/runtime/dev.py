"""``bcx dev``: the whole stack on one machine, each service its own OS process.

Processes are detached (they outlive ``bcx dev up``); each is recorded in
``<state>/procs/<name>.json`` with its pid, and logs to ``<state>/logs/<name>.log``.

The destructive-batch quorum ``dev up`` was given (``[cmdq.quorum]`` in ``bc.toml`` or
``BC_CMDQ_QUORUM_*``) is kept in ``<state>/quorum.json``: a later ``dev up`` given none starts the
command queue with that one, so a plain restart never turns the quorum off. Delete the file to
turn it off.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..config import Settings, env_var
from ..core.errors import BcError, ErrorCode
from ..files import atomic_write
from ..logging import safe_url
from .embedded import (
    EmbeddedNats,
    EmbeddedPostgres,
    free_port,
    pid_alive,
    port_free,
    spawn_detached,
    stop_pid,
    wait_port,
)

__all__ = ["QUORUM_FILE", "RAMDISK_SERVER", "SERVICES", "DevStack", "ProcRecord", "log_tail"]

QUORUM_FILE = "quorum.json"
RAMDISK_SERVER = "bc-ramdisk-http"
"""The process that serves the built ramdisk to the site agent (``<state>/ramdisk-http/``)."""

# console name -> python module
SERVICES: dict[str, str] = {
    "bc-engine": "bc_engine",
    "bc-command-queue": "bc_command_queue",
    "bc-pki": "bc_pki",
    "bc-secrets": "bc_secrets",
}


_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]*@")


def log_tail(log: Path, *, lines: int = 12) -> str:
    """``, which ends:`` and the last ``lines`` lines of a process's log, to follow "its log is
    <path>" in an error; passwords in URLs taken out (a traceback may print one)."""
    try:
        tail = [_USERINFO.sub(r"\1", line) for line in log.read_text(errors="replace").splitlines()[-lines:]]
    except OSError:
        tail = []
    return ", which ends:\n" + "\n".join(f"  | {line}" for line in tail) if tail else " (empty)"


@dataclass(frozen=True)
class ProcRecord:
    name: str
    service: str
    pid: int
    started: float
    log: str

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid)


class DevStack:
    """The embedded servers plus service processes under one state directory."""

    def __init__(self, settings: Settings, *, say: Callable[[str], None] = lambda _m: None) -> None:
        self.settings = settings
        self.state = Path(settings.state_dir).resolve()
        self.procs = self.state / "procs"
        self.logs = self.state / "logs"
        self.say = say
        self.nats = EmbeddedNats(self.state)
        self.pg = EmbeddedPostgres(self.state)

    def _embedded_nats(self) -> bool:
        """Whether NATS is ours to start and stop: no URL set, or the URL ``bcx dev up`` printed for
        our own server (exported from its output), which a dead server must not turn external."""
        return not self.settings.nats_url or _points_at(self.settings.nats_url, self.nats.recorded_port())

    def _embedded_pg(self) -> bool:
        return not self.settings.database_url or _points_at(
            self.settings.database_url, self.pg.recorded_port()
        )

    def up(self, *, services: Iterable[str] = SERVICES, instances: int = 1) -> dict[str, str]:
        """Start what is not running; returns the URLs in use."""
        self.procs.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        if not self._embedded_nats():
            assert self.settings.nats_url is not None
            nats_url = self.settings.nats_url
            self.say(f"nats-server       external  {safe_url(nats_url)}")
        else:
            was = self.nats.running_pid()
            nats_url = self.nats.start()
            self.say(f"nats-server       {'running ' if was else 'started '}  {nats_url}")
        if not self._embedded_pg():
            assert self.settings.database_url is not None
            db_url = self.settings.database_url
            self.say("postgresql        external")
        else:
            was = self.pg.running_pid()
            db_url = self.pg.start()
            self.say(f"postgresql        {'running ' if was else 'started '}  {db_url}")
        env = dict(os.environ)
        kept = self._keep_quorum()
        if kept is not None:
            env[env_var("cmdq.quorum.file")] = str(kept)
        env.update(
            BC_NATS_URL=nats_url,
            BC_DATABASE_URL=db_url,
            BC_SUBJECT_ROOT=self.settings.subject_root,
            BC_APP=self.settings.app,
            BC_STATE_DIR=str(self.state),
        )
        env.update(self._ramdisk())
        # The embedded NATS has no accounts, so nats-server cannot tell the engine from anyone
        # else on the bus: the engine proves the commands it sends under a workflow with a key
        # only the stack's own processes read (its state folder is its user's alone).
        key_var = env_var("cmdq.engine_key_file")
        if not env.get(key_var) and not self.settings.cmdq.engine_key_file:
            env[key_var] = str(self.state / "keys" / "engine-commands.key")
        for service in services:
            module = SERVICES[service]
            for n in range(1, instances + 1):
                name = f"{service}-{n}"
                rec = self.record(name)
                if rec is not None and rec.alive:
                    self.say(f"{service:<17} running   pid {rec.pid}")
                    continue
                log_path = self.logs / f"{name}.log"
                pid = spawn_detached([sys.executable, "-m", module, "--instance", name], log_path, env=env)
                rec = ProcRecord(name, service, pid, time.time(), str(log_path))
                (self.procs / f"{name}.json").write_text(json.dumps(rec.__dict__))
                self.say(f"{service:<17} started   pid {pid}")
        return {"nats": nats_url, "database": db_url}

    def _ramdisk(self) -> dict[str, str]:
        """The ``BC_RAMDISK_*`` the services get: none when ``[ramdisk]`` names one already or
        nothing is built; else the ramdisk ``bcx ramdisk build`` wrote into ``[ramdisk] dir``,
        served by sha256 on loopback (a file server of the stack), for the site agent's cache."""
        given = self.settings.ramdisk
        if given.kernel or given.script:
            self.say(f"ramdisk           set       {given.kernel or 'an iPXE script'}")
            return {}
        folder = Path(given.dir)
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
            parts = {part: manifest[part] for part in ("kernel", "initrd")}
            shas = {part: str(doc["sha256"]) for part, doc in parts.items()}
        except (OSError, ValueError, KeyError, TypeError):
            self.say(f"ramdisk           none      (bcx ramdisk build writes one into {folder})")
            return {}
        served = self.state / "ramdisk-http"
        served.mkdir(parents=True, exist_ok=True)
        for part, doc in parts.items():
            target = served / shas[part]
            if not target.exists():
                tmp = served / f".{shas[part]}.tmp"
                tmp.unlink(missing_ok=True)
                try:
                    os.link(folder / str(doc["file"]), tmp)
                except OSError:
                    tmp.write_bytes((folder / str(doc["file"])).read_bytes())
                tmp.replace(target)
        port = self._ramdisk_server(served)
        base = f"http://127.0.0.1:{port}"
        self.say(f"ramdisk           served    {base}/ ({folder}, kernel {shas['kernel'][:12]})")
        return {
            env_var("ramdisk.kernel"): f"{base}/{shas['kernel']}",
            env_var("ramdisk.kernel_sha256"): shas["kernel"],
            env_var("ramdisk.initrd"): f"{base}/{shas['initrd']}",
            env_var("ramdisk.initrd_sha256"): shas["initrd"],
            env_var("ramdisk.cmdline"): str(given.cmdline or manifest.get("cmdline") or ""),
        }

    def _ramdisk_server(self, folder: Path) -> int:
        """The port of the stack's ramdisk file server, started when it is not running (on the
        port it had, so the URLs a running engine holds stay good)."""
        rec = self.record(RAMDISK_SERVER)
        port_file = self.state / "ramdisk-http.port"
        try:
            port = int(port_file.read_text())
        except (OSError, ValueError):
            port = 0
        if rec is not None and rec.alive and port:
            return port
        if not port or not port_free(port):
            port = free_port()
        log = self.logs / f"{RAMDISK_SERVER}.log"
        argv = [sys.executable, "-m", "better_compute.runtime.fileserver", "--dir", str(folder)]
        pid = spawn_detached([*argv, "--port", str(port)], log)
        wait_port(port, timeout=10.0, pid=pid)
        rec = ProcRecord(RAMDISK_SERVER, RAMDISK_SERVER, pid, time.time(), str(log))
        (self.procs / f"{RAMDISK_SERVER}.json").write_text(json.dumps(rec.__dict__))
        port_file.write_text(str(port))
        return port

    def _keep_quorum(self) -> Path | None:
        """Save the quorum these settings carry in the state folder; with none, the saved one.

        Returns the file the command queue must be given (only when the settings carry none,
        so it never meets inline approvers from ``bc.toml``), else ``None``.
        """
        q = self.settings.cmdq.quorum
        kept = self.state / QUORUM_FILE
        if q.file is None and not q.approvers and not q.threshold:
            if kept.is_file():
                self.say(f"quorum            kept      {kept} (delete it to turn the quorum off)")
                return kept
            self.say("quorum            off       (no approvers: destructive commands need no approval)")
            return None
        if q.file is not None:
            try:
                raw = Path(q.file).read_bytes()
                doc: Any = json.loads(raw) if q.file.endswith(".json") else tomllib.loads(raw.decode())
            except (OSError, ValueError) as exc:
                raise BcError(
                    ErrorCode.INVALID_CONFIG,
                    f"cannot read the approvers file {q.file}: {exc}",
                    {"path": "cmdq.quorum.file"},
                ) from exc
            if not isinstance(doc, dict):
                doc = {}
            data = {"threshold": doc.get("threshold", 0), "approvers": doc.get("approvers", [])}
        else:
            data = {
                "threshold": q.threshold,
                "approvers": [{"id": a.id, "publicKey": a.public_key} for a in q.approvers],
            }
        kept.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(kept, json.dumps(data, indent=2) + "\n", mode=0o644)
        self.say(f"quorum            saved     {kept}")
        return None

    def record(self, name: str) -> ProcRecord | None:
        try:
            data: dict[str, Any] = json.loads((self.procs / f"{name}.json").read_text())
            return ProcRecord(**data)
        except (OSError, ValueError, TypeError):
            return None

    def start_failure(self, name: str, why: str, *, lines: int = 12) -> str:
        """What to tell about the service process ``name`` that is not up: ``why``, its log file
        and the log's last lines."""
        rec = self.record(name)
        log = Path(rec.log) if rec is not None else self.logs / f"{name}.log"
        return f"{name} {why}; its log is {log}{log_tail(log, lines=lines)}"

    def records(self) -> list[ProcRecord]:
        if not self.procs.is_dir():
            return []
        found = (self.record(p.stem) for p in sorted(self.procs.glob("*.json")))
        return [r for r in found if r is not None]

    def stop_services(self, services: Iterable[str]) -> None:
        """Stop these services' processes (every instance); NATS, PostgreSQL, the simulator and
        its site agent stay: what ``bcx dev up --restart`` does before it starts them again (a
        plugin installed since, a changed setting)."""
        wanted = set(services)
        for rec in self.records():
            if rec.service in wanted:
                if rec.alive:
                    t0 = time.monotonic()
                    clean = stop_pid(rec.pid, grace=5.0)
                    how = "stopped" if clean else "killed "
                    self.say(f"{rec.service:<17} {how}   pid {rec.pid} in {time.monotonic() - t0:.1f}s")
                (self.procs / f"{rec.name}.json").unlink(missing_ok=True)

    def down(self, *, keep_servers: bool = False) -> None:
        for rec in self.records():
            if rec.alive:
                t0 = time.monotonic()
                clean = stop_pid(rec.pid, grace=5.0)
                how = "stopped" if clean else "killed "
                self.say(f"{rec.service:<17} {how}   pid {rec.pid} in {time.monotonic() - t0:.1f}s")
            # each was spawned as a session (and group) leader: what it started goes with it
            # (the simulator of `bcx sim up` holds an emulator and bcds)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec.pid, signal.SIGKILL)
            (self.procs / f"{rec.name}.json").unlink(missing_ok=True)
        if keep_servers:
            return
        if self._embedded_nats() and self.nats.running_pid():
            self.nats.stop()
            self.say("nats-server       stopped")
        if self._embedded_pg() and self.pg.running_pid():
            self.pg.stop()
            self.say("postgresql        stopped")


def _points_at(url: str, port: int | None) -> bool:
    """Whether ``url`` names the local server of ours that listens (or listened) on ``port``."""
    if port is None:
        return False
    try:
        parts = urlsplit(url)
        return parts.hostname in ("127.0.0.1", "localhost") and parts.port == port
    except ValueError:
        return False
