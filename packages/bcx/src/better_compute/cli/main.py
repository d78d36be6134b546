"""``bcx``: the admin CLI. It talks to the services only over NATS."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from .completion import SHELLS
from .output import FORMATS

if TYPE_CHECKING:
    from ..config import Settings
    from . import contexts

# What `bcx --help`, a completion script or a mistyped line costs is argparse and this module: the
# SDK (msgspec), the runtime and the command modules load when a command runs, each in the function
# that needs it (bench/bench_cli_start.py prints the figures).

__all__ = ["main"]

Command = Callable[[argparse.Namespace, "Settings"], Coroutine[Any, Any, int]]


def _uptime(started: str | None) -> str:
    from datetime import UTC, datetime

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
    from ..runtime.dev import SERVICES
    from ..service.client import discover
    from .common import connect_bus
    from .output import iso, print_json, print_table

    nc = await connect_bus(settings)
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
            "started": iso(d.get("started")),
            "uptime": _uptime(d.get("started")),
            "requests": sum(int(e.get("num_requests", 0)) for e in d.get("endpoints") or []),
            "errors": sum(int(e.get("num_errors", 0)) for e in d.get("endpoints") or []),
        }
        for d in found
    ]
    # a known service with no instance is an outage, whatever else answers
    answering = {row["service"] for row in rows}
    missing = [s for s in (args.service or SERVICES) if s not in answering]
    if args.json:
        print_json({"services": rows, "missing": missing})
        return 1 if missing else 0
    print_table(
        rows,
        [("service", "SERVICE"), ("instance", "INSTANCE"), ("version", "VERSION"),
         ("uptime", "UPTIME"), ("pid", "PID"), ("requests", "REQUESTS"), ("errors", "ERRORS")],
        empty="no services answer on this NATS",
    )  # fmt: skip
    if missing:
        sys.stderr.write(f"error: no instance answers: {', '.join(missing)}\n")
        return 1
    return 0


async def cmd_version(args: argparse.Namespace, settings: Settings) -> int:
    """bcx's version, and each service's as its instances report it (``$SRV.STATS``); a known
    service with no instance answering is shown as such. The client's version is printed even
    when NATS cannot be reached."""
    from ..core import __version__
    from ..core.errors import BcError
    from ..logging import safe_url
    from ..runtime.dev import SERVICES
    from ..service.client import discover
    from .common import connect_bus
    from .output import print_json, print_table

    client = {"component": "bcx", "version": __version__, "python": sys.version.split()[0]}
    services: list[dict[str, Any]] = []
    problem: BcError | None = None
    try:
        nc = await connect_bus(settings)
        try:
            found = await discover(nc, root=settings.subject_root, wait=args.wait)
        finally:
            await nc.close()
    except BcError as err:
        found, problem = [], err
    by_service: dict[str, dict[str, list[str]]] = {}
    for d in found:
        instance = str((d.get("metadata") or {}).get("instance") or d.get("id"))
        versions = by_service.setdefault(str(d.get("name")), {})
        versions.setdefault(str(d.get("version") or "?"), []).append(instance)
    for name in [*SERVICES, *sorted(set(by_service) - set(SERVICES))]:
        versions = by_service.get(name, {})
        services.append({"service": name, "answering": bool(versions), "versions": versions})
    missing = [s["service"] for s in services if not s["answering"]]
    if args.json:
        print_json({
            "client": client,
            "context": args.selection.name,
            "natsUrl": safe_url(settings.nats_url) if settings.nats_url else None,
            "services": services,
            "error": None if problem is None else {"code": problem.code.value, "message": problem.message},
        })  # fmt: skip
    else:
        rows: list[dict[str, Any]] = [{"component": "bcx (client)", "version": __version__, "instances": "-"}]
        for svc in services:
            if not svc["answering"]:
                state = "unknown: NATS unreachable" if problem else "not answering"
                rows.append({"component": svc["service"], "version": "-", "instances": state})
            for version, instances in svc["versions"].items():
                rows.append({"component": svc["service"], "version": version,
                             "instances": f"{len(instances)} ({', '.join(sorted(instances))})"})  # fmt: skip
        print_table(rows, [("component", "COMPONENT"), ("version", "VERSION"), ("instances", "INSTANCES")])
    if problem is not None:
        raise problem
    return 1 if missing else 0


async def cmd_completion(args: argparse.Namespace, settings: Settings) -> int:
    """The completion script of ``args.shell`` for every command (the parser built whole)."""
    from .completion import script

    print(script(args.shell, build_parser()), end="")
    return 0


async def cmd_dev_up(args: argparse.Namespace, settings: Settings) -> int:
    from ..core.errors import BcError, ErrorCode
    from ..runtime.dev import SERVICES, DevStack
    from ..service.client import connect, discover
    from .common import operator_inbox
    from .output import print_json

    say = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    stack = DevStack(settings, say=say)
    services = args.service or list(SERVICES)
    if args.restart:
        stack.stop_services(services)
    urls = stack.up(services=services, instances=args.instances)
    # Wait until every started service answers, so `bcx status` right after shows them.
    want = {s: args.instances for s in services}
    nc = await connect(
        urls["nats"], name="bcx", allow_reconnect=False, creds=settings.nats_creds, ca=settings.nats_ca,
        inbox_prefix=operator_inbox(urls["nats"], settings.nats_creds),
    )  # fmt: skip
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
            # a process that exited will not answer: say so now, with its log, not at the timeout
            for name in (f"{s}-{n}" for s in missing for n in range(1, args.instances + 1)):
                rec = stack.record(name)
                if rec is not None and not rec.alive:
                    raise BcError(
                        ErrorCode.UNAVAILABLE,
                        stack.start_failure(name, "exited at start"),
                        {"path": "service", "service": rec.service, "log": rec.log},
                    )
            if time.monotonic() > deadline:
                names = [f"{s}-{n}" for s in missing for n in range(1, args.instances + 1)]
                raise BcError(
                    ErrorCode.UNAVAILABLE,
                    "\n".join(
                        stack.start_failure(n, f"is not answering after {args.timeout}s") for n in names
                    ),
                    {"path": "service", "service": next(iter(missing))},
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
    from ..runtime.dev import DevStack
    from .output import print_json

    say = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    DevStack(settings, say=say).down(keep_servers=args.keep_servers)
    if args.json:
        print_json({"stopped": True})
    return 0


async def cmd_dev_ps(args: argparse.Namespace, settings: Settings) -> int:
    from ..runtime.dev import DevStack
    from .output import print_json, print_table

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


def _global_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The flags every bcx command takes, wherever they stand on the line. Only the top parser
    sets their defaults: a subcommand's copy that is not given leaves what came before."""
    given: dict[str, Any] = {} if defaults else {"default": argparse.SUPPRESS}
    parser.add_argument(
        "--json", action="store_true", help="machine-readable output (--output json)", **given
    )
    parser.add_argument(
        "-o", "--output", choices=(*FORMATS, "wide"), help="table (default), wide (more columns), json, yaml",
        **given,
    )  # fmt: skip
    parser.add_argument(
        "--context", help="a bcx context (bcx context list) instead of the current one", **given
    )
    parser.add_argument("--config", help="bc.toml path", **given)
    parser.add_argument(
        "--nats-url", help="NATS URL (default: $BC_NATS_URL, the context's, or the embedded one)", **given
    )
    parser.add_argument(
        "--creds", help="NATS credentials file (default: $BC_NATS_CREDS or the context's)", **given
    )
    parser.add_argument("--state-dir", help="state directory of the embedded stack", **given)
    parser.add_argument("--subject-root", help="root of every subject (default bc)", **given)


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:  # argparse offers no public walk of its tree
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *_subparsers(child)]
    return found


class BcxParser(argparse.ArgumentParser):
    """bcx's parsers (every subcommand's too: argparse makes subparsers of the parent's class).
    Each records itself in the namespace, so the deepest one chosen reports an unknown argument
    with its own usage (``bcx nodes list --bogus`` shows ``bcx nodes list``'s, not ``bcx``'s)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(_bcx_parser=self)


# The command modules, in the order `bcx --help` lists their commands, with the top-level commands
# each adds and their help. `bcx <command> …` imports only the module(s) of <command>: the others
# stand in the parser as their name and help (what `bcx --help` and a mistyped command show), so a
# command does not pay for every other one's dependencies (tests/unit/test_bcx_cli.py checks this
# table against what the modules register).
LAZY_COMMANDS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("main", (("status", "running services and instances"), ("dev", "the embedded stack on this machine"))),
    ("engine_commands", (
        ("nodes", "nodes the engine knows"),
        ("steps", "registered steps and driver operations"),
        ("plugins", "plugins the engine runs"),
        ("profiles", "versioned documents of steps"),
    )),
    ("workflow_commands", (("workflows", "profiles running for nodes"),)),
    ("metal_commands", (
        ("inspect", "boot the node and record its inventory"),
        ("commission", "inspect and wipe: the node becomes ready"),
        ("deploy", "install an image on a ready node"),
        ("release", "wipe a deployed node: it becomes ready again"),
        ("retire", "erase the node for good"),
        ("adopt", "take over a machine that already runs: it becomes deployed"),
        ("bulk", "one verb over many nodes, under one batch"),
    )),
    ("enrollment_commands", (
        ("enrollment-rules", "rules that enroll discovered nodes by their inventory and labels"),
    )),
    ("images_commands", (("images", "the image catalog"),)),
    ("pki_commands", (("tokens", "join tokens"), ("certs", "agent certificates"))),
    ("secrets_commands", (("secrets", "stored secrets (metadata)"),)),
    ("keys_commands", (("keys", "the key files of bc-pki and bc-secrets"),)),
    ("bus_commands", (("bus", "TLS certificates and password hashes for deploy/nats"),)),
    ("ops_commands", (
        ("events", "the event feed (stream BC_EVENTS)"),
        ("audit", "operator actions that changed state, newest first"),
    )),
    ("cmdq_commands", (
        ("commands", "commands sent to agents"),
        ("agents", "site agents and node agents"),
        ("batches", "destructive batches and their approvals"),
        ("quorum", "the destructive-batch quorum in force"),
    )),
    ("why_commands", (("why", "what a node's or workflow's current step waits for, in one answer"),)),
    ("sim_commands", (("sim", "the metal simulator and a site agent for one site"),)),
    ("ramdisk_commands", (("ramdisk", "the bcd ramdisk: build it; set the one the profiles boot"),)),
    ("contexts", (("context", "named deployments (NATS URL, credentials, tenant) in bcx's config"),)),
)  # fmt: skip

_MODULE_OF = {name: module for module, commands in LAZY_COMMANDS for name, _ in commands}
_VALUE_FLAGS = frozenset({"-o", "--output", "--context", "--config", "--nats-url", "--creds", "--state-dir",
                          "--subject-root"})  # fmt: skip
_BARE_FLAGS = frozenset({"-h", "--help", "--json"})
_UNSURE = "?"


def command_word(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs (its first word that is no global flag or flag value); ``None``
    when it names none (``bcx --help``); ``"?"`` when a word before it is no flag bcx knows as
    such (an abbreviation: argparse, not this, decides then)."""
    words = iter(argv)
    for word in words:
        if word in _VALUE_FLAGS:
            next(words, None)
        elif word in _BARE_FLAGS or word.split("=", 1)[0] in _VALUE_FLAGS or word.startswith("-o"):
            continue
        elif word.startswith("-"):
            return _UNSURE
        else:
            return word
    return None


def _modules_for(argv: Sequence[str] | None) -> set[str]:
    """The command modules ``build_parser(argv)`` registers for real."""
    if argv is None:
        return set(_MODULE_OF.values())
    word = command_word(argv)
    if word == _UNSURE:
        return set(_MODULE_OF.values())
    module = _MODULE_OF.get(word or "")
    if module is None:
        return set()
    # metal's commands add to `bcx nodes`, and `bcx nodes` holds metal's `enroll` and `show`
    return (
        {"engine_commands", "metal_commands"} if module in ("engine_commands", "metal_commands") else {module}
    )


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """``bcx status`` and ``bcx dev``: registered through ``LAZY_COMMANDS`` like any command module's,
    since their ``--service`` choices come from the runtime (``runtime.dev.SERVICES``)."""
    from ..runtime.dev import SERVICES

    p = sub.add_parser("status", parents=[common], help="running services and instances")
    p.add_argument("--wait", type=float, default=0.5, help="seconds to collect answers")
    p.add_argument(
        "--service", action="append", choices=list(SERVICES), help="expect only these (default all)"
    )
    p.set_defaults(func=cmd_status)

    dev = sub.add_parser("dev", help="the embedded stack on this machine")
    dsub = dev.add_subparsers(dest="dev_command", required=True, metavar="COMMAND")
    p = dsub.add_parser("up", parents=[common], help="start NATS, PostgreSQL and every service")
    p.add_argument("--service", action="append", choices=list(SERVICES), help="only these")
    p.add_argument("--instances", type=int, default=1, help="instances of each service")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness")
    p.add_argument(
        "--restart",
        action="store_true",
        help="stop the running services first, then start them (a plugin installed since loads);"
        " NATS, PostgreSQL and the simulator stay",
    )
    p.set_defaults(func=cmd_dev_up)
    p = dsub.add_parser("down", parents=[common], help="stop the services and servers")
    p.add_argument("--keep-servers", action="store_true", help="leave NATS and PostgreSQL up")
    p.set_defaults(func=cmd_dev_down)
    p = dsub.add_parser("ps", parents=[common], help="processes of the embedded stack")
    p.set_defaults(func=cmd_dev_ps)


def _stand_in(sub: Any, name: str, help: str) -> None:
    """``name`` in the parser as its name and help only. Chosen after all (``command_word``
    misread the line), it asks ``main`` to parse again with every command registered."""
    p = sub.add_parser(name, help=help, add_help=False)
    p.add_argument("_bcx_rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(_bcx_unbuilt=True)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """bcx's parser: every command registered (``argv`` None: completion, tests), or only the
    command ``argv`` runs, the others standing in by name and help (``LAZY_COMMANDS``)."""
    common = argparse.ArgumentParser(add_help=False)
    _global_flags(common, defaults=False)

    parser: argparse.ArgumentParser = BcxParser(prog="bcx", description="Better Compute admin CLI")
    _global_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    real = _modules_for(argv)
    nodes: Any = None
    for module_name, commands in LAZY_COMMANDS:
        if module_name not in real:
            for name, help in commands:
                _stand_in(sub, name, help)
            continue
        module: Any = importlib.import_module(f"{__package__}.{module_name}")
        if module_name == "engine_commands":
            nodes = module.register(sub, common)
        elif module_name == "metal_commands":
            module.register(sub, common, nodes)
        else:
            module.register(sub, common)
    p = sub.add_parser(
        "completion", parents=[common], help='print a shell completion script: eval "$(bcx completion bash)"'
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete for")
    p.set_defaults(func=cmd_completion)
    p = sub.add_parser("version", parents=[common], help="bcx's version and every running service's")
    p.add_argument("--wait", type=float, default=0.5, help="seconds to collect answers")
    p.set_defaults(func=cmd_version)
    # `bcx nodes --json list` too: the command groups take the global flags as well
    for child in _subparsers(parser):
        if "--json" not in child._option_string_actions:
            _global_flags(child, defaults=False)
    return parser


def resolve_output(args: argparse.Namespace) -> str:
    """``--output``, else ``json`` for ``--json``, else ``table``; sets ``args.json`` (any
    structured output) and the format ``print_json`` writes."""
    output = str(getattr(args, "output", None) or ("json" if getattr(args, "json", False) else "table"))
    args.wide = output == "wide"  # a table with more columns, where a command has them
    output = "table" if args.wide else output
    args.output = output
    args.json = output != "table"
    from .output import use_format

    use_format(output)
    return output


def command_words(args: argparse.Namespace) -> tuple[str, ...]:
    """The words of the command that ran (``("nodes", "show")``), from the subparsers' dests."""
    words = [str(args.command)]
    for key, value in vars(args).items():
        if key.endswith("_command") and key != "command" and isinstance(value, str):
            words.append(value)
    return tuple(words)


def settings_for(args: argparse.Namespace, selection: contexts.Selection) -> Settings:
    """Settings with a context's place in the precedence (docs/bcx.md): flags, then the
    ``--context`` one, then the environment and ``bc.toml``, then the current context."""
    flags = {
        "nats_url": args.nats_url,
        "nats_creds": args.creds,
        "state_dir": args.state_dir,
        "subject_root": args.subject_root,
    }
    from ..config import load_settings

    given = {k: v for k, v in flags.items() if v is not None}
    ctx = {k: v for k, v in selection.settings().items() if v is not None}
    if selection.chosen_by == "flag":
        return load_settings(args.config, **{**ctx, **given})
    return load_settings(args.config, defaults=ctx, **given)


def parse_line(words: Sequence[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[str]]:
    """``words`` parsed by a parser holding their command (``build_parser(words)``); should a
    stand-in be chosen after all, parsed again by the parser holding every command."""
    parser = build_parser(words)
    args, unknown = parser.parse_known_args(words)
    if getattr(args, "_bcx_unbuilt", False):
        parser = build_parser()
        args, unknown = parser.parse_known_args(words)
    return parser, args, unknown


def main(argv: list[str] | None = None) -> None:
    parser, args, unknown = parse_line(sys.argv[1:] if argv is None else argv)
    if unknown:
        getattr(args, "_bcx_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    from dataclasses import replace

    from ..core.errors import BcError
    from . import contexts
    from .hints import HintContext, hint_for, site_of
    from .output import print_error

    resolve_output(args)
    site = site_of(getattr(args, "site", None), getattr(args, "selector", None))
    hint = HintContext(command=command_words(args), site=site)
    try:
        selection = contexts.select(args.context)
        args.selection = selection
        hint = replace(hint, context=selection.name, creds=selection.settings().get("nats_creds"))
        settings = settings_for(args, selection)
        origins = {o["setting"]: o["from"] for o in contexts.origins(args, selection, settings)}
        nats_from = {"flag": "--nats-url", "default": None}.get(origins["nats_url"], origins["nats_url"])
        hint = replace(hint, nats_from=nats_from, creds=settings.nats_creds)
        if getattr(args, "context_tenant", False):
            args.tenant = contexts.tenant_for(args, selection)
        import asyncio  # here: `bcx --help` and a bad command line do not load it

        from . import node_refs

        code = asyncio.run(node_refs.run(args, settings))  # node names become ids first
    except BcError as err:
        print_error(err, as_json=args.json, hint=hint_for(err, hint))
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # The reader went away (`bcx workflows watch --json | head -1`): end as a pipeline
        # expects, quietly. Python's own flush at exit must not meet the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    sys.exit(code)
