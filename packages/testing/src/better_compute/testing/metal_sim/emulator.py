"""The fleet's BMC: one ``sushy-emulator`` (fake driver) holding every simulated system, with
Basic auth, the ``external_notifier`` on for each system, and per-machine power delays."""

from __future__ import annotations

import base64
import http.server
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ...runtime.embedded import free_port
from ..bmcs import _Proc, _wait_http, write_emulator_config

__all__ = ["EmulatedSystem", "FleetEmulator", "notifier_server"]


class EmulatedSystem(Protocol):
    """What the emulator holds of a machine (a ``SimMachine``, a VM)."""

    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def macs(self) -> tuple[str, ...]: ...


class FleetEmulator(_Proc):
    def __init__(self, folder: Path, *, username: str = "admin", password: str = "sim-bmc-pw-1") -> None:
        super().__init__(folder)
        self.username = username
        self.password = password
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.delays_file = self.folder / "power-delays.json"

    @property
    def credentials(self) -> dict[str, str]:
        """The BMC credential as the site agent reads it from bc-secrets."""
        return {"username": self.username, "password": self.password}

    def start(self, machines: Sequence[EmulatedSystem], *, notifier: str) -> FleetEmulator:
        systems = [
            {
                "uuid": m.uuid,
                "name": m.name,
                "power_state": "Off",
                "external_notifier": True,
                "nics": [{"mac": mac, "ip": f"192.0.2.{(m.index % 250) + 2}"} for mac in m.macs],
            }
            for m in machines
        ]
        config = write_emulator_config(
            self.folder, port=self.port, systems=systems, username=self.username, password=self.password,
            notifier=notifier, extra=f"SIM_POWER_DELAYS_FILE = {str(self.delays_file)!r}\n",
        )  # fmt: skip
        self._spawn(
            [sys.executable, "-m", "better_compute.testing.metal_sim.emulator_main", "--config", str(config)]
        )
        # a condition, not a sleep: on a loaded 2-core machine its start took over 30 s
        _wait_http(self.url + "/redfish/v1/", self.proc, self.output, timeout=90.0)
        return self

    def read_system(self, system_id: str) -> dict[str, Any] | None:
        """GET the system (the fake driver applies a due power change on a read)."""
        req = urllib.request.Request(f"{self.url}/redfish/v1/Systems/{system_id}")
        auth = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        req.add_header("Authorization", f"Basic {auth}")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                doc: dict[str, Any] = json.loads(resp.read())
                return doc
        except (OSError, urllib.error.URLError, ValueError):
            return None


def notifier_server(on_state: Callable[[dict[str, Any]], None]) -> http.server.ThreadingHTTPServer:
    """The HTTP server sushy-emulator's ``external_notifier`` PUTs each system's whole state to
    (on every change); ``on_state`` gets it before the answer goes back. Serve it in a thread."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_PUT(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                doc = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                # before answering; a system's changes may still arrive out of order (two
                # requests' threads PUT theirs at once): ``sim_seq`` numbers them as stored
                on_state(doc)
            self.send_response(204)
            self.end_headers()

    server = _NotifierServer(("127.0.0.1", 0), Handler)
    return server


class _NotifierServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    """The listen backlog: socketserver's 5 drops connections (the emulator's PUTs wait a
    second and more to try again) when a thousand machines' BMCs change at once."""
