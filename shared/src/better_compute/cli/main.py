"""``bcx``: the admin CLI. It talks to the services only over NATS."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from ..config import Settings, load_settings
from ..core.errors import BcError
from ..runtime.dev import SERVICES, DevStack
from ..runtime.urls import resolve_nats_url
from ..service.client import connect, discover
from . import engine_commands, pki_commands, secrets_commands
from .output import print_error, print_json, print_table

__all__ = ["main"]

Command = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]]


def _uptime(started: str | None) -> str:
    if not started:
        return "-"
    try:
        t0 = datetime.fromisoformat(started.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    if t0.tzinfo is None:
        t0 = t0.replace(tzinfo=UTC)
    secs = int((datetime.now(UTC) - t0).total_seconds())
    if secs < 120:
        return f"{secs}s"
    if secs < 7200:
        return f"{secs // 60}m{secs % 60:02d}s"
    return f"{secs // 3600}h{(secs % 3600) // 60:02d}m"


async def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    """Running services and instances, found over NATS ($SRV.STATS)."""
    nc = await connect(resolve_nats_url(settings), name="bcx", allow_reconnect=False)
    try:
        found = await discover(nc, root=settings.subject_root, wait=args.wait)
    finally:
        await nc.close()
    rows = [
        {
            "service": d.get("name"),
            "instance": (d.get("metadata") or {}).get("instance"),
            "id": d.get("id"),
            "version": d.get("version"),
            "host": (d.get("metadata") or {}).get("host"),
            "pid": (d.get("metadata") or {}).get("pid"),
            "started": d.get("started"),
            "uptime": _uptime(d.get("started")),
            "requests": sum(int(e.get("num_requests", 0)) for e in d.get("endpoints") or []),
            "errors": sum(int(e.get("num_errors", 0)) for e in d.get("endpoints") or []),
        }
        for d in found
    ]
    if args.json:
        print_json({"services": rows})
        return 0
    print_table(
        rows,
        [("service", "SERVICE"), ("instance", "INSTANCE"), ("version", "VERSION"),
         ("uptime", "UPTIME"), ("pid", "PID"), ("requests", "REQUESTS"), ("errors", "ERRORS")],
        empty="no services answer on this NATS",
    )  # fmt: skip
    return 0


async def cmd_dev_up(args: argparse.Namespace, settings: Settings) -> int:
    say = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    stack = DevStack(settings, say=say)
    services = args.service or list(SERVICES)
    urls = stack.up(services=services, instances=args.instances)
    # Wait until every started service answers, so `bcx status` right after shows them.
    want = {s: args.instances for s in services}
    nc = await connect(urls["nats"], name="bcx", allow_reconnect=False)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            found = await discover(nc, root=settings.subject_root, wait=0.3)
            have: dict[str, int] = {}
            for d in found:
                have[str(d.get("name"))] = have.get(str(d.get("name")), 0) + 1
            missing = {s: n for s, n in want.items() if have.get(s, 0) < n}
            if not missing:
                break
            if time.monotonic() > deadline:
                logs = ", ".join(str(stack.logs / f"{s}-1.log") for s in missing)
                raise BcError(
                    "UNAVAILABLE",
                    f"not answering after {args.timeout}s: {', '.join(missing)}; see {logs}",
                )
    finally:
        await nc.close()
    if args.json:
        print_json({"state": str(stack.state), **urls, "services": services})
    else:
        print(f"ready: state in {stack.state}")
        print(f"  export BC_NATS_URL={urls['nats']}")
        print(f"  export BC_DATABASE_URL={urls['database']}")
    return 0


async def cmd_dev_down(args: argparse.Namespace, settings: Settings) -> int:
    say = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    DevStack(settings, say=say).down(keep_servers=args.keep_servers)
    if args.json:
        print_json({"stopped": True})
    return 0


async def cmd_dev_ps(args: argparse.Namespace, settings: Settings) -> int:
    stack = DevStack(settings)
    rows: list[dict[str, Any]] = [
        {
            "name": "nats-server",
            "pid": stack.nats.running_pid(),
            "alive": bool(stack.nats.running_pid()),
        },
        {
            "name": "postgresql",
            "pid": stack.pg.running_pid(),
            "alive": bool(stack.pg.running_pid()),
        },
    ]
    rows += [{"name": r.name, "pid": r.pid, "alive": r.alive, "log": r.log} for r in stack.records()]
    if args.json:
        print_json({"state": str(stack.state), "processes": rows})
    else:
        print_table(rows, [("name", "PROCESS"), ("pid", "PID"), ("alive", "ALIVE"), ("log", "LOG")])
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--config", help="bc.toml path")
    common.add_argument("--nats-url", help="NATS URL (default: $BC_NATS_URL or the embedded one)")
    common.add_argument("--state-dir", help="state directory of the embedded stack")
    common.add_argument("--subject-root", help="root of every subject (default bc)")

    parser = argparse.ArgumentParser(prog="bcx", description="Better Compute admin CLI")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("status", parents=[common], help="running services and instances")
    p.add_argument("--wait", type=float, default=0.5, help="seconds to collect answers")
    p.set_defaults(func=cmd_status)

    dev = sub.add_parser("dev", help="the embedded stack on this machine")
    dsub = dev.add_subparsers(dest="dev_command", required=True, metavar="COMMAND")
    p = dsub.add_parser("up", parents=[common], help="start NATS, PostgreSQL and every service")
    p.add_argument("--service", action="append", choices=list(SERVICES), help="only these")
    p.add_argument("--instances", type=int, default=1, help="instances of each service")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness")
    p.set_defaults(func=cmd_dev_up)
    p = dsub.add_parser("down", parents=[common], help="stop the services and servers")
    p.add_argument("--keep-servers", action="store_true", help="leave NATS and PostgreSQL up")
    p.set_defaults(func=cmd_dev_down)
    p = dsub.add_parser("ps", parents=[common], help="processes of the embedded stack")
    p.set_defaults(func=cmd_dev_ps)
    engine_commands.register(sub, common)
    pki_commands.register(sub, common)
    secrets_commands.register(sub, common)
    from . import cmdq_commands

    cmdq_commands.register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    try:
        settings = load_settings(
            args.config,
            nats_url=args.nats_url,
            state_dir=args.state_dir,
            subject_root=args.subject_root,
        )
        code = asyncio.run(args.func(args, settings))
    except BcError as err:
        print_error(err, as_json=as_json)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
