"""``MetalSim``: N simulated machines behind one real Redfish endpoint (sushy-emulator's fake
driver), each booting a real ``bcd`` process when it powers on from the network or a medium.

The emulator PUTs a system's whole state to our notifier on every change; that is how the
simulator sees power land, the boot override and inserted media. A power-on that lands with
a ``Pxe`` override network-boots: the simulator asks the site agent's HTTP for ``/boot.ipxe``
and the MAC's entry, as iPXE would, and takes the kernel command line of the entry it gets
(``bcd.token=… bcd.control_plane=…``). A ``Cd`` override with a medium inserted boots the
medium: its first KiB, when it is a command line with ``bcd.`` settings, stands for the ISO's
boot command line. Either boots a ramdisk: bcd (``--simulate``) joins with the token of that
command line (or, with ``bcd.token_from=media``, of the virtual CD the BMC holds, which the
ramdisk sees as ``/dev/sr0``) and serves in ramdisk mode. Power off kills that bcd (a pulled plug) and the
ramdisk's state is gone.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...config import Settings
from ..bcd import bcd_env
from ..bmcs import FaultyProxy
from ..machines import DiskSpec, prepare_machine
from .emulator import FleetEmulator, notifier_server
from .gate import TcpGate
from .hardware import FaultFractions, Faults, SimMachine, identity
from .nocloud import OS_MARK, apply_write_files, config_drive, has_os
from .zygote import BcdZygote, LeanBcdHost

__all__ = ["MetalSim"]

_CHAIN = re.compile(r"^chain\s+(?:--\S+\s+)*(\S+)", re.M)
_KERNEL = re.compile(r"^kernel\s+\S+\s*(.*)$", re.M)
_LATE_COMMANDS = re.compile(r"^  late-commands:\n((?:    - .*\n?)+)", re.M)
_ECHO = re.compile(r"^echo\s+(\S+)\s*>\s*/target(/\S+)$")
_MKDIR = re.compile(r"^mkdir\s+-p\s+/target(/\S+)$")
_CHMOD = re.compile(r"^chmod\s+([0-7]{3,4})\s+/target(/\S+)$")
_OS_MARK = OS_MARK  # what the simulated installer writes at the start of the disk
_JOIN_BOUND_S = 3660.0
"""A simulated machine's ``bcd join`` ends by this: bcd's own wait for bc-pki (``bcd join --wait``,
3600 s by default) and a minute more."""
OS_STATE = "/var/lib/bcd-os"
"""The installed OS's bcd state folder (under the machine's root): on its disk, so it survives
a power cycle (the ramdisk's ``/var/lib/bcd`` does not) and goes with a wipe."""


class MetalSim:
    """The fleet. ``start()`` it, give it the site agent's URL (``boot_url``), ``close()`` it."""

    def __init__(
        self,
        folder: Path,
        *,
        settings: Settings,
        machines: int = 1,
        site_id: str = "lab1",
        seed: int = 0,
        power_delay: tuple[float, float] = (1.0, 11.0),
        faults: Mapping[int, Faults] | None = None,
        fractions: FaultFractions | None = None,
        disks: Sequence[DiskSpec] = (DiskSpec("vda", 32 << 20),),
        boot_url: str | None = None,
        fork_server: bool = True,
        supervise_bcd: bool = False,
        lean: bool | None = None,
    ) -> None:
        self.folder = folder
        self.lean = os.environ.get("BC_SIM_LEAN") == "1" if lean is None else lean
        """Every bcd an asyncio task of one host process (``bcd.lean``), not a process of its own:
        the simulation for scale (``BC_SIM_LEAN=1`` by default). The chaos tests keep processes."""
        self.supervise_bcd = supervise_bcd
        """Start a machine's bcd again when it dies while the machine stays on (systemd's
        ``Restart=always`` in the ramdisk); the ledger says ``bcd.exited`` and ``bcd.restarted``."""
        self.bcd_env: dict[str, str] = {}
        """More environment for every bcd started from now on (``BC_KILL_AT``…)."""
        self.settings = settings
        self.site_id = site_id
        self.seed = seed
        self.power_delay = power_delay
        self.boot_url = boot_url
        self.emulator = FleetEmulator(folder / "bmc")
        self._lock = threading.Lock()
        self._gates: list[TcpGate] = []
        rng = random.Random(seed)
        self.machines: list[SimMachine] = []
        for i in range(machines):
            product_uuid, serial, macs = identity(rng, seed, i)
            drawn = (fractions or FaultFractions()).draw(rng, disks[0].name)
            m = SimMachine(
                index=i,
                name=f"{site_id}-m{i:03d}",
                uuid=product_uuid,
                serial=serial,
                macs=macs,
                folder=folder / f"m{i:03d}",
                disks=tuple(d.name for d in disks),
                faults=(faults or {}).get(i, drawn),
            )
            prepare_machine(m.tree, product_uuid=product_uuid, serial=serial, macs=macs, disks=disks,
                            hostname=m.name)  # fmt: skip
            m.fail_writes(*m.faults.fail_writes)
            self.machines.append(m)
        self._by_uuid = {m.uuid: m for m in self.machines}
        if self.lean and any(m.faults.flaky_link for m in self.machines):
            raise ValueError("flaky_link needs a bcd process per machine (its own NATS URL): not lean")
        self._server: http.server.ThreadingHTTPServer | None = None
        self.fork_server = fork_server
        self.zygote: BcdZygote | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> MetalSim:
        if self.lean:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.zygote = LeanBcdHost(str(self.folder / "bcd-lean.log"))
        elif self.fork_server:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.zygote = BcdZygote(str(self.folder / "bcd-fork-server.log"))
        self._server = notifier_server(self._on_state)
        threading.Thread(target=self._server.serve_forever, name="metal-sim-notifier", daemon=True).start()
        self.write_power_delays()
        self.emulator.start(
            self.machines, notifier=f"http://127.0.0.1:{self._server.server_address[1]}/notify"
        )
        for m in self.machines:
            m.bmc_url = self.emulator.url
            if m.faults.bmc_proxy:
                m.proxy = FaultyProxy(m.folder / "bmc-proxy", self.emulator.url).start()
                m.bmc_url = m.proxy.url
            if m.faults.flaky_link:
                m.gate = self.nats_gate()
        return self

    def close(self) -> None:
        for m in self.machines:
            m.generation += 1
            self._stop_bcd(m, "sim-closed")
            if m.proxy is not None:
                m.proxy.close()
        for gate in self._gates:
            gate.close()
        self.emulator.close()
        if self.zygote is not None:
            self.zygote.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> MetalSim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def nats_gate(self) -> TcpGate:
        """A cuttable link to this test's nats-server (for a site agent cut off from NATS)."""
        gate = TcpGate(self.settings.nats_url or "").start()
        self._gates.append(gate)
        return gate

    def write_power_delays(self) -> None:
        """Tell the emulator each machine's power delay (re-read on every power change)."""
        doc: dict[str, Any] = {"default": list(self.power_delay)}
        for m in self.machines:
            if m.faults.power_delay is not None:
                doc[m.uuid] = list(m.faults.power_delay)
        self.emulator.delays_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.emulator.delays_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.emulator.delays_file)

    def machine(self, key: int | str) -> SimMachine:
        """By index, product UUID or name."""
        if isinstance(key, int):
            return self.machines[key]
        found = self._by_uuid.get(key) or next((m for m in self.machines if m.name == key), None)
        if found is None:
            raise KeyError(key)
        return found

    # -- what the BMC tells us ------------------------------------------------------------

    def _on_state(self, doc: dict[str, Any]) -> None:
        m = self._by_uuid.get(str(doc.get("uuid")))
        if m is None:
            return
        boot_now = False
        with self._lock:
            seq = doc.get("sim_seq")
            if isinstance(seq, int):
                if seq <= m.state_seq:  # sent before one already applied: the BMC moved on
                    return
                m.state_seq = seq
            pending = doc.get("pending_power") or None
            if pending and pending.get("apply_time") != m.pending_apply:
                m.pending_apply = pending.get("apply_time")
                m.ledger.append("power.requested", to=pending.get("power_state"))
                wait = max(0.0, float(pending.get("apply_time", 0)) - time.time()) + 0.05
                threading.Timer(wait, self.emulator.read_system, args=(m.uuid,)).start()
            if not pending:
                m.pending_apply = None
            if doc.get("boot_device", "Hdd") != m.boot_device:
                m.boot_device = str(doc.get("boot_device", "Hdd"))
                m.ledger.append("boot.device", device=m.boot_device)
            media = {dev: bool(info and info[2]) for dev, info in (doc.get("boot_image") or {}).items()}
            for dev, inserted in media.items():
                if inserted != bool(m.media.get(dev)):
                    m.ledger.append("media.insert" if inserted else "media.eject", device=dev)
            m.media = {dev: (doc.get("boot_image") or {}).get(dev) if media[dev] else None for dev in media}
            power = str(doc.get("power_state", "Off"))
            if power != m.power:
                m.ledger.append("power", to=power)
                m.power = power
                m.generation += 1
                if power == "On":
                    boot_now = True
                else:
                    self._stop_bcd(m, "power-off")
            generation = m.generation
        if boot_now:
            threading.Thread(target=self._boot, args=(m, generation), daemon=True).start()

    # -- booting ---------------------------------------------------------------------------

    def _boot(self, m: SimMachine, generation: int) -> None:
        m.boots += 1
        if m.faults.never_boots:
            m.ledger.append("boot.none", reason="never-boots")
            return
        cmdline: str | None = None
        if m.boot_device == "Pxe":
            cmdline = self._netboot(m)
        elif m.boot_device == "Cd" and m.media.get("Cd"):
            autoinstall = _media_autoinstall(m.media["Cd"])
            if autoinstall is not None:
                m.ledger.append("boot.media", device="Cd", bootable=True, kind="autoinstall")
                self._autoinstall(m, generation, autoinstall)
                return
            cmdline = _media_cmdline(m.media["Cd"])
            m.ledger.append("boot.media", device="Cd", bootable=cmdline is not None)
        if cmdline is None:
            self._local_boot(m, generation)
            return
        self._ramdisk(m, generation, cmdline)

    # -- the installed OS --------------------------------------------------------------------

    def _autoinstall(self, m: SimMachine, generation: int, document: str) -> None:
        """What Ubuntu's installer does with an autoinstall document: write the OS to the first
        disk, run its ``late-commands`` against the new system at ``/target`` (this simulator
        knows ``mkdir -p``, ``echo VALUE > PATH`` and ``chmod MODE PATH``), and reboot into the
        installed OS. The new system has no ``/etc/bcd`` until a command makes it: an ``echo``
        into a folder nobody made fails the install as ``sh`` would (ledger ``install.failed``),
        and the machine sits in the installer."""
        disk = m.disks[0]
        try:
            with open(m.disk(disk), "r+b") as fh:
                fh.write(_OS_MARK + b"ubuntu-24.04\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            m.ledger.append("disk.write", disk=disk, kind="autoinstall", failed=True, error=exc.strerror)
            return
        m.ledger.append("disk.write", disk=disk, kind="autoinstall", failed=False)
        shutil.rmtree(m.tree / OS_STATE.lstrip("/"), ignore_errors=True)  # a fresh OS: no enrollment
        shutil.rmtree(m.tree / "etc/bcd", ignore_errors=True)  # nor any of the ramdisk's /etc/bcd
        for index, command in enumerate(_late_commands(document)):
            failure = self._late_command(m, command)
            if failure is not None:  # the token (an echo's value) never goes into the ledger
                m.ledger.append("install.failed", disk=disk, lateCommand=index, error=failure)
                return
        m.ledger.append("install", disk=disk)
        self._installed(m, generation)

    @staticmethod
    def _late_command(m: SimMachine, command: str) -> str | None:
        """Run one late-command against the machine's tree as ``/target``; why it failed."""
        if found := _MKDIR.match(command):
            (m.tree / found.group(1).lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif found := _ECHO.match(command):
            path = m.tree / found.group(2).lstrip("/")
            if not path.parent.is_dir():
                return f"cannot create /target{found.group(2)}: Directory nonexistent"
            with open(path, "w") as fh:
                fh.write(found.group(1) + "\n")
        elif found := _CHMOD.match(command):
            path = m.tree / found.group(2).lstrip("/")
            if not path.exists():
                return f"chmod: cannot access /target{found.group(2)}: No such file or directory"
            path.chmod(int(found.group(1), 8))
        else:
            return "a late-command this simulator does not run (mkdir -p, echo > PATH, chmod)"
        return None

    def _local_boot(self, m: SimMachine, generation: int) -> None:
        """Boot the first disk: the installed OS when one is there, else nothing (a prompt).

        An OS from an image bcd wrote reads its NoCloud config drive as cloud-init does."""
        if not has_os(m.disk()):
            shutil.rmtree(m.tree / OS_STATE.lstrip("/"), ignore_errors=True)  # wiped with its disk
            m.ledger.append("boot.local", device=m.boot_device, os=False)
            return
        m.ledger.append("boot.local", device=m.boot_device, os=True)
        self._cloud_init(m)
        self._installed(m, generation)

    def _cloud_init(self, m: SimMachine) -> None:
        """cloud-init's NoCloud datasource: the ``cidata`` partition's ``user-data``, once per
        instance. A new instance (another deploy's user data) is a freshly written OS: the bcd
        state of the one before is gone with it, and ``write_files`` runs (the join token into
        ``/etc/bcd/join-token``; the template's ``runcmd`` installs and joins bcd, which the
        installed OS below does with that token)."""
        files = config_drive(m.disk())
        if files is None or "user-data" not in files:
            m.ledger.append("cloud-init", datasource=None)
            return
        instance = hashlib.sha256(files["user-data"] + files.get("meta-data", b"")).hexdigest()
        seen = m.tree / "var/lib/cloud/instance-id"
        if seen.exists() and seen.read_text() == instance:
            m.ledger.append("cloud-init", datasource="NoCloud", new_instance=False)
            return
        shutil.rmtree(m.tree / OS_STATE.lstrip("/"), ignore_errors=True)
        written = apply_write_files(files["user-data"], m.tree)
        seen.parent.mkdir(parents=True, exist_ok=True)
        seen.write_text(instance)
        meta = files.get("meta-data", b"").decode(errors="replace")
        m.ledger.append("cloud-init", datasource="NoCloud", new_instance=True, files=written, meta_data=meta)

    def _installed(self, m: SimMachine, generation: int) -> None:
        """The installed OS's bcd: it joins with ``/etc/bcd/join-token`` on its first boot (the
        token the user data carried), then serves in installed mode; its state is on the disk
        (``OS_STATE``), so later boots reuse the enrollment."""
        (m.tree / "etc/bcd/ramdisk").unlink(missing_ok=True)
        (m.tree / "proc/cmdline").write_text(f"console=ttyS0 root=/dev/{m.disks[0]}1\n")
        env = self._bcd_env(m)
        log = m.folder / f"bcd-{m.boots:03d}.log"
        state = ["--state-dir", OS_STATE]
        if not (m.tree / OS_STATE.lstrip("/") / "enrollment.json").exists():
            token = m.tree / "etc/bcd/join-token"
            if not token.exists():
                m.ledger.append("bcd.join-failed", mode="installed", reason="no-token")
                return
            args = [*state, "join", "--no-service", "--token-file", "/etc/bcd/join-token",
                    "--control-plane", env["BC_NATS_URL"]]  # fmt: skip
            returncode = self._bcd_once(m, generation, args, env, log)
            if returncode != 0:
                m.ledger.append("bcd.join-failed", mode="installed", returncode=returncode)
                return
        self._run_bcd(m, generation, env, log, [*state, "run", "--mode", "installed"], mode="installed")

    def _bcd_env(self, m: SimMachine) -> dict[str, str]:
        return bcd_env(
            self.settings,
            m.tree,
            {
                "BCD_SIMULATE": "1",
                "BCD_SIM_LEDGER": str(m.ledger.path),
                "BCD_SIM_FAULTS": str(m.faults_file),
                **({"BC_NATS_URL": m.gate.url} if m.gate is not None else {}),
                **self.bcd_env,
            },
        )

    def _run_bcd(
        self, m: SimMachine, generation: int, env: dict[str, str], log: Path, args: list[str], *, mode: str
    ) -> None:
        with self._lock:
            if m.generation != generation:
                return  # powered off meanwhile
            if self.zygote is not None:
                m.bcd = self.zygote.spawn(args, env=env, log=str(log))
            else:
                with open(log, "ab") as out:
                    m.bcd = subprocess.Popen(
                        [sys.executable, "-m", "bcd", *args],
                        env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    )  # fmt: skip
            m.ledger.append("bcd.started", mode=mode, pid=m.bcd.pid)

    def _bcd_once(
        self, m: SimMachine, generation: int, args: list[str], env: dict[str, str], log: Path
    ) -> int:
        """Run one bcd command (``join``) to its end; its exit code. A join waits as long as bcd's
        own ``--wait`` while no bc-pki answers (its site cut off from the hub), so the bound is
        that, and the machine's power going off (a new generation) ends it as it would."""
        if self.zygote is not None:
            proc: Any = self.zygote.spawn(args, env=env, log=str(log))
        else:
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "bcd", *args],
                    env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )  # fmt: skip
        # a power-off kills it (``_stop_bcd``), so this waits for its end alone: no look every
        # second from each of a thousand machines' joins
        with self._lock:
            m.joining = proc
            powered_off = m.generation != generation
        if powered_off:
            proc.kill()
        try:
            return int(proc.wait(_JOIN_BOUND_S))
        except subprocess.TimeoutExpired:
            proc.kill()
            return int(proc.wait(10))
        finally:
            with self._lock:
                if m.joining is proc:
                    m.joining = None

    def _netboot(self, m: SimMachine) -> str | None:
        if not self.boot_url:
            m.ledger.append("boot.network", served="none", reason="no-boot-server")
            return None
        try:
            first = _get(self.boot_url + "/boot.ipxe")
            found = _CHAIN.search(first)
            mac = m.macs[0].replace(":", "-")
            target = (found.group(1) if found else "").replace("${net0/mac:hexhyp}", mac)
            for _ in range(max(1, m.faults.netboot_asks)):
                script = _get(f"{self.boot_url}/{target.lstrip('/')}")
        except (OSError, urllib.error.URLError) as exc:
            m.ledger.append("boot.network", served="none", reason=type(exc).__name__)
            return None
        kernel = _KERNEL.search(script)
        m.ledger.append(
            "boot.network", served="kernel" if kernel else "exit", asks=max(1, m.faults.netboot_asks)
        )
        return kernel.group(1).strip() if kernel else None

    def _ramdisk(self, m: SimMachine, generation: int, cmdline: str) -> None:
        shutil.rmtree(m.tree / "var/lib/bcd", ignore_errors=True)  # a ramdisk starts empty
        (m.tree / "etc/bcd").mkdir(parents=True, exist_ok=True)
        (m.tree / "etc/bcd/ramdisk").touch()
        # next to QEMU VMs (the VM lab) the entries name the control plane as user-mode guests
        # reach this machine's loopback; a simulated machine sits on that network too
        cmdline = cmdline.replace("://10.0.2.2:", "://127.0.0.1:")
        (m.tree / "proc/cmdline").write_text(f"console=ttyS0 {cmdline}\n")
        settings = {w.partition("=")[0] for w in cmdline.split()}
        if "bcd.token_from=media" in cmdline.split():
            self._virtual_cd(m)  # what bcd reads its token from
        env = self._bcd_env(m)
        extra = [] if "bcd.control_plane" in settings else ["--control-plane", env["BC_NATS_URL"]]
        log = m.folder / f"bcd-{m.boots:03d}.log"
        returncode = self._bcd_once(m, generation, ["join", "--no-service", *extra], env, log)
        if returncode != 0:
            m.ledger.append("bcd.join-failed", returncode=returncode)
            return
        self._run_bcd(m, generation, env, log, ["run", "--mode", "ramdisk"], mode="ramdisk")
        if self.supervise_bcd:
            threading.Thread(target=self._supervise, args=(m, generation, env, log), daemon=True).start()

    @staticmethod
    def _virtual_cd(m: SimMachine) -> None:
        """The medium the BMC holds in its virtual CD (the file sushy-emulator downloaded from
        the URL it was given) is the machine's ``/dev/sr0``, as a BMC's USB CD shows it."""
        sr0 = m.tree / "dev/sr0"
        info = m.media.get("Cd")
        path = info[0] if isinstance(info, list | tuple) and info else None
        sr0.unlink(missing_ok=True)
        if path and Path(str(path)).is_file():
            sr0.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(str(path), sr0)
            m.ledger.append("media.visible", device="Cd")

    def _supervise(self, m: SimMachine, generation: int, env: dict[str, str], log: Path) -> None:
        """Restart the machine's ramdisk bcd each time it dies while the machine stays on."""
        while True:
            with self._lock:
                proc = m.bcd
            if proc is None or m.generation != generation:
                return
            code = proc.wait()
            time.sleep(0.2)  # systemd's RestartSec, short
            with self._lock:
                if m.bcd is not proc or m.generation != generation:
                    return  # powered off (or the simulator closed): nothing to restart
                m.ledger.append("bcd.exited", pid=proc.pid, returncode=code)
            self._run_bcd(m, generation, env, log, ["run", "--mode", "ramdisk"], mode="ramdisk")
            with self._lock:
                if m.bcd is not None and m.bcd is not proc:
                    m.ledger.append("bcd.restarted", mode="ramdisk", pid=m.bcd.pid)

    def _stop_bcd(self, m: SimMachine, why: str) -> None:
        if m.joining is not None and m.joining.poll() is None:
            m.joining.send_signal(signal.SIGKILL)  # its waiter sees it end (``_bcd_once``)
        proc, m.bcd = m.bcd, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # power off: no shutdown, no goodbye
            proc.wait(10)
        m.ledger.append("bcd.stopped", reason=why, pid=proc.pid)
        shutil.rmtree(m.tree / "var/lib/bcd", ignore_errors=True)

    def kill_bcd(self, key: int | str) -> None:
        """SIGKILL a machine's bcd while the machine stays on (a crash, not a power off)."""
        m = self.machine(key)
        if m.bcd is not None and m.bcd.poll() is None:
            m.bcd.send_signal(signal.SIGKILL)
            m.bcd.wait(10)
            m.ledger.append("bcd.killed", pid=m.bcd.pid)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode("utf-8", "replace")
        return text


def _media_autoinstall(info: Any) -> str | None:
    """The medium's autoinstall document (``#cloud-config`` with ``autoinstall:``), if it is one."""
    path = info[0] if isinstance(info, list | tuple) and info else None
    if not path:
        return None
    try:
        text = Path(str(path)).read_bytes()[:65536].decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.startswith("#cloud-config") and "\nautoinstall:" in text else None


def _late_commands(document: str) -> list[str]:
    """The ``late-commands`` of an autoinstall document, in order (plain strings)."""
    found = _LATE_COMMANDS.search(document)
    if found is None:
        return []
    return [line.strip()[2:].strip() for line in found.group(1).splitlines() if line.strip()]


def _media_cmdline(info: Any) -> str | None:
    path = info[0] if isinstance(info, list | tuple) and info else None
    if not path:
        return None
    try:
        head = Path(str(path)).read_bytes()[:1024].decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    words = head.split()
    return " ".join(words) if any(w.startswith("bcd.") for w in words) else None
