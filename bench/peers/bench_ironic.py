"""The peer in the same run: OpenStack Ironic, standalone, next to our own fleet benchmark.

    uv run --frozen --group bench python bench/peers/bench_ironic.py --machines 10
    uv run --frozen --group bench python bench/peers/bench_ironic.py --machines 100 --skip-ours

Ironic comes from PyPI into its own virtualenv under ``~/.cache/better-compute/peers/`` (made on
first use with ``uv venv`` + ``uv pip install``; never the project's environment or lock). It runs
as one all-in-one ``ironic`` process (API and conductor, ``rpc_transport = none``), SQLite in that
process, ``auth_strategy = noauth``, against one sushy-emulator holding N systems: the project's
own launcher (``better_compute.testing.metal_sim.emulator_main``, sushy-tools' fake driver with
the in-memory store and power changes landing at once, as ``bench_fleet``'s default).

Each machine is ``redfish`` hardware type with:

* power, management: ``redfish`` (every power and boot-device change is a Redfish call);
* inspect: ``redfish`` (out-of-band: the system, processors, memory, storage and NICs read from
  the BMC; ports made from the NICs);
* boot: ``pxe`` (the PXE config files written to a TFTP folder, the boot device set to PXE over
  Redfish; nothing serves them: the emulated machine boots nothing);
* deploy: ``ramdisk`` (the cheapest deploy interface that still drives the BMC: kernel and
  ramdisk cached and linked for PXE, boot device set, the machine power-cycled, then ``active``;
  no agent, no disk written);
* cleaning off (``automated_clean = false``: cleaning needs the agent ramdisk), network ``noop``,
  everything else ``no-*``.

Both sides are taken through enroll -> manage (Ironic's power-state check) -> inspect -> provide ->
deploy. Ironic's CPU is user+sys of the ``ironic`` process and its children (SQLite is in it),
read from /proc per phase; the emulator's CPU is counted apart (the simulation). Our side is
``bench/bench_fleet.py`` run as a subprocess for the same N (before Ironic, not at the same time);
its CPU is the deploy phase only, per kind of process (it measures nothing before the deploy
verb), so the table compares the deploy phase side by side and gives Ironic's whole lifecycle
besides.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import http.client
import http.server
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CACHE = Path(os.environ.get("BC_PEERS_CACHE", Path.home() / ".cache" / "better-compute" / "peers"))
VENV = CACHE / "ironic-venv"
IRONIC_SPEC = os.environ.get("BC_IRONIC_SPEC", "ironic==39.0.0")
CLK_TCK = os.sysconf("SC_CLK_TCK")
API_HEADERS = {"Content-Type": "application/json", "X-OpenStack-Ironic-API-Version": "latest"}

# bench_fleet's kinds of process: what we ship (nats-server and PostgreSQL included) and what
# only simulates the machines
PRODUCT_KINDS = (
    "bc-engine", "bc-command-queue", "bc-pki", "bc-secrets", "site agents", "nats-server", "PostgreSQL",
)  # fmt: skip
SIMULATION_KINDS = ("sushy emulators", "bcd (simulated)")


# ---- the virtualenv ------------------------------------------------------------------------


def ensure_venv() -> Path:
    """The Ironic virtualenv, made (``uv venv``, ``uv pip install``) when it is not there."""
    python = VENV / "bin" / "python"
    ok = VENV / ".bc-installed"
    if python.exists() and ok.exists() and ok.read_text().strip() == IRONIC_SPEC:
        return VENV
    CACHE.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv") or f"{sys.executable} -m uv"
    print(f"installing {IRONIC_SPEC} into {VENV} (once)", flush=True)
    if not python.exists():
        subprocess.run([*uv.split(), "venv", "--python", f"{sys.version_info[0]}.{sys.version_info[1]}",
                        str(VENV)], check=True)  # fmt: skip
    subprocess.run([*uv.split(), "pip", "install", "--python", str(python), IRONIC_SPEC], check=True)
    ok.write_text(IRONIC_SPEC + "\n")
    return VENV


def venv_version(package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "?"


# ---- CPU from /proc ------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_cpu(root: int) -> float:
    """User+sys CPU seconds of ``root`` and every live descendant, reaped children included."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            kids.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        fields = _stat(pid)
        if fields is None:
            continue
        total += sum(int(x) for x in fields[11:15]) / CLK_TCK
        todo.extend(kids.get(pid, []))
    return total


def pss_mib(root: int) -> float:
    total = 0.0
    pids = [root] + [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()
                     and (f := _stat(int(e.name))) and int(f[1]) == root]  # fmt: skip
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
    return total


def redfish_requests(*logs: Path) -> int:
    """Requests sushy-emulator answered, from its access log (werkzeug's, one line a request)."""
    total = 0
    for log in logs:
        with contextlib.suppress(OSError):
            total += sum(1 for line in log.read_text(errors="replace").splitlines() if " /redfish/v1" in line)
    return total


# ---- Ironic --------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_ironic_conf(folder: Path, port: int) -> Path:
    for sub in ("tftp", "tftp-master", "images", "master-images", "http", "locks"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "ironic.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            [DEFAULT]
            host = bench-peer
            auth_strategy = noauth
            rpc_transport = none
            enabled_hardware_types = redfish
            enabled_power_interfaces = redfish
            enabled_management_interfaces = redfish
            enabled_inspect_interfaces = redfish
            enabled_boot_interfaces = pxe
            enabled_deploy_interfaces = ramdisk
            enabled_network_interfaces = noop
            enabled_raid_interfaces = no-raid
            enabled_bios_interfaces = no-bios
            enabled_console_interfaces = no-console
            enabled_vendor_interfaces = no-vendor
            enabled_firmware_interfaces = no-firmware
            enabled_rescue_interfaces = no-rescue
            default_boot_interface = pxe
            default_deploy_interface = ramdisk
            default_inspect_interface = redfish
            default_network_interface = noop
            minimum_memory_warning_only = true
            log_file = {folder / "ironic.log"}
            use_stderr = false

            [api]
            host_ip = 127.0.0.1
            port = {port}
            max_limit = 100000

            [database]
            connection = sqlite:///{folder / "ironic.sqlite"}
            # how long Ironic retries a locked SQLite (default 10 s): at N=100 a PUT of a
            # provision state failed 500 "database is locked" with the default
            sqlite_max_wait_for_retry = 120

            [conductor]
            automated_clean = false
            # time to wait for a power change to show (default 60 s): a loaded 2-core machine
            # must not fail a deploy that would have succeeded; it costs nothing while unused
            power_state_change_timeout = 600
            file_url_allowed_paths = {folder}

            [dhcp]
            dhcp_provider = none

            [pxe]
            tftp_root = {folder / "tftp"}
            tftp_master_path = {folder / "tftp-master"}
            images_path = {folder / "images"}
            instance_master_path = {folder / "master-images"}
            tftp_server = 127.0.0.1

            [deploy]
            http_root = {folder / "http"}
            http_url = http://127.0.0.1:9/

            [oslo_concurrency]
            lock_path = {folder / "locks"}
            """
        )
    )
    return conf


@dataclass
class Ironic:
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Ironic:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = write_ironic_conf(self.folder, self.port)
        bin_ = VENV / "bin"
        with open(self.folder / "dbsync.out", "wb") as out:
            subprocess.run([str(bin_ / "ironic-dbsync"), "--config-file", str(conf), "create_schema"],
                           stdout=out, stderr=subprocess.STDOUT, check=True)  # fmt: skip
        with open(self.folder / "ironic.out", "wb") as out:
            self.proc = subprocess.Popen(
                [str(bin_ / "ironic"), "--config-file", str(conf)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        end = time.monotonic() + 180
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ironic exited {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                if self.call("GET", "/v1/drivers", tries=1).get("drivers"):
                    return self
            time.sleep(0.5)
        raise RuntimeError(f"ironic did not answer in 180 s: {self.tail()}")

    def tail(self, n: int = 40) -> str:
        lines: list[str] = []
        for name in ("ironic.out", "ironic.log"):
            path = self.folder / name
            if path.exists():
                lines += path.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines)

    def call(
        self, method: str, path: str, body: Any = None, *, retried: list[bool] | None = None, tries: int = 6
    ) -> Any:
        """One API call, tried again as an operator's client would: a connection Ironic's API
        server reset or dropped (it did under 16 calls at once at N=100; ``retried`` tells the
        caller, since the first try may have been carried out) and a 500 "database is locked",
        up to ``tries`` in all; a 409/503 "is locked" (the node held by another task) every 2 s
        for up to 2 minutes."""
        data = None if body is None else json.dumps(body).encode()
        locked = 0
        attempt = -1
        while attempt < tries - 1:
            attempt += 1
            req = urllib.request.Request(self.url + path, data=data, method=method, headers=API_HEADERS)
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    raw = resp.read()
                return json.loads(raw) if raw else {}
            except urllib.error.HTTPError as e:
                text = e.read()[:500]
                if e.code == 500 and b"database is locked" in text and attempt < tries - 1:
                    print(f"  {method} {path}: 500 database is locked, again", flush=True)
                    time.sleep(0.5 * (attempt + 1))
                    continue  # nothing was changed: the request's transaction did not commit
                if e.code in (409, 503) and b"is locked" in text and locked < 60:
                    # the node is held by another task (its power sync, the last step's end):
                    # python-ironicclient tries again on 409/503 too, every 2 s
                    locked += 1
                    attempt -= 1  # not one of the tries
                    time.sleep(2.0)
                    continue
                raise RuntimeError(f"{method} {path}: {e.code} {text!r}") from None
            except (ConnectionError, urllib.error.URLError, http.client.RemoteDisconnected) as e:
                if attempt == tries - 1:
                    raise
                print(f"  {method} {path}: {e}, again", flush=True)
                if retried is not None:
                    retried.append(True)
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@dataclass(frozen=True)
class System:
    index: int
    uuid: str
    name: str
    macs: tuple[str, ...]


def run_ironic(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from better_compute.testing.bmcs import _wait_http, write_emulator_config
    from better_compute.testing.metal_sim.emulator import FleetEmulator, notifier_server

    class InventoryEmulator(FleetEmulator):
        """The fleet's emulator, launched through ``inventory_emulator.py`` (CPUs, memory)."""

        def start(self, machines: Any, *, notifier: str) -> InventoryEmulator:
            systems = [
                {"uuid": m.uuid, "name": m.name, "power_state": "Off", "external_notifier": True,
                 "nics": [{"mac": mac, "ip": f"192.0.2.{(m.index % 250) + 2}"} for mac in m.macs]}
                for m in machines
            ]  # fmt: skip
            extra = f"SIM_POWER_DELAYS_FILE = {str(self.delays_file)!r}\n"
            extra += STORAGE.format(uuids=[m.uuid for m in machines])
            config = write_emulator_config(
                self.folder, port=self.port, systems=systems, username=self.username, password=self.password,
                notifier=notifier, extra=extra,
            )  # fmt: skip
            self._spawn([sys.executable, str(HERE / "inventory_emulator.py"), "--config", str(config)])
            _wait_http(self.url + "/redfish/v1/", self.proc, self.output, timeout=90.0)
            return self

    systems = [
        System(i, str(uuid.UUID(int=0x1C0000 + i)), f"peer-{i:05d}",
               (f"52:54:01:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}",))
        for i in range(args.machines)
    ]  # fmt: skip
    notifier = notifier_server(lambda doc: None)
    threading.Thread(target=notifier.serve_forever, daemon=True).start()
    emulator = InventoryEmulator(folder / "emulator")
    emulator.delays_file.parent.mkdir(parents=True, exist_ok=True)
    emulator.delays_file.write_text(json.dumps({"default": [0.0, 0.0]}))
    ironic = Ironic(folder / "ironic")
    (folder / "ironic").mkdir(parents=True, exist_ok=True)
    images = folder / "ironic" / "images-src"
    images.mkdir(parents=True, exist_ok=True)
    (images / "kernel").write_bytes(b"\0" * 4096)
    (images / "ramdisk").write_bytes(b"\0" * 4096)
    # the kernel and ramdisk Ironic downloads (once, into its image cache) over HTTP
    media_server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietFiles, directory=str(images))
    )
    threading.Thread(target=media_server.serve_forever, daemon=True).start()
    media = f"http://127.0.0.1:{media_server.server_address[1]}"
    pool = concurrent.futures.ThreadPoolExecutor(args.concurrency)
    try:
        t = time.monotonic()
        emulator.start(systems, notifier=f"http://127.0.0.1:{notifier.server_address[1]}")
        ironic.start()
        assert ironic.proc is not None
        assert emulator.proc is not None
        up = time.monotonic() - t
        print(f"ironic {venv_version('ironic')} up in {up:.1f} s at {ironic.url}", flush=True)
        phases: dict[str, dict[str, float]] = {}
        ids: list[str] = []

        def measured(name: str, fn: Any) -> None:
            c0, e0, t0 = tree_cpu(ironic.proc.pid), tree_cpu(emulator.proc.pid), time.monotonic()  # type: ignore[union-attr]
            r0 = redfish_requests(emulator.log)
            fn()
            phases[name] = {
                "wall_s": time.monotonic() - t0,
                "ironic_cpu_s": tree_cpu(ironic.proc.pid) - c0,  # type: ignore[union-attr]
                "emulator_cpu_s": tree_cpu(emulator.proc.pid) - e0,  # type: ignore[union-attr]
                "redfish_requests": redfish_requests(emulator.log) - r0,
            }
            p = phases[name]
            print(f"{name}: {p['wall_s']:.1f} s, ironic {p['ironic_cpu_s']:.2f} CPU s,"
                  f" emulator {p['emulator_cpu_s']:.2f} CPU s", flush=True)  # fmt: skip

        def provision(node: str, body: dict[str, Any]) -> None:
            retried: list[bool] = []
            try:
                ironic.call("PUT", f"/v1/nodes/{node}/states/provision", body, retried=retried)
            except RuntimeError as e:
                # a retry of a change the first try made: 400/409 (locked, or no such transition
                # from where it already is); wait_all still sees a node that does not get there
                if not (retried and (" 409 " in str(e) or " 400 " in str(e))):
                    raise

        def enroll() -> None:
            def one(s: System) -> str:
                body = {
                    "name": s.name, "driver": "redfish",
                    "driver_info": {
                        "redfish_address": emulator.url, "redfish_system_id": f"/redfish/v1/Systems/{s.uuid}",
                        "redfish_username": emulator.username, "redfish_password": emulator.password,
                        "redfish_verify_ca": False,
                        "deploy_kernel": f"{media}/kernel",
                        "deploy_ramdisk": f"{media}/ramdisk",
                    },
                    "boot_interface": "pxe", "deploy_interface": "ramdisk", "inspect_interface": "redfish",
                    "network_interface": "noop",
                }  # fmt: skip
                retried: list[bool] = []
                try:
                    node = ironic.call("POST", "/v1/nodes", body, retried=retried)
                except RuntimeError as e:
                    if not (retried and " 409 " in str(e)):
                        raise
                    node = ironic.call("GET", f"/v1/nodes/{s.name}")  # the first try was made
                return str(node["uuid"])

            ids.extend(pool.map(one, systems))

        def move(target: str, want: str, body: dict[str, Any] | None = None) -> None:
            def one(node: str) -> None:
                provision(node, {"target": target, **(body or {})})

            list(pool.map(one, ids))
            wait_all(ironic, want, args.machines, timeout=args.timeout, what=target)

        def deploy() -> None:
            def one(node: str) -> None:
                ironic.call("PATCH", f"/v1/nodes/{node}", [
                    {"op": "add", "path": "/instance_info/kernel", "value": f"{media}/kernel"},
                    {"op": "add", "path": "/instance_info/ramdisk", "value": f"{media}/ramdisk"},
                ])  # fmt: skip
                provision(node, {"target": "active"})

            list(pool.map(one, ids))
            wait_all(ironic, "active", args.machines, timeout=args.timeout, what="deploy")

        measured("enroll", enroll)
        measured("manage", lambda: move("manage", "manageable"))
        measured("inspect", lambda: move("inspect", "manageable"))
        measured("provide", lambda: move("provide", "available"))
        measured("deploy", deploy)
        idle: dict[str, float] = {}
        if args.idle > 0:  # every machine active, no API call: Ironic's periodic work alone
            c0, r0 = tree_cpu(ironic.proc.pid), redfish_requests(emulator.log)
            time.sleep(args.idle)
            idle = {"seconds": args.idle, "ironic_cpu_s": round(tree_cpu(ironic.proc.pid) - c0, 2),
                    "redfish_requests": redfish_requests(emulator.log) - r0}  # fmt: skip
            print(f"idle {args.idle:.0f} s: ironic {idle['ironic_cpu_s']} CPU s,"
                  f" {idle['redfish_requests']} Redfish requests", flush=True)  # fmt: skip
        ports = len(ironic.call("GET", "/v1/ports?limit=100000").get("ports", []))
        power_on = sum(1 for n in ironic.call("GET", "/v1/nodes?fields=power_state&limit=100000")["nodes"]
                       if n["power_state"] == "power on")  # fmt: skip
        total = {k: sum(p[k] for p in phases.values())
                 for k in ("wall_s", "ironic_cpu_s", "emulator_cpu_s", "redfish_requests")}  # fmt: skip
        return {
            "machines": args.machines, "ironic": venv_version("ironic"), "sushy": venv_version("sushy"),
            "phases": {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in phases.items()},
            "total": {k: round(v, 2) for k, v in total.items()},
            "ports_made_by_inspection": ports, "powered_on_at_the_end": power_on,
            "ironic_pss_mib": round(pss_mib(ironic.proc.pid)), "idle": idle,
        }  # fmt: skip
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        ironic.close()
        emulator.close()
        notifier.shutdown()
        media_server.shutdown()


def wait_all(ironic: Ironic, want: str, n: int, *, timeout: float, what: str) -> None:
    """Until ``n`` nodes are in provision state ``want`` (one list call every 2 s: Ironic's CPU
    includes answering it; our side's bench is told by events instead); a node that
    failed, or one with an error while settled, stops the bench with its error."""
    t0, last = time.monotonic(), -100.0
    while True:
        nodes = ironic.call("GET", "/v1/nodes?fields=uuid,provision_state,target_provision_state,last_error"
                                   "&limit=100000")["nodes"]  # fmt: skip
        states: dict[str, int] = {}
        for node in nodes:
            states[node["provision_state"]] = states.get(node["provision_state"], 0) + 1
        failed = [
            nd for nd in nodes if "fail" in nd["provision_state"]
            or (nd["last_error"] and not nd["target_provision_state"] and nd["provision_state"] != want)
        ]  # fmt: skip
        if failed:
            raise RuntimeError(f"{what}: {len(failed)} node(s) failed, e.g. {failed[0]}\n{ironic.tail()}")
        if sum(1 for nd in nodes if nd["provision_state"] == want and not nd["target_provision_state"]) >= n:
            return
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: {states} after {timeout:.0f} s")
        if time.monotonic() - last > 10:
            print(f"  {what}: {dict(sorted(states.items()))}", flush=True)
            last = time.monotonic()
        time.sleep(2.0)


# sushy-emulator's static storage: one controller, one 480 GB disk and no volumes per system
# (Ironic's inspection reads the Storage collection the system links and its Volumes; without
# them the emulator answers 500 and sushy retries each read 10 times, 3 s apart)
STORAGE = """
_UUIDS = {uuids!r}
SUSHY_EMULATOR_STORAGE = {{u: [{{"Id": "1", "Name": "Local Storage Controller", "Drives": ["disk0"],
    "StorageControllers": [{{"MemberId": "0", "Name": "Simulated RAID", "SpeedGbps": 12}}]}}]
    for u in _UUIDS}}
SUSHY_EMULATOR_DRIVES = {{(u, "1"): [{{"Id": "disk0", "Name": "disk0", "CapacityBytes": 480103981056,
    "Protocol": "SATA"}}] for u in _UUIDS}}
SUSHY_EMULATOR_VOLUMES = {{(u, "1"): [] for u in _UUIDS}}
"""


# ---- ours ----------------------------------------------------------------------------------


class TreeSampler:
    """CPU seconds per kind of process of ``bench_fleet``'s tree (its children, and the servers it
    starts detached, found by the state folder in their command line), sampled every
    ``interval`` s so that processes which end between two marks are still counted.

    A live process counts its own time and its reaped children's; one that ended counts its last
    sample unless its parent is still tracked and alive (the parent's reaped-children time has
    it then)."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_fleet import classify  # type: ignore[import-not-found]  # bench_fleet's kinds

        self.classify = classify
        self.root, self.interval = root, interval
        self.folder: str | None = None
        self.last: dict[int, tuple[str, int, float]] = {}  # pid -> (kind, parent, cpu incl. children)
        self.dead: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.sample()

    def sample(self) -> dict[str, float]:
        with self.lock:
            table: dict[int, tuple[int, float, str]] = {}
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                fields = _stat(int(entry.name))
                if fields is None:
                    continue
                with contextlib.suppress(OSError):
                    cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    cpu = sum(int(x) for x in fields[11:15]) / CLK_TCK
                    table[int(entry.name)] = (int(fields[1]), cpu, cmd)
            kids: dict[int, list[int]] = {}
            for pid, (ppid, _, _) in table.items():
                kids.setdefault(ppid, []).append(pid)
            todo = [self.root] if self.root in table else []
            if self.folder:
                todo += [pid for pid, (_, _, cmd) in table.items() if self.folder in cmd]
            seen: dict[int, tuple[str, int, float]] = {}
            while todo:
                pid = todo.pop()
                if pid in seen or pid not in table:
                    continue
                ppid, cpu, cmd = table[pid]
                if pid != self.root:
                    seen[pid] = (self.classify(cmd), ppid, cpu)
                todo.extend(kids.get(pid, []))
            for pid, (kind, ppid, cpu) in self.last.items():
                if pid not in seen and ppid not in seen:
                    self.dead[kind] = self.dead.get(kind, 0.0) + cpu
            self.last = seen
            out = dict(self.dead)
            for kind, _, cpu in seen.values():
                out[kind] = out.get(kind, 0.0) + cpu
            return out

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """``bench/bench_fleet.py`` for the same N, its JSON read from its output; its prelude's
    CPU (enroll, inspect, commission: ``bench_fleet`` meters only the deploy) sampled here."""
    argv = [sys.executable, "-u", str(ROOT / "bench" / "bench_fleet.py"), "--machines", str(args.machines),
            "--sites", str(args.sites), "--timeout", str(args.timeout), "--keep"]  # fmt: skip
    print("ours:", " ".join(argv[2:]), flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.stdout is not None
    sampler = TreeSampler(proc.pid)
    marks: dict[str, tuple[float, dict[str, float], int]] = {}

    def requests() -> int:
        folder = Path(sampler.folder or "/nonexistent")
        return redfish_requests(*folder.glob("sim-*/bmc/process.log"))

    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            mark = None
            if line.startswith("state under "):
                sampler.folder = line.split("state under ", 1)[1].strip()
            elif " stack up in " in line:
                mark = "start"
            elif line.startswith("enrolled in "):
                mark = "enroll"
            elif line.startswith("inspect: ") and " in " in line:
                mark = "inspect"
            elif line.startswith("commission: ") and " in " in line:
                mark = "commission"
            if mark:
                marks[mark] = (time.monotonic(), sampler.sample(), requests())
            if args.verbose or not line.startswith((" ", "{", "}")):
                print("  ours |", line.rstrip(), flush=True)
        proc.wait()
        marks["end"] = (time.monotonic(), {}, requests())
    finally:
        sampler.stop()
        if proc.poll() is None:
            proc.terminate()
        if sampler.folder and sampler.folder.startswith(tempfile.gettempdir()) and not args.keep:
            shutil.rmtree(sampler.folder, ignore_errors=True)  # bench_fleet ran with --keep for its logs
    wall = time.monotonic() - t0
    out = "".join(lines)
    start, end = out.find("\n{"), out.rfind("\n}")
    if start < 0 or end < 0:
        raise RuntimeError(f"bench_fleet exited {proc.returncode}:\n{out[-3000:]}")
    doc: dict[str, Any] = json.loads(out[start + 1 : end + 2])
    doc["script_wall_s"] = round(wall, 1)
    prelude: dict[str, dict[str, float]] = {}
    order = ["start", "enroll", "inspect", "commission"]
    for a, b in itertools.pairwise(order):
        if a in marks and b in marks:
            before, after = marks[a][1], marks[b][1]
            prelude[b] = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in after}
    doc["prelude_cpu_s"] = prelude  # per phase, per kind of process
    order.append("end")
    doc["redfish_requests"] = {
        ("deploy" if b == "end" else b): marks[b][2] - marks[a][2]
        for a, b in itertools.pairwise(order) if a in marks and b in marks
    }  # fmt: skip
    return doc


# ---- the table -----------------------------------------------------------------------------


def split(cpu: dict[str, float]) -> tuple[float, float, float]:
    """(product, simulation, other) CPU seconds of one of bench_fleet's per-kind tables."""
    product = sum(cpu.get(k, 0.0) for k in PRODUCT_KINDS)
    sim = sum(cpu.get(k, 0.0) for k in SIMULATION_KINDS)
    return product, sim, sum(cpu.values()) - product - sim


def table(ours: dict[str, Any] | None, peer: dict[str, Any] | None, n: int) -> str:
    """Both sides, one row per figure: control-plane CPU s per machine (ours: every process we
    ship, nats-server and PostgreSQL included; Ironic: its process, SQLite in it), the
    simulation's CPU s per machine, and wall time, for the deploy and for the whole lifecycle."""

    def f(v: float | None, digits: int = 3) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    o_dep = split(ours["cpu_s"]) if ours else None
    o_pre_cpu: dict[str, float] = {}
    for phase in (ours or {}).get("prelude_cpu_s", {}).values():
        for k, v in phase.items():
            o_pre_cpu[k] = o_pre_cpu.get(k, 0.0) + v
    o_pre = split(o_pre_cpu) if ours and len(ours.get("prelude_cpu_s", {})) == 3 else None
    o_pre_wall = sum(ours["prelude_s"].values()) if ours else None
    i_dep = peer["phases"]["deploy"] if peer else None
    i_all = peer["total"] if peer else None
    rows = [
        ("deploy: control plane CPU s / machine",
         f(o_dep[0] / n if o_dep else None), f(i_dep["ironic_cpu_s"] / n if i_dep else None)),
        ("deploy: simulation CPU s / machine",
         f(o_dep[1] / n if o_dep else None), f(i_dep["emulator_cpu_s"] / n if i_dep else None)),
        ("deploy: wall s",
         f(ours["deploy_s"] if ours else None, 1), f(i_dep["wall_s"] if i_dep else None, 1)),
        ("enroll..deploy: control plane CPU s / machine",
         f((o_dep[0] + o_pre[0]) / n if o_dep and o_pre else None),
         f(i_all["ironic_cpu_s"] / n if i_all else None)),
        ("enroll..deploy: simulation CPU s / machine",
         f((o_dep[1] + o_pre[1]) / n if o_dep and o_pre else None),
         f(i_all["emulator_cpu_s"] / n if i_all else None)),
        ("enroll..deploy: wall s",
         f(o_pre_wall + ours["deploy_s"] if ours and o_pre_wall is not None else None, 1),
         f(i_all["wall_s"] if i_all else None, 1)),
    ]  # fmt: skip
    o_req = (ours or {}).get("redfish_requests", {})
    rows.append(
        (
            "enroll..deploy: Redfish requests / machine",
            f(sum(o_req.values()) / n if len(o_req) == 4 else None, 1),
            f(i_all["redfish_requests"] / n if i_all else None, 1),
        )
    )
    if peer and peer.get("idle"):
        per_min = peer["idle"]["ironic_cpu_s"] / n / (peer["idle"]["seconds"] / 60)
        rows.append(
            ("at rest, all deployed: control plane CPU s / machine / minute", "(not measured)", f(per_min, 4))
        )
    o_mem = split(ours["memory_mib"])[0] if ours else None
    rows.append((
        "memory at the end: control plane MiB (PSS)",
        f(o_mem, 0), f(peer["ironic_pss_mib"] if peer else None, 0),
    ))  # fmt: skip
    if o_dep and o_pre and i_all and o_dep[0] + o_pre[0] > 0:
        ratio = i_all["ironic_cpu_s"] / (o_dep[0] + o_pre[0])
        rows.append(("Ironic / ours, control plane CPU, enroll..deploy", "", f"{ratio:.1f}x"))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'N = ' + str(n):<{w}}  {'better-compute':>14}  {'ironic':>9}", "-" * (w + 27)]
    lines += [f"{a:<{w}}  {b:>14}  {c:>9}" for a, b, c in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machines", type=int, default=10)
    p.add_argument("--sites", type=int, default=1, help="bench_fleet's sites (one emulator each)")
    p.add_argument("--concurrency", type=int, default=8, help="API calls to Ironic in flight")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each phase may take")
    p.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="then Ironic's CPU over this many s at rest (power sync: 120 s)",
    )
    p.add_argument("--ours-from", help="our side from an earlier run's --json output (a file), not run again")
    p.add_argument("--skip-ours", action="store_true", help="run only Ironic")
    p.add_argument("--skip-ironic", action="store_true", help="run only bench_fleet")
    p.add_argument("--keep", action="store_true", help="keep the state folder (Ironic's log)")
    p.add_argument("--verbose", action="store_true", help="echo all of bench_fleet's output")
    p.add_argument("--json", action="store_true", help="print both sides' figures as JSON too")
    args = p.parse_args()
    ours = peer = None
    errors: list[str] = []
    if args.ours_from:
        ours = json.loads(Path(args.ours_from).read_text())["ours"]
        print(f"ours: from {args.ours_from} (an earlier run's --json)")
    elif not args.skip_ours:
        try:
            ours = run_ours(args)
        except Exception as e:  # the table still prints the other side
            errors.append(f"ours: {e}")
    if not args.skip_ironic:
        folder = Path(tempfile.mkdtemp(prefix="bc-peer-ironic-"))
        print(f"ironic state under {folder}", flush=True)
        try:
            ensure_venv()
            peer = run_ironic(args, folder)
        except Exception as e:
            errors.append(f"ironic: {e}")
        finally:
            if not args.keep and not errors:
                shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps({"ours": ours, "ironic": peer}, indent=2))
    print()
    if ours:
        print(
            f"ours: bench_fleet {args.machines} machines / {args.sites} site(s); CPU s by kind of process,"
            " deploy (bench_fleet's own meter):",
            json.dumps(ours["cpu_s"]),
        )
        for phase, cpu in ours.get("prelude_cpu_s", {}).items():
            print(f"  {phase} (sampled here):", json.dumps({k: v for k, v in cpu.items() if v}))
        print("  walls:", json.dumps({**ours["prelude_s"], "deploy": ours["deploy_s"]}))
        print("  Redfish requests:", json.dumps(ours.get("redfish_requests", {})))
    if peer:
        print(f"ironic {peer['ironic']} (sushy {peer['sushy']}): per phase", json.dumps(peer["phases"]))
        print(
            f"  ports made by inspection {peer['ports_made_by_inspection']},"
            f" powered on at the end {peer['powered_on_at_the_end']}, PSS {peer['ironic_pss_mib']} MiB"
        )
    print(table(ours, peer, args.machines))
    for err in errors:
        print("FAILED", err, file=sys.stderr)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
