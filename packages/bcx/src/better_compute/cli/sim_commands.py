"""``bcx sim up|down|status``: the metal simulator and a real site agent for one site, against the
running stack (``bcx dev up``), as background processes under the state directory.

``up`` starts ``bc-site-agent`` for the site (joined with a fresh single-use site token, its
network boot on, discovery on with a discovery token unless ``--no-discovery``) and the simulator
(``python -m better_compute.testing.metal_sim.serve``: sushy-emulator holding every machine,
booting a ``bcd --simulate`` when one powers on from the network). It prints the machines (name,
MAC, BMC URL) and enrolls nothing unless ``--enroll`` is given; then the first ``--machines`` are
enrolled as nodes with their Redfish BMC and the BMC credential as each node's standing secret.
``--unenrolled K`` adds K machines nobody enrolls, switched on from the network: with discovery
on they show up as ``discovered`` nodes.

Both processes are recorded in ``<state>/procs`` like the services ``bcx dev up`` starts, so
``bcx dev down`` stops them too. The BMC credential is in ``<state>/sim/<site>/bmc.json`` (mode
0600); nothing here prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from ..clients import CommandQueueClient, EngineClient, PkiClient, SecretsClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..core.ids import new_id
from ..core.names import NODE_NAME_PATTERN, parse_name
from ..files import atomic_write
from ..logging import register_secret
from ..metal.lifecycle import parse_bmc_url
from ..runtime.dev import DevStack, ProcRecord, log_tail
from ..runtime.embedded import free_port, pid_alive, spawn_detached, stop_pid
from ..runtime.urls import resolve_nats_url
from ..wire.codec import convert
from ..wire.metal import NodeBmc
from .common import api_client, parse_labels
from .output import print_json, print_table

__all__ = ["register"]

SIM_MODULE = "better_compute.testing.metal_sim.serve"
MACHINES_FILE = "machines.json"
NODES_FILE = "nodes.json"


def _say(quiet: bool) -> Callable[[str], None]:
    return (lambda _m: None) if quiet else (lambda m: print(m, flush=True))


def _site_folder(stack: DevStack, site: str) -> Path:
    return stack.state / "sim" / site


def _media_server(stack: DevStack, sim_name: str) -> str | None:
    """The site whose simulator runs and serves ``BC_SIM_MEDIA_DIR`` at ``BC_SIM_MEDIA_URL``
    already (a second site in the same shell shares it), or None."""
    for rec in stack.records():
        site = rec.name.removeprefix("sim-")
        serves = (_site_folder(stack, site) / "media-served").exists()
        if rec.service == "metal-sim" and rec.name != sim_name and serves and rec.alive:
            return site
    return None


def _names(site: str) -> tuple[str, str]:
    """The proc records of a site's simulator and site agent."""
    return f"sim-{site}", f"sim-{site}-site-agent"


def _check_site(site: str) -> str:
    return parse_name(site, path="site")


def _write_private(path: Path, text: str) -> None:
    atomic_write(path, text)


def _record(stack: DevStack, name: str, service: str, pid: int, log: Path) -> None:
    rec = ProcRecord(name, service, pid, time.time(), str(log))
    (stack.procs / f"{name}.json").write_text(json.dumps(rec.__dict__))


def _stop(stack: DevStack, name: str, say: Callable[[str], None]) -> bool:
    rec = stack.record(name)
    if rec is None:
        return False
    if rec.alive:
        t0 = time.monotonic()
        clean = stop_pid(rec.pid, grace=15.0)
        how = "stopped" if clean else "killed "
        say(f"{rec.service:<17} {how}   pid {rec.pid} in {time.monotonic() - t0:.1f}s")
    # what it started (the emulator, bcds) is in its process group: none of it outlives it
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(rec.pid, signal.SIGKILL)
    (stack.procs / f"{name}.json").unlink(missing_ok=True)
    return True


def _agent_config(
    folder: Path,
    *,
    site: str,
    nats_url: str,
    settings: Settings,
    port: int,
    discovery: bool,
    vms: bool = False,
) -> Path:
    state = folder / "site-agent"
    state.mkdir(parents=True, exist_ok=True)
    lines = [
        f"site_id = {json.dumps(site)}",
        f"nats_url = {json.dumps(nats_url)}",
        f"subject_root = {json.dumps(settings.subject_root)}",
        f"state_dir = {json.dumps(str(state / 'state'))}",
        f"join_token_file = {json.dumps(str(state / 'join-token'))}",
        f'http_listen = "127.0.0.1:{port}"',
        # /metrics on a loopback port of its own (any free one: nothing scrapes the demo's agent)
        'metrics_listen = "127.0.0.1:0"',
        # VMs reach this machine's loopback as 10.0.2.2: their scripts and cache URLs say so
        *([f'public_url = "http://10.0.2.2:{port}"'] if vms else []),
        # the simulated site's kernels and images are served on this machine's loopback
        "[cache]",
        'allow_source_networks = ["127.0.0.0/8", "::1/128"]',
        "[netboot]",
        f"discovery = {'true' if discovery else 'false'}",
        # the simulated machines ask for their scripts as soon as they power on: a short quiet
        # period keeps the demo quick (production's default is 120 s, docs/site-agent.md)
        "quiet_seconds = 0.5",
    ]
    if discovery:
        lines += [
            # the simulator takes the kernel line's command line; the kernel itself is never fetched
            'discovery_kernel = "http://127.0.0.1:9/sim-discovery/vmlinuz"',
            'discovery_cmdline = "console=ttyS0"',
            f"discovery_token_file = {json.dumps(str(state / 'discovery-token'))}",
            f"discovery_control_plane = {json.dumps(nats_url)}",
        ]
    config = state / "site-agent.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


T = TypeVar("T")


async def _started(
    probe: Callable[[], Awaitable[T | None]],
    *,
    pid: int,
    log: Path,
    timeout: float,
    what: str,
    not_up: str,
    path: str,
) -> T:
    """``probe()`` every 0.2 s until it returns something; ``UNAVAILABLE`` naming the log (and
    its last lines) when process ``pid`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        got = await probe()
        if got is not None:
            return got
        if not pid_alive(pid):
            message = f"{what} exited at start"
        elif time.monotonic() > deadline:
            message = f"{not_up} after {timeout:.0f}s"
        else:
            await asyncio.sleep(0.2)
            continue
        said = f"{message}; its log is {log}{log_tail(log)}"
        raise BcError(ErrorCode.UNAVAILABLE, said, {"path": path, "log": str(log)})


async def _wait_machines(folder: Path, pid: int, log: Path, timeout: float) -> dict[str, Any]:
    async def machines() -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            doc: dict[str, Any] = json.loads((folder / MACHINES_FILE).read_text())
            return doc
        return None

    return await _started(
        machines, pid=pid, log=log, timeout=timeout, what="the simulator", not_up="the simulator is not up",
        path="sim",
    )  # fmt: skip


async def _wait_agent(cq: CommandQueueClient, site: str, pid: int, log: Path, timeout: float) -> str:
    async def connected() -> str | None:
        with contextlib.suppress(BcError):
            found = await cq.agents(site_id=site, role="site", connected=True)
            if found:
                return found[0].id
        return None

    return await _started(
        connected, pid=pid, log=log, timeout=timeout, what="the site agent",
        not_up=f"the site agent of {site} is not connected", path="siteAgent",
    )  # fmt: skip


def _check_installed() -> None:
    """The simulator is the test kit's and the site agent its own distribution: bcx runs both as
    processes (``python -m``), so they must be installed beside it (``bcx[sim]``)."""
    wanted = {"better-compute-testing": "better_compute.testing", "bc-site-agent": "bc_site_agent"}
    missing = [dist for dist, module in wanted.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise BcError(
            ErrorCode.UNAVAILABLE,
            f"bcx sim runs the metal simulator and a site agent: install {' and '.join(missing)} "
            "(pip install 'bcx[sim]')",
            {"path": "sim", "missing": missing},
        )


async def sim_up(args: argparse.Namespace, settings: Settings) -> int:
    _check_installed()
    site = _check_site(args.site)
    if args.vms < 0 or args.vms > 16:
        raise BcError(ErrorCode.INVALID_INPUT, "--vms is 0 to 16", {"path": "vms"})
    if args.machines < 0 or args.unenrolled < 0 or args.machines + args.unenrolled + args.vms < 1:
        raise BcError(ErrorCode.INVALID_INPUT, "give at least one machine", {"path": "machines"})
    if args.machines + args.unenrolled > 1000:
        raise BcError(ErrorCode.INVALID_INPUT, "at most 1000 machines per site", {"path": "machines"})
    lo, _, hi = args.power_delay.partition(",")
    try:
        delay = (float(lo), float(hi or lo))
    except ValueError:
        raise BcError(
            ErrorCode.INVALID_INPUT, "--power-delay is lo,hi in seconds", {"path": "powerDelay"}
        ) from None
    labels = parse_labels(args.label)
    say = _say(args.json)
    stack = DevStack(settings)
    nats_url = resolve_nats_url(settings)
    sim_name, agent_name = _names(site)
    for name in (sim_name, agent_name):
        rec = stack.record(name)
        if rec is not None and rec.alive:
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"the simulator of site {site} is up already (bcx sim down --site {site})",
                {"path": "site", "reason": "already-up"},
            )  # fmt: skip
    folder = _site_folder(stack, site)
    shutil.rmtree(folder, ignore_errors=True)  # fresh machines each time
    folder.mkdir(parents=True)
    stack.procs.mkdir(parents=True, exist_ok=True)
    stack.logs.mkdir(parents=True, exist_ok=True)
    creds_file = folder / "bmc.json"
    password = secrets.token_urlsafe(18)
    register_secret(password)
    _write_private(creds_file, json.dumps({"username": "admin", "password": password}) + "\n")
    port = free_port()
    boot_url = f"http://127.0.0.1:{port}"
    total = args.machines + args.unenrolled
    env = {**os.environ, "BC_NATS_URL": nats_url, "BC_SUBJECT_ROOT": settings.subject_root}
    env.pop("BC_CONFIG", None)

    async with api_client(settings) as api:
        pki, cq = PkiClient(api), CommandQueueClient(api)
        token = await pki.issue_join_token(
            tenant_id=args.tenant, role="site", site_id=site, ttl_seconds=600, note=f"bcx sim up {site}"
        )
        config = _agent_config(
            folder, site=site, nats_url=nats_url, settings=settings, port=port, discovery=args.discovery,
            vms=args.vms > 0,
        )  # fmt: skip
        _write_private(folder / "site-agent" / "join-token", token.token + "\n")
        if args.discovery:
            disc = await pki.issue_join_token(
                tenant_id=args.tenant, role="discovery", site_id=site, ttl_seconds=8 * 3600,
                max_uses=max(10, 4 * total), note=f"bcx sim up {site}: discovery",
            )  # fmt: skip
            _write_private(folder / "site-agent" / "discovery-token", disc.token + "\n")
        agent_log = stack.logs / f"{agent_name}.log"
        agent_pid = spawn_detached(
            [sys.executable, "-m", "bc_site_agent", "--config", str(config)], agent_log, env=env
        )
        _record(stack, agent_name, "bc-site-agent", agent_pid, agent_log)
        say(f"{'bc-site-agent':<17} started   pid {agent_pid}  site {site}, http {boot_url}")
        sim_log = stack.logs / f"{sim_name}.log"
        argv = [
            sys.executable, "-m", SIM_MODULE, "--folder", str(folder), "--site", site,
            "--machines", str(total), "--seed", str(args.seed), "--power-delay", f"{delay[0]},{delay[1]}",
            "--boot-url", boot_url, "--credentials-file", str(creds_file), "--vms", str(args.vms),
        ]  # fmt: skip
        if args.lean:
            argv.append("--lean")
        for index in range(args.machines, total):
            argv += ["--power-on", str(index)]
        # the fleet app's engine writes autoinstall ISOs there: the simulator serves them to its BMC
        media_dir, media_url = os.environ.get("BC_SIM_MEDIA_DIR"), os.environ.get("BC_SIM_MEDIA_URL")
        serving = _media_server(stack, sim_name) if media_dir and media_url else None
        if serving is not None:  # one folder, one URL: the first simulator serves it for every site
            say(f"ISOs: served by the simulator of site {serving} at {media_url}")
        elif media_dir and media_url:
            argv += ["--media-dir", media_dir, "--media-url", media_url]
        if "--media-url" in argv:
            (folder / "media-served").touch()  # what _media_server looks for
        sim_pid = spawn_detached(argv, sim_log, env=env)
        _record(stack, sim_name, "metal-sim", sim_pid, sim_log)
        say(f"{'metal-sim':<17} started   pid {sim_pid}  {total} machines, {args.vms} VMs")
        try:
            doc = await _wait_machines(folder, sim_pid, sim_log, args.timeout)
            await _wait_agent(cq, site, agent_pid, agent_log, args.timeout)
        except BcError:
            _stop(stack, sim_name, say)
            _stop(stack, agent_name, say)
            raise
        nodes: dict[str, str] = {}
        if args.enroll:
            credential = creds_file.read_bytes().strip()
            chosen = doc["machines"][: args.machines]
            # hw= tells the simulated machines from the VMs in a selector (hw=sim, hw=vm)
            nodes = await _enroll(api, chosen, credential, site, args.tenant, {"hw": "sim", **labels})
            vms = doc.get("vms") or []
            vm_labels = {"vm": "1", "hw": "vm", **labels}
            nodes.update(await _enroll(api, vms, credential, site, args.tenant, vm_labels))
        discovered: dict[str, str] = {}
        strangers = doc["machines"][args.machines :]
        if strangers and args.discovery and args.wait_discovered:
            discovered = await _wait_discovered(EngineClient(api), site, strangers, args.timeout)
        nodes.update(discovered)
        _write_private(folder / NODES_FILE, json.dumps(nodes, indent=2) + "\n")

    machines = [
        {
            "name": m["name"], "mac": m["macs"][0], "macs": m["macs"], "bmc": m["bmc"], "uuid": m["uuid"],
            "serial": m["serial"], "node": nodes.get(m["name"]),
            "power": "off" if m["index"] < args.machines else (
                "on (discovered)" if m["name"] in discovered else "on (network boot)"
            ),
            "folder": m["folder"],
        }
        for m in doc["machines"]
    ] + [
        {
            "name": v["name"], "mac": v["macs"][0], "macs": v["macs"], "bmc": v["bmc"], "uuid": v["uuid"],
            "serial": v["serial"], "node": nodes.get(v["name"]), "power": "off (VM)", "folder": v["folder"],
        }
        for v in doc.get("vms") or []
    ]  # fmt: skip
    if args.json:
        print_json({
            "site": site, "state": str(stack.state), "bmcUrl": doc["bmcUrl"],
            "bmcCredentialsFile": str(creds_file), "bootUrl": boot_url, "discovery": args.discovery,
            "siteAgent": {"pid": agent_pid, "log": str(agent_log)},
            "simulator": {"pid": sim_pid, "log": str(sim_log), "folder": str(folder)},
            "machines": machines,
        })  # fmt: skip
        return 0
    print_table(
        machines,
        [("name", "MACHINE"), ("mac", "MAC"), ("bmc", "BMC URL"), ("power", "POWER"), ("node", "NODE")],
    )
    print(
        f"BMC credential: {creds_file}  (bcx nodes enroll --site {site} --name <MACHINE> --bmc <BMC URL>"
        " --bmc-credentials-file …)"
    )
    if not args.enroll:
        print("nothing enrolled (--enroll enrolls the machines as nodes)")
    if args.unenrolled and args.discovery:
        print(
            f"{len(discovered)} of {args.unenrolled} machine(s) nobody enrolled booted the discovery ramdisk "
            f"and are discovered nodes (bcx nodes show <NODE>; bcx nodes enroll <NODE> --bmc …)"
        )
    return 0


async def _wait_discovered(
    engine: EngineClient, site: str, machines: list[dict[str, Any]], timeout: float
) -> dict[str, str]:
    """Until each of ``machines`` (switched on, nobody's) is a discovered node of the site, found by
    its product UUID; those found by ``timeout`` (a discovery is no condition of ``up``)."""
    want = {m["uuid"]: m["name"] for m in machines}
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(want) and time.monotonic() < deadline:
        cursor: str | None = None
        while True:
            page = await engine.list_nodes(site_id=site, cursor=cursor, limit=500)
            for n in page.nodes:
                uuid = (n.hardware or {}).get("productUuid")
                if n.state == "discovered" and uuid in want:
                    found[want[uuid]] = n.id
            cursor = page.next
            if not cursor:
                break
        if len(found) < len(want):
            await asyncio.sleep(0.3)
    return found


def _node_name(machine: str) -> str | None:
    """The machine's name (``lab1-m001``) as its node's: a site name may hold what a node name
    may not (``_``, capitals), so those are mended; None when nothing usable is left."""
    name = machine.lower().replace("_", "-")
    return name if re.match(NODE_NAME_PATTERN, name) else None


async def _enroll(
    api: Any,
    machines: list[dict[str, Any]],
    credential: bytes,
    site: str,
    tenant: str,
    labels: dict[str, str],
) -> dict[str, str]:
    """Each machine as a node: its MACs, its Redfish BMC, the credential as its standing secret."""
    engine, store = EngineClient(api), SecretsClient(api)
    nodes: dict[str, str] = {}
    for m in machines:
        node_id = new_id("node")
        info = await store.put_for_node(credential, tenant_id=tenant, node_id=node_id, label="bmc")
        bmc = convert({**parse_bmc_url(m["bmc"]), "credentialsRef": info.ref}, NodeBmc)
        node = await engine.enroll_node(
            site_id=site, id=node_id, tenant_id=tenant, labels={"sim": "1", **labels}, macs=list(m["macs"]),
            bmc=bmc, name=_node_name(m["name"]),
        )  # fmt: skip
        nodes[m["name"]] = node.id
    return nodes


async def sim_down(args: argparse.Namespace, settings: Settings) -> int:
    say = _say(args.json)
    stack = DevStack(settings)
    sites = [_check_site(args.site)] if args.site else _sites(stack)
    stopped = []
    for site in sites:
        sim_name, agent_name = _names(site)
        # the simulator first: its machines' bcds go with it, then their site agent
        if _stop(stack, sim_name, say) | _stop(stack, agent_name, say):
            stopped.append(site)
    if args.json:
        print_json({"stopped": stopped})
    elif not stopped:
        print("no simulator is up")
    return 0


def _sites(stack: DevStack) -> list[str]:
    found = {
        r.name.removeprefix("sim-").removesuffix("-site-agent")
        for r in stack.records()
        if r.name.startswith("sim-")
    }
    return sorted(found)


def _power(bmc_url: str, creds: dict[str, str], uuid: str) -> str:
    req = urllib.request.Request(f"{bmc_url}/redfish/v1/Systems/{uuid}")
    auth = base64.b64encode(f"{creds['username']}:{creds['password']}".encode()).decode()
    req.add_header("Authorization", f"Basic {auth}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return str(json.loads(resp.read()).get("PowerState") or "?")
    except (OSError, urllib.error.URLError, ValueError):
        return "?"


def _last(ledger: Path, prefix: str) -> str:
    try:
        lines = ledger.read_text().splitlines()
    except OSError:
        return "-"
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if str(event.get("event", "")).startswith(prefix):
                return str(event["event"]).removeprefix(prefix) or "-"
    return "-"


def _vm_boot(folder: Path) -> str:
    """What a VM booted at its last power-on (``network``, ``disk``, ``cd``), from its events."""
    found = "-"
    with contextlib.suppress(OSError):
        for line in (folder / "events.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "power" and event.get("to") == "On":
                    found = str(event.get("boot") or "-")
    return found


async def sim_status(args: argparse.Namespace, settings: Settings) -> int:
    stack = DevStack(settings)
    sites = [_check_site(args.site)] if args.site else _sites(stack)
    out: list[dict[str, Any]] = []
    for site in sites:
        sim_name, agent_name = _names(site)
        folder = _site_folder(stack, site)
        sim_rec, agent_rec = stack.record(sim_name), stack.record(agent_name)
        try:
            doc: dict[str, Any] = json.loads((folder / MACHINES_FILE).read_text())
            creds = json.loads((folder / "bmc.json").read_text())
            register_secret(creds["password"])
        except (OSError, ValueError, KeyError):
            doc, creds = {"machines": []}, {}
        try:
            nodes = json.loads((folder / NODES_FILE).read_text())
        except (OSError, ValueError):
            nodes = {}
        alive = bool(sim_rec and sim_rec.alive)
        machines = []
        for m in doc["machines"]:
            ledger = Path(m["folder"]) / "ledger.jsonl"
            bmc_url = doc["bmcUrl"]
            power = await asyncio.to_thread(_power, bmc_url, creds, m["uuid"]) if alive and creds else "-"
            machines.append({
                "name": m["name"], "mac": m["macs"][0], "bmc": m["bmc"], "node": nodes.get(m["name"]),
                "power": power, "boot": _last(ledger, "boot."), "bcd": _last(ledger, "bcd."),
            })  # fmt: skip
        for v in doc.get("vms") or []:  # behind a sushy-emulator of their own; bcd runs inside them
            bmc_url = "http://" + v["bmc"].split("://", 1)[1].split("/redfish/", 1)[0]
            power = await asyncio.to_thread(_power, bmc_url, creds, v["uuid"]) if alive and creds else "-"
            machines.append({
                "name": v["name"], "mac": v["macs"][0], "bmc": v["bmc"], "node": nodes.get(v["name"]),
                "power": power, "boot": _vm_boot(Path(v["folder"])), "bcd": "-",
            })  # fmt: skip
        out.append({
            "site": site,
            "simulator": {"pid": sim_rec.pid if sim_rec else None, "alive": alive},
            "siteAgent": {
                "pid": agent_rec.pid if agent_rec else None, "alive": bool(agent_rec and agent_rec.alive)
            },
            "bmcUrl": doc.get("bmcUrl"), "machines": machines,
        })  # fmt: skip
    if args.json:
        print_json({"sites": out})
        return 0
    if not out:
        print("no simulator is up (bcx sim up --machines N --site S)")
        return 0
    for s in out:
        sim, agent = s["simulator"], s["siteAgent"]
        print(
            f"site {s['site']}: metal-sim pid {sim['pid']} ({'up' if sim['alive'] else 'down'}), "
            f"bc-site-agent pid {agent['pid']} ({'up' if agent['alive'] else 'down'}), "
            f"BMC {s['bmcUrl'] or '-'}"
        )
        print_table(
            s["machines"],
            [("name", "MACHINE"), ("mac", "MAC"), ("power", "POWER"), ("boot", "LAST BOOT"), ("bcd", "BCD"),
             ("node", "NODE")],
            empty="no machines",
        )  # fmt: skip
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    sim = sub.add_parser("sim", help="the metal simulator and a site agent for one site").add_subparsers(
        dest="sim_command", required=True, metavar="COMMAND"
    )
    p = sim.add_parser("up", parents=[common], help="start simulated machines and their site agent")
    p.add_argument("--machines", type=int, required=True, help="machines (enrolled with --enroll)")
    p.add_argument("--site", required=True, help="site id")
    p.add_argument("--unenrolled", type=int, default=0, help="more machines nobody enrolls, switched on")
    p.add_argument(
        "--vms",
        type=int,
        default=0,
        help="QEMU VMs behind sushy-emulator too (docs/vm-lab.md; enrolled with --enroll)",
    )
    p.add_argument("--enroll", action="store_true", help="enroll the --machines as nodes with their BMC")
    p.add_argument("--label", action="append", help="key=value on each enrolled node, repeatable")
    p.add_argument("--tenant", default="root", help="tenant of the tokens and nodes (default root)")
    p.add_argument("--no-discovery", dest="discovery", action="store_false", help="no discovery ramdisk")
    p.add_argument(
        "--no-wait", dest="wait_discovered", action="store_false",
        help="return before the --unenrolled machines show up as discovered",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1, help="the same seed gives the same machines")
    p.add_argument("--power-delay", default="0.2,1.0", help="lo,hi seconds before a power change lands")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    p.add_argument(
        "--lean", action="store_true", default=os.environ.get("BC_SIM_LEAN") == "1",
        help="every bcd a task of one process, not a process each (for scale; BC_SIM_LEAN=1)",
    )  # fmt: skip
    p.set_defaults(func=sim_up)
    p = sim.add_parser("down", parents=[common], help="stop the simulator(s) and their site agent")
    p.add_argument("--site", help="only this site")
    p.set_defaults(func=sim_down)
    p = sim.add_parser("status", parents=[common], help="simulated machines: power, last boot, bcd")
    p.add_argument("--site", help="only this site")
    p.set_defaults(func=sim_status)
