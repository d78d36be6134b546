"""Other people's BMCs for tests, each its own OS process on loopback.

* ``RedfishEmulator``: ``sushy-emulator`` (sushy-tools) with its fake driver, whose power
  changes land 1-11 s after the request, HTTP Basic auth from an htpasswd (bcrypt) file.
* ``FaultyProxy``: a small HTTP proxy in front of a BMC that answers 500 (or malformed JSON, or
  nothing) for a while, then forwards; it logs every request line so a test can count what
  reached the BMC.
* ``IpmiBmc``: a ``pyghmi.ipmi.bmc.Bmc`` subclass serving power and boot device on a UDP port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.embedded import free_port
from .guard import watch

__all__ = ["SYSTEM_MACS", "SYSTEM_UUID", "FaultyProxy", "IpmiBmc", "RedfishEmulator", "write_emulator_config"]

SYSTEM_UUID = "27946b59-9e44-4fa7-8e91-f3527a1ef094"
SYSTEM_MACS = ("52:54:00:aa:bb:01", "52:54:00:aa:bb:02")


@dataclass
class _Proc:
    folder: Path
    log: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = self.folder / "process.log"

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        watch(self.proc.pid)  # stopped with the test run, even a SIGKILLed one

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None, output: object, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited: {output() if callable(output) else ''}")
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # it answers (401 without credentials)
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout}s")


class RedfishEmulator(_Proc):
    """``sushy-emulator --fake`` on 127.0.0.1 with one system and Basic auth.

    ``power_lag``: a power change lands this many whole seconds (drawn from the range) after the
    second it was asked in; sushy's fake driver draws from 1-11, a test that waits for a
    change may ask for less."""

    def __init__(
        self,
        folder: Path,
        *,
        username: str = "admin",
        password: str = "s3cret-bmc-pw",
        auth: bool = True,
        power_lag: tuple[int, int] = (1, 11),
    ) -> None:
        super().__init__(folder)
        self.auth = auth
        self.power_lag = power_lag
        self.username = username
        self.password = password
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> RedfishEmulator:
        systems = [
            {
                "uuid": SYSTEM_UUID,
                "name": "node-1",
                "power_state": "Off",
                "external_notifier": False,
                "nics": [{"mac": mac, "ip": "192.0.2.10"} for mac in SYSTEM_MACS],
            }
        ]
        config = write_emulator_config(
            self.folder, port=self.port, systems=systems, username=self.username, password=self.password,
            auth=self.auth, notifier="http://127.0.0.1:9",
        )  # fmt: skip
        launch = "from sushy_tools.emulator.main import main; main()"
        if self.power_lag != (1, 11):  # the fake driver's one use of random is the power lag
            lo, hi = self.power_lag
            launch = (
                "import random, types\n"
                "from sushy_tools.emulator.resources.systems import fakedriver\n"
                f"fakedriver.random = types.SimpleNamespace(randint=lambda *_: random.randint({lo}, {hi}))\n"
                + launch
            )
        self._spawn([sys.executable, "-c", launch, "--config", str(config)])
        _wait_http(self.url + "/redfish/v1/", self.proc, self.output)
        return self


def write_emulator_config(
    folder: Path,
    *,
    port: int,
    systems: list[dict[str, Any]],
    username: str,
    password: str,
    auth: bool = True,
    notifier: str,
    extra: str = "",
) -> Path:
    """sushy-emulator's config (fake driver, ``systems``, state under ``folder``) and its htpasswd
    (bcrypt); ``extra`` lines are appended for a launcher of ours. Returns the config's path."""
    import bcrypt

    htpasswd = folder / "htpasswd"
    digest = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    htpasswd.write_text(f"{username}:{digest}\n")
    config = folder / "emulator.conf"
    config.write_text(
        textwrap.dedent(
            f"""\
            SUSHY_EMULATOR_LISTEN_IP = "127.0.0.1"
            SUSHY_EMULATOR_LISTEN_PORT = {port}
            SUSHY_EMULATOR_FAKE_DRIVER = True
            SUSHY_EMULATOR_FAKE_SYSTEMS = {systems!r}
            SUSHY_EMULATOR_STATE_DIR = {str(folder / "state")!r}
            SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd) if auth else None!r}
            EXTERNAL_NOTIFICATION_URL = {notifier!r}
            """
        )
        + extra
    )
    return config


_PROXY = r"""
import http.client, http.server, json, sys, threading, time
upstream_host, upstream_port = sys.argv[1], int(sys.argv[2])
control_file, request_log, listen_port = sys.argv[3], sys.argv[4], int(sys.argv[5])
lock = threading.Lock()

def control():
    try:
        with open(control_file) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def _any(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        ctl = control()
        mode = ctl.get("mode", "forward")
        if mode == "error-count":
            mode = "error" if ctl.get("left", 0) > 0 else "forward"
        if mode in ("lose-answer", "late-answer", "swallow"):
            lose = ctl.get("left", 0) > 0 and self.command in ctl.get("methods", [self.command])
            mode = mode if lose else "forward"
        with lock, open(request_log, "a") as fh:
            # the client's port names its connection: which requests shared one keep-alive socket
            fh.write(f"{self.command} {self.path} conn={self.client_address[1]} {mode}\n")
        if mode in ("error", "lose-answer", "late-answer", "swallow"):
            if ctl.get("mode") in ("error-count", "lose-answer", "late-answer", "swallow"):
                ctl["left"] -= 1
                with open(control_file, "w") as fh:
                    json.dump(ctl, fh)
        if mode == "error":
            data = b'{"error": {"code": "Base.1.0.GeneralError", "message": "injected"}}'
            self.send_response(ctl.get("status", 500))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if mode == "malformed":
            data = b'{"@odata.id": "/redfish/v1/", "Systems": {'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if mode == "hang":
            time.sleep(ctl.get("seconds", 30))
        if mode == "swallow":  # the request went out and never reached the BMC: no answer
            self.close_connection = True
            return
        conn = http.client.HTTPConnection(upstream_host, upstream_port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except Exception as exc:  # the BMC itself failed: say so in the log, answer nothing
            with lock, open(request_log, "a") as fh:
                port, failed = self.client_address[1], type(exc).__name__
                fh.write(f"{self.command} {self.path} conn={port} upstream-{failed}\n")
            self.close_connection = True
            return
        if body:  # what reached the BMC and was answered: a request lost on the way is not counted
            with lock, open(request_log + ".bodies", "a") as fh:
                fh.write(f"{self.command} {self.path} {body.decode(errors='replace')}\n")
        if mode == "lose-answer":  # the BMC applied it; the answer is lost on the way back
            conn.close()
            self.close_connection = True
            return
        if mode == "late-answer":  # the BMC applied it; its answer comes after the client gave up
            conn.close()
            time.sleep(ctl.get("seconds", 30))
            self.close_connection = True
            return
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()
        if mode == "linger-close" and self.close_connection:
            # asked to close (Connection: close) but said nothing of it in the answer, and slow
            # to do it, as some BMCs' HTTP stacks are: a client that takes the connection for
            # keep-alive writes its next request into a socket about to be closed unread
            self.wfile.flush()
            time.sleep(ctl.get("seconds", 0.3))
    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _any

class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

Server(("127.0.0.1", listen_port), Handler).serve_forever()
"""


class FaultyProxy(_Proc):
    """Forwards to ``upstream`` (``http://127.0.0.1:port``) unless told to misbehave:
    ``set(mode="error", status=500)``, ``set(mode="error-count", left=N)``, ``set(mode="malformed")``,
    ``set(mode="hang", seconds=S)``, ``set(mode="forward")``, and
    ``set(mode="lose-answer", left=N, methods=["POST"])``: the next N such requests reach the BMC
    (which applies them) but the connection closes before the answer comes back;
    ``set(mode="late-answer", left=N, methods=["POST"], seconds=S)``: the same, but the answer is
    held S seconds (then dropped), so a client with a shorter timeout times out;
    ``set(mode="swallow", left=N, methods=["POST"])``: the next N such requests are read and never
    forwarded (the BMC never sees them), and the connection closes without an answer;
    ``set(mode="linger-close", seconds=S)``: requests are forwarded, and a connection the client
    asked to close is closed S seconds after the answer, which did not say it would be."""

    def __init__(self, folder: Path, upstream: str) -> None:
        super().__init__(folder)
        host_port = upstream.split("://", 1)[1].rstrip("/")
        self.upstream_host, _, port = host_port.partition(":")
        self.upstream_port = int(port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.control = self.folder / "control.json"
        self.requests_log = self.folder / "requests.log"

    def set(self, **control: object) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(control))
        tmp.replace(self.control)

    def start(self) -> FaultyProxy:
        self.set(mode="forward")
        script = self.folder / "proxy.py"
        script.write_text(_PROXY)
        self._spawn(
            [
                sys.executable,
                str(script),
                self.upstream_host,
                str(self.upstream_port),
                str(self.control),
                str(self.requests_log),
                str(self.port),
            ]
        )
        _wait_http(self.url + "/redfish/v1/", self.proc, self.output)
        return self

    def bodies(self) -> list[str]:
        """``METHOD path body`` of every request with a body that reached the BMC and was answered
        (what the BMC applied; an injected error or a request lost before the BMC is not here)."""
        log = Path(str(self.requests_log) + ".bodies")
        return log.read_text().splitlines() if log.exists() else []

    def requests(self) -> list[str]:
        """``METHOD path conn=<client port> mode`` of every request the proxy took, in order."""
        return self.requests_log.read_text().splitlines() if self.requests_log.exists() else []


_IPMI_BMC = r"""
import json, sys, threading
import pyghmi.ipmi.bmc as bmc
from pyghmi.ipmi.private import serversession

state_file, user, password, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cipher, request_log = sys.argv[5], sys.argv[6]
log_lock = threading.Lock()

def log(line):
    with log_lock, open(request_log, "a") as fh:
        fh.write(line + "\n")

# pyghmi's server always answers cipher suite 3 (HMAC-SHA1) while its own client asks for
# SHA-256 (suite 17) first and falls back only when refused. cipher "3": refuse what we do not
# do, as a real BMC would; "none": refuse every proposal (a BMC whose suites the client lacks);
# "stock": pyghmi's own answer, suite 3 whatever was asked (a BMC that disagrees with itself).
_open = serversession.ServerSession.create_open_session_response

def _open_session(self, request):
    auth = request[12] if len(request) > 12 else None
    refuse = cipher == "none" or (cipher == "3" and auth != 1)
    log(f"open-session auth={auth} {'refused' if refuse else 'accepted'}")
    if refuse:
        return bytearray([request[0], 0x11, 0, 0]) + request[4:8] + bytearray(4)
    return _open(self, request)

serversession.ServerSession.create_open_session_response = _open_session

_request = serversession.ServerSession.handle_client_request

def _logged_request(self, request):
    netfn, command = request["netfn"], request["command"]
    name = {(6, 0x3b): "set-session-privilege", (6, 0x3c): "close-session", (6, 1): "get-device-id",
            (0, 1): "get-chassis-status", (0, 2): "chassis-control", (0, 8): "set-boot-options",
            (0, 9): "get-boot-options"}.get((netfn, command), f"netfn={netfn:#x} cmd={command:#x}")
    log(f"{name} session={bytes(self.managedsessionid).hex()}")
    return _request(self, request)

serversession.ServerSession.handle_client_request = _logged_request

class Bmc(bmc.Bmc):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = {"power": "off", "bootdev": "default", "calls": []}
        self.save()
    def save(self):
        with open(state_file + ".tmp", "w") as fh:
            json.dump(self.state, fh)
        import os
        os.replace(state_file + ".tmp", state_file)
    def _later(self, power):
        # real BMCs apply power changes late
        threading.Timer(1.0, self._apply, args=(power,)).start()
    def _apply(self, power):
        self.state["power"] = power
        self.save()
    def get_power_state(self):
        return self.state["power"]
    def power_on(self):
        self.state["calls"].append("on"); self.save(); self._later("on")
    def power_off(self):
        self.state["calls"].append("off"); self.save(); self._later("off")
    def power_shutdown(self):
        self.state["calls"].append("shutdown"); self.save(); self._later("off")
    def power_reset(self):
        self.state["calls"].append("reset"); self.save(); self._later("on")
    def power_cycle(self):
        self.state["calls"].append("cycle"); self.save(); self._later("on")
    def get_boot_device(self):
        return self.state["bootdev"]
    def set_boot_device(self, bootdevice):
        self.state["bootdev"] = bootdevice
        self.state["calls"].append("bootdev:" + bootdevice)
        self.save()

Bmc({user: password}, port=port, address="127.0.0.1").listen()
"""


class IpmiBmc(_Proc):
    """pyghmi's own IPMI BMC server, power and boot device, on a loopback UDP port.

    ``cipher``: ``"3"`` (the default) accepts cipher suite 3 only and refuses suite 17 as a real
    BMC without it would; ``"none"`` refuses every proposal; ``"stock"`` is pyghmi's own server,
    which answers suite 3 whatever the client asked for. ``requests()`` is the BMC's request log:
    every session opened (``open-session auth=<algorithm> accepted|refused``) and every IPMI
    request a logged-in session made (``get-chassis-status session=<id>``, ``close-session …``).
    """

    def __init__(
        self, folder: Path, *, username: str = "admin", password: str = "ipmi-pw-123", cipher: str = "3"
    ) -> None:
        super().__init__(folder)
        self.username = username
        self.password = password
        self.cipher = cipher
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.state_file = self.folder / "bmc-state.json"
        self.requests_log = self.folder / "requests.log"

    def start(self) -> IpmiBmc:
        script = self.folder / "ipmi_bmc.py"
        script.write_text(_IPMI_BMC)
        self._spawn(
            [
                sys.executable,
                str(script),
                str(self.state_file),
                self.username,
                self.password,
                str(self.port),
                self.cipher,
                str(self.requests_log),
            ]
        )
        end = time.monotonic() + 30
        while not self.state_file.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(self.output())
            if time.monotonic() > end:
                raise RuntimeError("the IPMI BMC did not start")
            time.sleep(0.05)
        return self

    def state(self) -> dict[str, object]:
        result: dict[str, object] = json.loads(self.state_file.read_text())
        return result

    def requests(self) -> list[str]:
        """The BMC's request log, in order (see the class)."""
        return self.requests_log.read_text().splitlines() if self.requests_log.exists() else []
