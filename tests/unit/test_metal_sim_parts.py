"""The simulator's parts without servers: seeded identities and faults, the ledger, bcd's
simulation mode (disk writes counted and failed below bcd's code, programs recorded), and the
TCP gate."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from bcd.simulation import SimRunner
from better_compute.testing.machines import DiskSpec, prepare_machine
from better_compute.testing.metal_sim import FaultFractions, Ledger, TcpGate
from better_compute.testing.metal_sim.hardware import identity

pytestmark = pytest.mark.unit


def test_identities_are_unique_and_stable_per_seed() -> None:
    def fleet(seed: int) -> list[tuple[str, str, tuple[str, ...]]]:
        rng = random.Random(seed)
        return [identity(rng, seed, i) for i in range(600)]

    a = fleet(3)
    assert a == fleet(3)
    assert len({u for u, _, _ in a}) == len({s for _, s, _ in a}) == 600
    assert len({mac for _, _, macs in a for mac in macs}) == 1200
    assert {u for u, _, _ in a}.isdisjoint(u for u, _, _ in fleet(4))


def test_fault_fractions_are_drawn_with_the_seed() -> None:
    plan = FaultFractions(never_boots=0.25, fail_writes=0.5)
    draws = [plan.draw(random.Random(9), "vda") for _ in range(2)]
    assert draws[0] == draws[1]
    rng = random.Random(1)
    many = [plan.draw(rng, "vda") for _ in range(400)]
    assert 60 < sum(f.never_boots for f in many) < 140
    assert 150 < sum(f.fail_writes == ("vda",) for f in many) < 250
    assert not any(f.bmc_proxy or f.flaky_link or f.power_delay for f in many)


def test_the_ledger_counts_and_skips_a_torn_line(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.jsonl")
    assert ledger.events() == []
    ledger.append("power", to="On")
    ledger.append("disk.write", disk="vda", kind="node.wipe")
    assert ledger.count("power") == 1
    assert ledger.count("disk.write", disk="vda", kind="node.wipe") == 1
    assert ledger.count("disk.write", kind="node.imageWrite") == 0
    assert ledger.counts() == {"power:On": 1, "disk.write:vda:node.wipe": 1}
    assert ledger.repeated_writes() == {}
    ledger.append("disk.write", disk="vda", kind="node.imageWrite", commandId="cmd_a")
    ledger.append("disk.write", disk="vda", kind="node.imageWrite", commandId="cmd_a")
    assert ledger.repeated_writes() == {"cmd_a": 2}
    with open(ledger.path, "a") as fh:
        fh.write('{"event": "pow')  # a line being written right now
    assert ledger.count("power") == 1


_WIPE = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from bcd.disks import wipe
    from bcd.simulation import install_disk_hook, tagged
    from bcd.system import Machine
    from better_compute.agent import Command

    machine = Machine(root=Path(sys.argv[1]))
    install_disk_hook(machine, ledger=sys.argv[2], faults=sys.argv[3])

    async def handler(cmd):
        return await asyncio.to_thread(wipe, machine, disks=["/dev/vda"], mode="quick")

    class Cmd:
        kind, id = "node.wipe", "cmd_1"

    try:
        asyncio.run(tagged({"node.wipe": handler})["node.wipe"](Cmd()))
        print("ok")
    except OSError as exc:
        print("oserror", exc.errno)
    open(str(Path(sys.argv[1]) / "etc/hostname"), "w").write("not a disk\\n")
    """
)


def test_simulated_disk_writes_are_counted_below_bcd_and_fail_when_told(tmp_path: Path) -> None:
    root = prepare_machine(tmp_path / "tree", disks=(DiskSpec("vda"),))
    ledger, faults = tmp_path / "ledger.jsonl", tmp_path / "faults.json"
    faults.write_text(json.dumps({"failWrites": []}))

    def run() -> str:
        done = subprocess.run(
            [sys.executable, "-c", _WIPE, str(root), str(ledger), str(faults)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    assert run() == "ok"
    faults.write_text(json.dumps({"failWrites": ["vda"]}))
    assert run() == "oserror 5"
    events = Ledger(ledger).events()
    assert [(e["event"], e["disk"], e["kind"], e["commandId"], e["failed"]) for e in events] == [
        ("disk.write", "vda", "node.wipe", "cmd_1", False),
        ("disk.write", "vda", "node.wipe", "cmd_1", True),
    ]  # and /etc/hostname, written too, is no disk


def test_a_simulated_machine_records_programs_instead_of_running_them(tmp_path: Path) -> None:
    runner = SimRunner(tmp_path, programs=("sysctl",))
    assert runner.which("sysctl") == "/usr/bin/sysctl"
    assert runner.which("rm") is None
    assert runner.run(["sysctl", "-p", "/etc/sysctl.d/90-bc.conf"]).returncode == 0
    lines = [json.loads(line) for line in runner.log.read_text().splitlines()]
    assert [d["argv"] for d in lines] == [["sysctl", "-p", "/etc/sysctl.d/90-bc.conf"]]


def test_a_cut_gate_drops_connections_and_refuses_until_it_ends() -> None:
    upstream = socket.create_server(("127.0.0.1", 0))
    port = upstream.getsockname()[1]

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(100):
                    conn.sendall(data)
            except OSError:
                pass

    def echo() -> None:
        while True:
            try:
                conn, _ = upstream.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    gate = TcpGate(f"nats://127.0.0.1:{port}").start()
    try:
        assert gate.url.startswith("nats://127.0.0.1:")
        with socket.create_connection(("127.0.0.1", gate.port), timeout=5) as client:
            client.sendall(b"ping")
            assert client.recv(100) == b"ping"
            gate.cut(60)
            assert client.recv(100) == b""  # dropped
        with socket.create_connection(("127.0.0.1", gate.port), timeout=5) as client:
            assert client.recv(100) == b""  # refused while cut
        gate.heal()
        with socket.create_connection(("127.0.0.1", gate.port), timeout=5) as client:
            client.sendall(b"back")
            assert client.recv(100) == b"back"
        assert gate.cuts == 1
    finally:
        gate.close()
        upstream.close()


def test_the_emulators_memory_store_keeps_each_machines_state_apart() -> None:
    # sushy-tools' virtual media driver gives every system the same default device dict; its
    # SQLite store copied values, so a memory store must too, or one machine's inserted
    # medium shows in (and an eject clears) every other's
    from better_compute.testing.metal_sim.emulator_main import _MemoryStore

    store = _MemoryStore()
    store.make_permanent("/nowhere", "vmedia-test")
    default = {"Inserted": False}
    store.update({("m1", "Cd"): default, ("m2", "Cd"): default})
    first = store[("m1", "Cd")]
    first["Inserted"] = True
    store.update({("m1", "Cd"): first})
    assert store[("m2", "Cd")] == {"Inserted": False}
    assert store[("m1", "Cd")] == {"Inserted": True}
    shared = _MemoryStore()
    shared.make_permanent("/nowhere", "vmedia-test")  # another driver instance, the same store
    assert shared[("m1", "Cd")] == {"Inserted": True}


def test_the_fork_server_runs_each_bcd_as_a_process_of_its_own(tmp_path: Path) -> None:
    import os
    import signal

    from better_compute.testing.metal_sim.zygote import BcdZygote

    root = prepare_machine(tmp_path / "tree", product_uuid="4c4c4544-0000-1111-2222-333344445555")
    env = {**os.environ, "BCD_ROOT": str(root)}
    zygote = BcdZygote(str(tmp_path / "server.log"))
    try:
        # the arguments `python -m bcd` would get, with this environment and this log file
        assert zygote.run(["claims"], env=env, log=str(tmp_path / "claims.log")) == 0
        claims = json.loads((tmp_path / "claims.log").read_text().splitlines()[-1])
        assert claims["productUuid"] == "4c4c4544-0000-1111-2222-333344445555"
        # its exit code: a join without a token fails
        assert zygote.run(["join", "--control-plane", "nats://127.0.0.1:9"], env=env,
                          log=str(tmp_path / "join.log")) == 1  # fmt: skip
        assert "no join token" in (tmp_path / "join.log").read_text()
        # a pid of its own, which SIGKILL ends (a pulled plug)
        run = zygote.spawn(["run", "--mode", "ramdisk"], env=env, log=str(tmp_path / "run.log"))
        assert run.pid not in (os.getpid(), zygote.proc.pid)
        run.send_signal(signal.SIGKILL)
        assert run.wait(30) in (-signal.SIGKILL, 1)  # killed, or it had already found no enrollment
    finally:
        zygote.close()


def test_the_simulated_installer_runs_late_commands_as_sh_would(tmp_path: Path) -> None:
    """The new system at /target has no /etc/bcd: a document that writes there without making
    it first fails, as Subiquity's sh would (it did not, before: the simulator made folders)."""
    from better_compute.provision import render_template
    from better_compute.testing.metal_sim.app import AUTOINSTALL_TEMPLATE
    from better_compute.testing.metal_sim.fleet import MetalSim, _late_commands
    from better_compute.testing.metal_sim.hardware import Faults, SimMachine

    m = SimMachine(
        index=0, name="m0", uuid="u", serial="s", macs=(), folder=tmp_path, disks=("vda",), faults=Faults()
    )
    m.tree.mkdir()
    old = (
        "#cloud-config\nautoinstall:\n  version: 1\n"
        "  late-commands:\n    - echo bcjt_x > /target/etc/bcd/join-token\n"
    )
    [command] = _late_commands(old)
    assert (
        MetalSim._late_command(m, command)
        == "cannot create /target/etc/bcd/join-token: Directory nonexistent"
    )

    doc = render_template(AUTOINSTALL_TEMPLATE, {"hostname": "h", "joinToken": "bcjt_y"})
    commands = _late_commands(doc)
    assert len(commands) == 3
    assert [MetalSim._late_command(m, c) for c in commands] == [None, None, None]
    token = m.tree / "etc/bcd/join-token"
    assert token.read_text() == "bcjt_y\n"
    assert token.stat().st_mode & 0o777 == 0o600


def test_the_lean_host_runs_many_machines_as_tasks_and_reports_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25 item 3: many machines' bcds in one lean host, each waited for on its own (a pulled
    plug ends each with SIGKILL's code), and the host's memory report on SIGUSR1."""
    import os
    import signal
    import time

    from better_compute.testing.metal_sim.zygote import LeanBcdHost

    root = prepare_machine(tmp_path / "tree", product_uuid="4c4c4544-0000-1111-2222-333344445555")
    (root / "etc/bcd").mkdir(parents=True, exist_ok=True)
    (root / "etc/bcd/join-token").write_text("not-a-real-token\n")  # under the machine's root
    monkeypatch.setenv("BC_SIM_LEAN_MEMORY", str(tmp_path / "memory"))
    env = {**os.environ, "BCD_ROOT": str(root)}
    host = LeanBcdHost(str(tmp_path / "host.log"))
    try:
        # joins to a NATS that is not there: each machine waits and tries again, for a while
        join = ["join", "--no-service", "--token-file", "/etc/bcd/join-token",
                "--control-plane", "nats://127.0.0.1:9"]  # fmt: skip
        procs = [host.spawn(join, env=env, log=str(tmp_path / "join.log")) for _ in range(20)]
        assert len({p.pid for p in procs}) == 20
        assert all(p.poll() is None for p in procs)
        host.proc.send_signal(signal.SIGUSR1)
        report = tmp_path / "memory" / f"lean-{host.proc.pid}-1.txt"
        deadline = time.monotonic() + 30
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        first = report.read_text().splitlines()[0]
        assert first.startswith("machines 20 ")
        assert "rss_kib_per_machine" in first
        waiters = [threading.Thread(target=p.wait, args=(30,)) for p in procs]
        for w in waiters:
            w.start()
        for p in procs:
            p.kill()
        for w in waiters:
            w.join(30)
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 20
    finally:
        host.close()
