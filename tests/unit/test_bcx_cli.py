"""bcx's argument parsing and time formatting (pure: no services)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from better_compute.cli.main import build_parser
from better_compute.cli.output import iso, with_iso_times
from better_compute.config import Settings
from better_compute.runtime.dev import DevStack

URL = "nats://127.0.0.1:4999"


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "--nats-url", URL, "nodes", "list"],
        ["nodes", "--json", "list", "--nats-url", URL],
        ["nodes", "list", "--json", f"--nats-url={URL}"],
        ["--nats-url", URL, "nodes", "list", "--json"],
    ],
    ids=["before", "between", "after", "split"],
)
def test_global_flags_anywhere_on_the_line(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.json, args.nats_url, args.nodes_command) == (True, URL, "list")


def test_global_flags_default_when_absent() -> None:
    args = build_parser().parse_args(["status"])
    assert (args.json, args.nats_url, args.config, args.state_dir, args.subject_root) == (
        False, None, None, None, None,
    )  # fmt: skip


def test_a_global_flag_after_the_subcommand_is_not_overridden_by_a_default() -> None:
    args = build_parser().parse_args(["--state-dir", "/s", "dev", "ps"])
    assert args.state_dir == "/s"


def test_times_are_iso_8601_utc_to_the_second() -> None:
    want = "2026-12-01T06:30:00Z"
    moment = datetime(2026, 12, 1, 6, 30, 0, 123456, tzinfo=UTC)
    assert iso(moment) == want
    assert iso(moment.astimezone(timezone(timedelta(hours=2)))) == want
    assert iso(moment.timestamp()) == want
    assert iso("2026-12-01T06:30:00.123456+00:00") == want
    assert iso("2026-12-01T06:30:00.123456789Z") == want  # NATS micro's `started`
    assert iso(None) is None
    assert iso("soon") == "soon"


def test_json_documents_carry_iso_times() -> None:
    doc = {
        "id": "x",
        "createdAt": 1796106600.5,
        "lastSeen": 1796106600,
        "expiresAtMs": 1796106600000,
        "steps": [{"startedAt": "2026-12-01T06:30:00.5+00:00", "deadline": None, "attempt": 1}],
    }
    assert with_iso_times(doc) == {
        "id": "x",
        "createdAt": "2026-12-01T06:30:00Z",
        "lastSeen": "2026-12-01T06:30:00Z",
        "expiresAt": "2026-12-01T06:30:00Z",
        "steps": [{"startedAt": "2026-12-01T06:30:00Z", "deadline": None, "attempt": 1}],
    }


def test_a_failed_start_names_the_log_and_shows_its_end_without_passwords(tmp_path: Path) -> None:
    stack = DevStack(Settings(state_dir=str(tmp_path)))
    stack.logs.mkdir(parents=True)
    lines = [f"line {n}" for n in range(30)] + [
        "asyncpg.InvalidPasswordError: postgresql://bc:hunter2-pw@127.0.0.1:5499/bc refused",
        "ModuleNotFoundError: No module named 'no_such_plugin_module'",
    ]
    (stack.logs / "bc-engine-1.log").write_text("\n".join(lines) + "\n")
    said = stack.start_failure("bc-engine-1", "exited at start")
    assert said.startswith(f"bc-engine-1 exited at start; its log is {stack.logs / 'bc-engine-1.log'}")
    assert said.endswith("  | ModuleNotFoundError: No module named 'no_such_plugin_module'")
    assert "line 19" not in said  # only the end of it
    assert "line 20" in said
    assert "postgresql://127.0.0.1:5499/bc" in said
    assert "hunter2" not in said


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["nodes", "list", "--bogus"], "bcx nodes list"),
        (["workflows", "retry", "wf_1", "--nope"], "bcx workflows retry"),
        (["status", "extra"], "bcx status"),
    ],
)
def test_an_unknown_argument_is_reported_with_the_subcommands_own_usage(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from better_compute.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ")
    assert f"{usage}: error: unrecognized arguments: {argv[-1]}" in err


def test_every_flag_and_argument_of_every_command_has_help_text() -> None:
    import argparse

    from better_compute.cli.main import _subparsers

    parser = build_parser()
    missing = [
        f"{p.prog} {a.option_strings or a.dest}"
        for p in [parser, *_subparsers(parser)]
        for a in p._actions  # argparse offers no public walk of its tree
        if a.help is None and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    ]
    assert missing == []


def test_a_yaml_profile_reads_as_its_author_means_it(tmp_path: Path) -> None:
    from better_compute.cli.common import read_document
    from better_compute.core.errors import BcError

    doc = tmp_path / "p.yaml"
    doc.write_text(
        "id: acme.reboot\nversion: 1\ntarget: metal\nsteps:\n"
        "  - use: power.setPower\n    on: site\n    with: {action: off}\n"
        "  - use: power.setPower\n    with: {action: on, force: true}\n"
        "released: 2026-01-02\n"
    )
    got = read_document(str(doc))
    # YAML 1.2: `off`, `on` and keys named `on` stay strings; only true/false are booleans
    assert got["steps"][0] == {"use": "power.setPower", "on": "site", "with": {"action": "off"}}
    assert got["steps"][1]["with"] == {"action": "on", "force": True}
    assert got["released"] == "2026-01-02"
    bad = tmp_path / "bad.yml"
    bad.write_text("steps: [\n")
    with pytest.raises(BcError) as e:
        read_document(str(bad))
    assert (e.value.code.value, e.value.path) == ("INVALID_INPUT", "file")


def _tree(parser: object) -> dict[str, str]:
    """Every parser of ``parser``'s tree by its prog, as its help text."""
    from better_compute.cli.main import _subparsers

    return {p.prog: p.format_help() for p in [parser, *_subparsers(parser)]}  # type: ignore[list-item]


def test_the_lazy_command_table_is_what_the_modules_register() -> None:
    import argparse

    from better_compute.cli.main import LAZY_COMMANDS

    full = build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    names = list(sub.choices)
    lazy = [name for _, commands in LAZY_COMMANDS for name, _ in commands]
    # the table's commands stand where the modules put them, with the same help
    assert names[names.index(lazy[0]) : names.index(lazy[-1]) + 1] == lazy
    assert {name: helps[name] for name in lazy} == {n: h for _, cs in LAZY_COMMANDS for n, h in cs}
    # and `bcx --help` (only stand-ins) says exactly what it says with every command registered
    assert build_parser(["--help"]).format_help() == full.format_help()


@pytest.mark.parametrize("command", ["nodes", "inspect", "why", "commands", "sim", "status", "context"])
def test_a_command_built_alone_has_its_whole_tree_with_every_flag(command: str) -> None:
    full = _tree(build_parser())
    alone = _tree(build_parser([command, "--help"]))
    mine = {prog: text for prog, text in full.items() if prog.startswith(f"bcx {command}")}
    assert mine
    assert {prog: alone.get(prog) for prog in mine} == mine


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        ([], None),
        (["--help"], None),
        (["nodes", "list"], "nodes"),
        (["--json", "-o", "yaml", "--context", "lab", "nodes"], "nodes"),
        (["--output=json", "-ojson", "--nats-url", URL, "why", "n1"], "why"),
        (["--nats", URL, "nodes"], "?"),  # an abbreviation: argparse decides
    ],
)
def test_the_command_word_is_found_past_the_global_flags(argv: list[str], word: str | None) -> None:
    from better_compute.cli.main import command_word

    assert command_word(argv) == word


def test_a_line_the_quick_look_misreads_still_parses_as_its_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from better_compute.cli import main as bcx

    monkeypatch.setattr(bcx, "command_word", lambda _argv: "version")  # misread on purpose
    _, args, unknown = bcx.parse_line(["--nats", URL, "nodes", "list", "--json"])
    assert (args.command, args.nodes_command, args.nats_url, args.json, unknown) == (
        "nodes",
        "list",
        URL,
        True,
        [],
    )
    assert args.func.__module__ == "better_compute.cli.engine_commands"


def test_the_quick_look_knows_every_global_flag_and_whether_it_takes_a_value() -> None:
    import argparse

    from better_compute.cli.main import _BARE_FLAGS, _VALUE_FLAGS, _global_flags

    parser = argparse.ArgumentParser()
    _global_flags(parser, defaults=True)
    flags = [a for a in parser._actions if a.option_strings]
    assert {s for a in flags if a.nargs == 0 for s in a.option_strings} == _BARE_FLAGS
    assert {s for a in flags if a.nargs != 0 for s in a.option_strings} == _VALUE_FLAGS


def test_an_error_with_several_problems_prints_every_one(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26: a document's problems all show in one run, each with its path."""
    from better_compute.cli.output import print_error
    from better_compute.core.errors import BcError
    from better_compute.provision import profile_from_document

    doc = {"id": "acme.x", "version": 1, "target": "metal", "role": "host", "descripton": "typo",
           "steps": [{"use": "acme.a", "wiht": {}}, {"use": "acme.b", "on": "moon"}]}  # fmt: skip
    with pytest.raises(BcError) as e:
        profile_from_document(doc)
    print_error(e.value.with_path_prefix("document"), as_json=False)
    assert capsys.readouterr().err.splitlines() == [
        "error: INVALID_CONFIG: unknown field; did you mean description? (at document.descripton)",
        "  also: INVALID_CONFIG: unknown field; did you mean with? (at document.steps[0].wiht)",
        "  also: INVALID_CONFIG: on must be one of control-plane, site, node, got 'moon'"
        " (at document.steps[1].on)",
    ]


def _approve_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, answer: str, tty: bool) -> list[str]:
    """``bcx batches approve`` against a command queue in memory; returns the approvals sent."""
    import contextlib
    import io
    import sys

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from better_compute.cli import cmdq_commands
    from better_compute.core.errors import BcError, ErrorCode
    from better_compute.crypto import batch_document
    from better_compute.wire.cmdq import BatchView

    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "k.pem").write_bytes(pem)
    scope = {"batch_id": "batch_1", "tenant_id": "root", "kinds": ["node.wipe"], "nodes": ["node_1"],
             "expires_at_ms": 4_000_000_000_000, "workflow_id": "wf_1"}  # fmt: skip
    batch = BatchView(
        id="batch_1", tenant_id="root", kinds=["node.wipe"], nodes=["node_1"], workflow_id="wf_1",
        state="open", threshold=2, created_at=0.0, expires_at_ms=scope["expires_at_ms"],
        document=batch_document(**scope),
    )  # fmt: skip
    sent: list[str] = []

    class Queue:
        def __init__(self, _api: object) -> None:
            pass

        async def get_batch(self, *, id: str) -> BatchView:
            return batch

        async def approve_batch(self, *, batch_id: str, approver_id: str, signature: bytes) -> BatchView:
            sent.append(approver_id)
            return batch

    class Engine:
        def __init__(self, _api: object) -> None:
            pass

        async def get_workflow(self, *, id: str) -> object:
            raise BcError(ErrorCode.UNAVAILABLE, "no bc-engine instance is running")

    @contextlib.asynccontextmanager
    async def api_client(_settings: object):  # type: ignore[no-untyped-def]
        yield object()

    monkeypatch.setattr(cmdq_commands, "api_client", api_client)
    monkeypatch.setattr(cmdq_commands, "CommandQueueClient", Queue)
    monkeypatch.setattr(cmdq_commands, "EngineClient", Engine)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr(sys, "stdin", Tty(answer))
    monkeypatch.setattr(sys, "stderr", Tty())
    return sent


@pytest.mark.parametrize(
    ("answer", "tty", "flags", "signed"),
    [("n\n", True, [], False), ("y\n", True, [], True), ("", True, ["--yes"], True), ("", False, [], True)],
    ids=["terminal-no", "terminal-yes", "yes-flag", "script"],
)
def test_approve_shows_the_scope_and_asks_only_at_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    answer: str,
    tty: bool,
    flags: list[str],
    signed: bool,
) -> None:
    import asyncio

    from better_compute.core.errors import BcError

    sent = _approve_setup(monkeypatch, tmp_path, answer, tty)
    args = build_parser().parse_args(
        [
            "batches",
            "approve",
            "batch_1",
            "--approver",
            "alice",
            "--key-file",
            str(tmp_path / "k.pem"),
            *flags,
        ]
    )
    if signed:
        assert asyncio.run(args.func(args, Settings())) == 0
    else:
        with pytest.raises(BcError, match="not signed: the approver said no"):
            asyncio.run(args.func(args, Settings()))
    out = capsys.readouterr().out
    assert out.startswith("you sign batch batch_1 (open, 0/2):\n  tenant     root\n  kinds      node.wipe\n")
    assert "    wf_1\n" in out  # the engine could not say more: the id alone
    assert sent == (["alice"] if signed else [])
