"""A simulated agent, for tests, benchmarks and demos: ``python -m better_compute.agent.sim``.

It joins (once) with a join token, then runs every command kind of the app by answering at
once (or after ``--delay KIND=MS``) with ``{"ok": true, "kind": …, "commandId": …}``. Every
execution is appended to ``--exec-log`` (synced) before the handler returns, so a test can count
how many times each command really ran. ``--crash KIND=POINT`` kills the process once, with no
cleanup, at ``started`` (while the handler runs) or ``executed`` (after the journal recorded the
result, before it was reported); ``--fail KIND`` fails those commands and ``--reject KIND``
rejects them. ``--answer KIND=JSON`` answers those commands with that JSON instead.
``--unsigned`` makes a node's agent report results without the node's signature (they then
never count as attested).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..app.composition import load_app
from ..clients.pki import PkiClient
from ..config import load_settings
from ..core.errors import BcError
from ..logging import configure_logging, get_logger
from ..service.client import ApiClient
from ..wire import Subjects
from .identity import Enrollment, enroll, load_enrollment, save_enrollment
from .runner import Agent, Command, CommandHandler, CommandRejected, connect_waiting

__all__ = ["SimAgent", "join_agent", "main", "sim_handlers"]


async def join_agent(
    api: ApiClient,
    *,
    site_id: str,
    role: str = "site",
    node_id: str | None = None,
    tenant_id: str = "root",
) -> Enrollment:
    """Issue a single-use join token through bc-pki and join with it (tests and demos)."""
    pki = PkiClient(api)
    token = await pki.issue_join_token(
        tenant_id=tenant_id,
        role=role,  # type: ignore[arg-type]
        site_id=site_id,
        ttl_seconds=600,
        node_id=node_id,
    )
    return await enroll(pki, token=token.token)


def sim_handlers(
    kinds: list[str],
    *,
    exec_log: Path | None = None,
    delays_ms: Mapping[str, int] | None = None,
    fail: frozenset[str] = frozenset(),
    reject: frozenset[str] = frozenset(),
    answers: Mapping[str, Any] | None = None,
    crash: Mapping[str, str] | None = None,
    crash_marker: Path | None = None,
) -> dict[str, CommandHandler]:
    """Handlers that answer every kind in ``kinds`` as described in the module's docstring."""
    delays = dict(delays_ms or {})
    crashes = dict(crash or {})

    def record(command: Command) -> None:
        if exec_log is None:
            return
        with open(exec_log, "a") as fh:
            fh.write(f"{command.id} {command.kind}\n")
            fh.flush()
            os.fsync(fh.fileno())

    async def handle(command: Command) -> Any:
        record(command)
        if crashes.get(command.kind) == "started" and _first_crash(crash_marker):
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(delays.get(command.kind, 0) / 1000)
        if command.kind in reject:
            raise CommandRejected("sim-rejects-this-kind")
        if command.kind in fail:
            raise RuntimeError("sim fails this kind")
        if answers and command.kind in answers:
            return answers[command.kind]
        return {"ok": True, "kind": command.kind, "commandId": command.id}

    return dict.fromkeys(kinds, handle)


def _first_crash(marker: Path | None) -> bool:
    """True the first time only (the marker file remembers across restarts)."""
    if marker is None or marker.exists():
        return False
    marker.write_text("crashed\n")
    return True


class SimAgent(Agent):
    """An ``Agent`` that can die between recording a result and reporting it."""

    def __init__(
        self,
        *,
        crash: Mapping[str, str] | None = None,
        crash_marker: Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._crash = dict(crash or {})
        self._crash_marker = crash_marker

    async def _report_entry(self, command_id: str) -> bool:
        entry = self.journal.get(command_id) if self.journal is not None else None
        if (
            entry is not None
            and entry.state == "finished"
            and self._crash.get(entry.kind) == "executed"
            and _first_crash(self._crash_marker)
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        return await super()._report_entry(command_id)


def _pairs(values: list[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values or []:
        kind, sep, rest = value.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes KIND=VALUE, got {value!r}")
        out[kind] = rest
    return out


async def _main(args: argparse.Namespace) -> None:
    subjects = Subjects(root=args.subject_root)
    state = Path(args.state_dir)
    enrollment_file = state / "enrollment.json"
    enrollment = args.enrollment
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    nc = await connect_waiting(args.nats_url, name="bc-agent-sim", log=get_logger(agent="sim"), stop=stop)
    try:
        if enrollment is None:
            token = args.token or os.environ.get("BC_JOIN_TOKEN")
            if not token:
                raise SystemExit("not enrolled yet: give --token or BC_JOIN_TOKEN")
            enrollment = await enroll(PkiClient(ApiClient(nc, subjects)), token=token)
            save_enrollment(enrollment_file, enrollment)
        crash = _pairs(args.crash, "--crash")
        handlers = sim_handlers(
            sorted(load_app(args.app).command_kinds),
            exec_log=Path(args.exec_log) if args.exec_log else state / "exec.log",
            delays_ms={k: int(v) for k, v in _pairs(args.delay, "--delay").items()},
            fail=frozenset(args.fail or ()),
            answers={k: json.loads(v) for k, v in _pairs(args.answer, "--answer").items()},
            reject=frozenset(args.reject or ()),
            crash=crash,
            crash_marker=state / "crashed",
        )
        agent = SimAgent(
            enrollment=enrollment,
            handlers=handlers,
            journal=state / "journal.db",
            nc=nc,
            subjects=subjects,
            crash=crash,
            crash_marker=state / "crashed",
            sign_results=False if args.unsigned else None,
            **({"fetch_timeout": args.fetch_timeout} if args.fetch_timeout else {}),
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.request_stop)
        async with agent:
            await agent.run()
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bc-agent-sim", description=__doc__)
    try:
        settings = load_settings()  # bc.toml and BC_* variables, as every process; flags win
    except BcError as err:
        raise SystemExit(f"bc-agent-sim: {err}") from None
    parser.add_argument("--nats-url", default=settings.nats_url, required=False)
    parser.add_argument("--subject-root", default=settings.subject_root)
    parser.add_argument("--app", default=settings.app)
    parser.add_argument("--state-dir", required=True, help="enrollment, journal and logs")
    parser.add_argument("--token", help="join token, used once when not enrolled yet")
    parser.add_argument("--exec-log", help="append each execution here")
    parser.add_argument("--delay", action="append", help="KIND=MS")
    parser.add_argument("--fail", action="append", help="KIND")
    parser.add_argument("--reject", action="append", help="KIND")
    parser.add_argument("--crash", action="append", help="KIND=started|executed (once)")
    parser.add_argument("--answer", action="append", help="KIND=JSON: answer those commands with JSON")
    parser.add_argument("--unsigned", action="store_true", help="a node agent that does not sign its results")
    parser.add_argument(
        "--fetch-timeout", type=float, help="seconds one idle pull waits for a command (Agent.fetch_timeout)"
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if not args.nats_url:
        parser.error("--nats-url (or BC_NATS_URL) is required")
    configure_logging(level=args.log_level)
    Path(args.state_dir).mkdir(parents=True, exist_ok=True)
    try:
        args.enrollment = load_enrollment(Path(args.state_dir) / "enrollment.json")
        asyncio.run(_main(args))
    except BcError as err:
        print(f"bc-agent-sim: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
