"""A control-plane step waiting on its command (``CommandNotReady``) and the memo of an attempt's
earlier runs (``bc_engine.steps.memo``): a step runner with a fake host and fake clients, no
services."""

from __future__ import annotations

import datetime as dt
import pickle
import time
from types import SimpleNamespace
from typing import Any

import pytest

from bc_engine.core.outcomes import Fail, Ok, Wait
from bc_engine.steps.context import StepCommands
from bc_engine.steps.memo import MAX_MEMO_RESULT, AttemptMemo, AttemptMemos
from bc_engine.steps.runners import run_control_plane
from bc_engine.store import StepRow, WorkflowRow
from bc_engine.why import WhyApi
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import CommandNotReady, StepNotReady, await_command, step_not_ready
from better_compute.provision.commands import COMMAND_POLL_MS
from better_compute.wire.cmdq import CommandView, EnqueueCommand
from better_compute.wire.pki import IssuedJoinToken
from better_compute.wire.secrets import SecretInfo

KEY = "wf:wf_1:0#1"


def view(key: str, state: str, *, kind: str = "power.setPower", result: bytes | None = None) -> CommandView:
    return CommandView(
        id=f"cmd_{key.rsplit(':', 1)[-1]}", node_id="node_1", site_id="lab", kind=kind, key=key,
        state=state, result=result,  # type: ignore[arg-type]
    )  # fmt: skip


# -- CommandNotReady -----------------------------------------------------------------------


def test_command_not_ready_is_a_step_not_ready_of_the_command_poll_that_names_its_command() -> None:
    nr = CommandNotReady(COMMAND_POLL_MS, command_id="cmd_1", key=KEY, kind="power.setPower", state="running")
    assert isinstance(nr, StepNotReady)
    assert (nr.retry_after_ms, nr.reason) == (2000, None)
    back = pickle.loads(pickle.dumps(nr))
    assert isinstance(back, CommandNotReady)
    assert (back.command_id, back.key, back.kind, back.state, back.retry_after_ms) == (
        "cmd_1", KEY, "power.setPower", "running", 2000,
    )  # fmt: skip


async def test_await_command_raises_command_not_ready_while_its_command_is_live() -> None:
    class Commands:
        def __init__(self, state: str) -> None:
            self.state = state

        async def enqueue(self, command: EnqueueCommand) -> CommandView:
            return view(command.key, self.state)

        async def site_agent_for(self, node_id: str) -> str | None:
            return None

    node = SimpleNamespace(id="node_1", tenant_id="root", site_id="lab", labels={})
    ctx = SimpleNamespace(workflow_id="wf_1", step=0, attempt=1, node=node, batch_id=None,
                          commands=Commands("dispatched"))  # fmt: skip
    with pytest.raises(CommandNotReady) as raised:
        await await_command(ctx, node_id="node_1", kind="power.setPower", payload={}, key="p")
    assert (raised.value.command_id, raised.value.key, raised.value.state) == (
        "cmd_p",
        f"{KEY}:p",
        "dispatched",
    )
    assert raised.value.retry_after_ms == COMMAND_POLL_MS
    ctx.commands = Commands("succeeded")
    done = await await_command(
        ctx, node_id="node_1", kind="power.setPower", payload={"action": "on"}, key="p"
    )
    assert done["command_id"] == "cmd_p"


# -- the memo ---------------------------------------------------------------------------


def test_the_memo_keeps_one_attempt_per_workflow_least_recently_used_out() -> None:
    memos = AttemptMemos(limit=2)
    first = memos.of("wf_1", 0, 1)
    first.mint_secret = b"s"
    assert memos.of("wf_1", 0, 1) is first
    # another attempt of the workflow (a retry) starts empty and replaces it
    retried = memos.of("wf_1", 0, 2)
    assert retried is not first
    assert retried.mint_secret is None
    memos.of("wf_2", 3, 1)
    memos.of("wf_1", 0, 2)  # used: wf_2 is now the least recent
    memos.of("wf_3", 0, 1)
    assert len(memos) == 2
    assert memos.of("wf_1", 0, 2) is retried
    memos.drop("wf_1")
    assert memos.of("wf_1", 0, 2) is not retried


def test_the_memo_keeps_only_commands_that_ended_and_small_results() -> None:
    memo = AttemptMemo(workflow_id="wf_1", step=0, attempt=1)
    memo.keep_command("node_1", view(f"{KEY}:a", "running"))
    memo.keep_command("node_1", view(f"{KEY}:b", "succeeded", result=b"{}"))
    memo.keep_command("node_1", view(f"{KEY}:c", "failed"))
    memo.keep_command("node_1", view(f"{KEY}:d", "succeeded", result=b"x" * (MAX_MEMO_RESULT + 1)))
    assert memo.command("node_1", f"{KEY}:a", "power.setPower") is None
    assert memo.command("node_1", f"{KEY}:b", "power.setPower") is not None
    assert memo.command("node_1", f"{KEY}:c", "power.setPower") is not None
    assert memo.command("node_1", f"{KEY}:d", "power.setPower") is None
    assert memo.command("node_2", f"{KEY}:b", "power.setPower") is None  # another node's
    assert memo.command("node_1", f"{KEY}:b", "netboot.setEntry") is None  # another kind: asked


# -- a fake host for run_control_plane -------------------------------------------------------


class FakePki:
    for_step = PkiClient.for_step

    def __init__(self) -> None:
        self.issued: list[tuple[str | None, bytes | None]] = []

    async def issue_join_token(self, **kw: Any) -> IssuedJoinToken:
        self.issued.append((kw["idempotency_key"], kw["mint_secret"]))
        return IssuedJoinToken(
            join_token_id="tok_1", token="s3cret", tenant_id="root", role="node", site_id="lab", max_uses=1,
            expires_at=dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
        )  # fmt: skip


class FakeSecrets:
    for_step = SecretsClient.for_step

    def __init__(self) -> None:
        self.puts: list[str | None] = []

    async def put(self, **kw: Any) -> SecretInfo:
        self.puts.append(kw["idempotency_key"])
        return SecretInfo(
            ref=f"sec_{len(self.puts)}", tenant_id="root", workflow_id="wf_1", step=0, size=1, key_id="k",
            created_at=dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
        )  # fmt: skip


class FakeHost:
    """The little of ``StepHost`` a control-plane step's run uses; the command queue is a dict
    of command states by key, the settles and waits are recorded."""

    def __init__(self, run: Any) -> None:
        self.app = SimpleNamespace(steps={"test.step": SimpleNamespace(run=run)}, provision=None,
                                   command_kinds={})  # fmt: skip
        self.log = SimpleNamespace(bind=lambda **_: SimpleNamespace(exception=lambda *a, **k: None,
                                                                    debug=lambda *a, **k: None))  # fmt: skip
        self.db = SimpleNamespace(pool=None)
        self.pki, self.secrets = FakePki(), FakeSecrets()
        self.memos = AttemptMemos()
        self.start_in = None
        self.wake = None
        self.states: dict[str, str] = {}
        self.enqueued: list[str] = []
        self.read: list[str] = []  # commands read by id (``sent_command``)
        self.minted: list[str] = []
        self.waits: list[tuple[str | None, Any]] = []
        self.step_waits: list[Any] = []

    async def node(self, wf: WorkflowRow) -> None:
        return None

    async def profile(self, wf: WorkflowRow) -> None:
        return None

    async def mark_minted(self, workflow_id: str, idx: int, attempt: int, service: str) -> bytes:
        self.minted.append(service)
        return b"mint-secret"

    async def mark_sent(self, workflow_id: str, idx: int, attempt: int) -> None:
        pass

    def needs_node(self, kind: str, payload: Any) -> bool:
        return False

    async def in_batch(self, wf: WorkflowRow, kind: str) -> bool:
        return False

    async def enqueue(self, cmd: EnqueueCommand) -> CommandView:
        self.enqueued.append(cmd.key)
        return view(cmd.key, self.states.setdefault(cmd.key, "pending"), kind=cmd.kind)

    async def sent_command(self, command_id: str, cmd: EnqueueCommand) -> CommandView | None:
        self.read.append(cmd.key)
        found = view(cmd.key, self.states[cmd.key], kind=cmd.kind)
        return found if found.id == command_id else None

    async def command_settled(self, *args: Any) -> None:
        pass

    async def waiting_command(
        self, wf: WorkflowRow, step: StepRow, command_id: str | None, what: Any
    ) -> None:
        self.waits.append((command_id, what))
        step.command_id, step.waiting_for = command_id, what

    async def waiting(self, wf: WorkflowRow, step: StepRow, what: Any) -> None:
        self.step_waits.append(what)
        step.waiting_for = what


def rows(attempt: int = 1) -> tuple[WorkflowRow, StepRow]:
    wf = WorkflowRow(
        id="wf_1", tenant_id="root", node_id=None, rkey="wf_1", profile_tenant="root", profile_id="p",
        profile_version=1, state="running", owner=None, command_kinds=[], batch_id=None,
        cancel_commands=False,
    )  # fmt: skip
    now = dt.datetime.now(dt.UTC)
    step = StepRow(
        workflow_id="wf_1", idx=0, action="test.step", runs_on="control-plane", mode="control-plane",
        command=None, input={}, timeout_ms=60_000, state="running", attempt=attempt, started_at=now,
        deadline=now + dt.timedelta(minutes=1), finished_at=None,
    )  # fmt: skip
    return wf, step


async def send(ctx: Any, name: str) -> CommandView:
    """What await_command does, without a node: find-or-create, not ready while live."""
    got: CommandView = await ctx.commands.enqueue(
        EnqueueCommand(
            node_id="node_1",
            site_id="lab",
            kind="power.setPower",
            payload={},
            key=f"{ctx.idempotency_key}:{name}",
            target="site",
        )
    )
    if got.state != "succeeded":
        raise CommandNotReady(COMMAND_POLL_MS, command_id=got.id, key=got.key, kind=got.kind, state=got.state)
    return got


async def three_in_sequence(_input: Any, ctx: Any) -> dict[str, Any]:
    token = await ctx.pki.issue_join_token(tenant_id="root", role="node", site_id="lab", ttl_seconds=60)
    ref = await ctx.secrets.put(token.token.encode(), idempotency_key="token")
    for name in ("a", "b", "c"):
        await send(ctx, name)
    return {"ref": ref}


async def test_a_step_waiting_on_its_command_waits_until_its_deadline_and_says_which() -> None:
    host = FakeHost(three_in_sequence)
    wf, step = rows()
    deadline = time.time() + 60
    out = await run_control_plane(host, wf, step, deadline)  # type: ignore[arg-type]
    assert _command_wait(out, deadline)  # not COMMAND_POLL_MS: the command's end wakes it
    assert host.waits == [("cmd_a", {"reason": "command", "commandId": "cmd_a", "kind": "power.setPower"})]
    assert step.command_id == "cmd_a"
    # woken while it still runs (a lost race, the safety net): nothing written again
    assert _command_wait(await run_control_plane(host, wf, step, deadline), deadline)  # type: ignore[arg-type]
    assert len(host.waits) == 1
    host.states[f"{KEY}:a"] = "succeeded"
    assert _command_wait(await run_control_plane(host, wf, step, deadline), deadline)  # type: ignore[arg-type]
    assert [c for c, _ in host.waits] == ["cmd_a", "cmd_b"]
    host.states[f"{KEY}:b"] = host.states[f"{KEY}:c"] = "succeeded"
    out = await run_control_plane(host, wf, step, deadline)  # type: ignore[arg-type]
    assert out == Ok({"ref": "sec_1"}, '{"ref":"sec_1"}')
    # each command enqueued once, read by its id on each later run until it ended, then never
    assert host.enqueued == [f"{KEY}:a", f"{KEY}:b", f"{KEY}:c"]
    assert host.read == [f"{KEY}:a", f"{KEY}:a", f"{KEY}:b"]
    # the token, the secret and the marks once for the four runs of the attempt
    assert host.pki.issued == [(KEY, b"mint-secret")]
    assert host.secrets.puts == [f"{KEY}:token"]
    assert host.minted == ["pki", "secrets"]
    assert len(host.memos) == 0  # the attempt settles: its memo is gone


async def test_a_steps_own_not_ready_keeps_its_ms_and_stops_the_command_wait() -> None:
    calls = 0

    async def command_then_poll(_input: Any, ctx: Any) -> None:
        nonlocal calls
        calls += 1
        await send(ctx, "a")
        raise step_not_ready(500, reason="waiting for the lamp")

    host = FakeHost(command_then_poll)
    wf, step = rows()
    deadline = time.time() + 60
    assert _command_wait(await run_control_plane(host, wf, step, deadline), deadline)  # type: ignore[arg-type]
    host.states[f"{KEY}:a"] = "succeeded"
    before = time.time()
    out = await run_control_plane(host, wf, step, deadline)  # type: ignore[arg-type]
    assert isinstance(out, Wait)
    assert before + 0.5 <= out.at < deadline
    assert host.waits[-1] == (None, None)  # the command watch no longer wakes it for cmd_a
    assert host.step_waits == [{"reason": "step-not-ready", "message": "waiting for the lamp"}]
    assert step.command_id is None


async def test_a_command_of_another_attempt_is_an_ordinary_not_ready() -> None:
    async def foreign(_input: Any, _ctx: Any) -> None:
        raise CommandNotReady(COMMAND_POLL_MS, command_id="cmd_x", key="wf:wf_1:0#7:a", kind="power.setPower")

    host = FakeHost(foreign)
    wf, step = rows()
    before = time.time()
    out = await run_control_plane(host, wf, step, time.time() + 60)  # type: ignore[arg-type]
    assert isinstance(out, Wait)
    assert before + COMMAND_POLL_MS / 1000 <= out.at < before + 10
    assert host.waits == []


async def test_a_failed_attempt_drops_its_memo_and_the_next_attempt_asks_afresh() -> None:
    async def mint_then_fail(_input: Any, ctx: Any) -> None:
        await ctx.pki.issue_join_token(tenant_id="root", role="node", site_id="lab", ttl_seconds=60)
        raise BcError(ErrorCode.CONFLICT, "no", {"path": "x"})

    host = FakeHost(mint_then_fail)
    wf, step = rows(attempt=1)
    assert isinstance(await run_control_plane(host, wf, step, time.time() + 60), Fail)  # type: ignore[arg-type]
    assert len(host.memos) == 0
    wf, step = rows(attempt=2)
    await run_control_plane(host, wf, step, time.time() + 60)  # type: ignore[arg-type]
    assert host.pki.issued == [(KEY, b"mint-secret"), ("wf:wf_1:0#2", b"mint-secret")]
    assert host.minted == ["pki", "pki"]


async def test_a_token_key_used_twice_in_one_run_is_still_refused_with_a_memo() -> None:
    async def twice(_input: Any, ctx: Any) -> None:
        await ctx.pki.issue_join_token(tenant_id="root", role="node", site_id="lab", ttl_seconds=60)
        await send(ctx, "a")

    host = FakeHost(twice)
    wf, step = rows()
    await run_control_plane(host, wf, step, time.time() + 60)  # type: ignore[arg-type]
    pki = host.pki.for_step(idempotency_key=KEY, issued=host.memos.of("wf_1", 0, 1).tokens)
    first = await pki.issue_join_token(tenant_id="root", role="node", ttl_seconds=60)
    assert first.token == "s3cret"
    assert len(host.pki.issued) == 1
    with pytest.raises(BcError) as raised:
        await pki.issue_join_token(tenant_id="root", role="node", ttl_seconds=60)
    assert raised.value.details["reason"] == "idempotency-key-reused"


async def test_a_secret_is_found_again_only_for_the_same_key_and_value() -> None:
    secrets = FakeSecrets()
    stored: dict[tuple[str, str], str] = {}

    def run() -> Any:
        return secrets.for_step(tenant_id="root", workflow_id="wf_1", step=0, attempt=1, stored=stored)

    assert await run().put(b"v1", idempotency_key="k") == "sec_1"
    assert await run().put(b"v1", idempotency_key="k") == "sec_1"
    assert secrets.puts == [f"{KEY}:k"]
    await run().put(b"v2", idempotency_key="k")  # another value: the service says what it is
    await run().put(b"v1")  # unkeyed: stored anew each time, as without a memo
    await run().put(b"v1")
    assert len(secrets.puts) == 4


async def test_step_commands_answer_an_ended_command_from_the_memo() -> None:
    host = FakeHost(three_in_sequence)
    wf, step = rows()
    memo = host.memos.of("wf_1", 0, 1)
    commands = StepCommands(host, workflow=wf, step=step, memo=memo)  # type: ignore[arg-type]
    cmd = EnqueueCommand(node_id="node_1", site_id="lab", kind="power.setPower", payload={}, key=f"{KEY}:a")
    host.states[f"{KEY}:a"] = "succeeded"
    first = await commands.enqueue(cmd)
    again = await StepCommands(host, workflow=wf, step=step, memo=memo).enqueue(cmd)  # type: ignore[arg-type]
    assert again == first
    assert host.enqueued == [f"{KEY}:a"]
    bad = EnqueueCommand(
        node_id="node_1", site_id="lab", kind="power.setPower", payload={}, key="wf:other:0#1"
    )
    assert (await _refused(commands.enqueue(bad))).code == ErrorCode.INVALID_INPUT  # the key check first


async def _refused(call: Any) -> BcError:
    with pytest.raises(BcError) as raised:
        await call
    return raised.value


def test_not_ready_alone_is_unchanged() -> None:
    nr = step_not_ready(700, reason="x")
    assert type(nr) is StepNotReady
    assert nr.retry_after_ms == 700


def test_why_says_which_command_a_control_plane_step_waits_for() -> None:
    part = WhyApi._waiting_for({"reason": "command", "commandId": "cmd_1", "kind": "power.setPower"})
    assert part.kind == "command-wait"
    assert part.text == "the step waits for its command power.setPower cmd_1 to end"
    assert part.facts == {"commandId": "cmd_1", "kind": "power.setPower"}


def _command_wait(out: object, deadline: float) -> bool:
    """The wait of a step on its command: its deadline (its command's end wakes it, the command
    watch is the net), never a periodic re-run."""
    return isinstance(out, Wait) and out.at == pytest.approx(deadline, abs=2)


async def test_a_command_read_by_id_counts_only_when_it_is_the_one_the_run_would_enqueue() -> None:
    from bc_engine.steps.host import StepHost

    class Cmdq:
        async def get(self, *, id: str) -> CommandView:
            if id == "cmd_gone":
                raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "id"})
            return view(f"{KEY}:a", "running")  # id cmd_a

    host = object.__new__(StepHost)
    host.cmdq = Cmdq()  # type: ignore[assignment]

    def cmd(key: str, kind: str = "power.setPower", node_id: str = "node_1") -> EnqueueCommand:
        return EnqueueCommand(node_id=node_id, site_id="lab", kind=kind, payload={}, key=key, target="site")

    found = await host.sent_command("cmd_a", cmd(f"{KEY}:a"))
    assert found is not None
    assert found.state == "running"
    # another attempt's key, another kind, another node, a gone id: enqueue as before
    assert await host.sent_command("cmd_a", cmd("wf:wf_1:0#2:a")) is None
    assert await host.sent_command("cmd_a", cmd(f"{KEY}:a", kind="media.eject")) is None
    assert await host.sent_command("cmd_a", cmd(f"{KEY}:a", node_id="node_2")) is None
    assert await host.sent_command("cmd_gone", cmd(f"{KEY}:a")) is None


async def test_once_reads_at_the_attempts_first_run_and_again_in_the_next_attempt() -> None:
    """``ctx.once``: the runs of one attempt share what its first run read (issue 25: a step
    waiting on its commands runs again at each one's end); a new attempt reads again."""
    reads: list[int] = []

    async def read() -> int:
        reads.append(len(reads))
        return len(reads)

    async def waits_then_ends(_input: Any, ctx: Any) -> dict[str, int]:
        got = await ctx.once("the-read", read)
        if len(host.runs) < 3:
            host.runs.append(got)
            raise step_not_ready(10, reason="waiting")
        return {"got": got}

    host = FakeHost(waits_then_ends)
    host.runs = []
    wf, step = rows(attempt=1)
    for _ in range(3):
        assert isinstance(await run_control_plane(host, wf, step, time.time() + 60), Wait)  # type: ignore[arg-type]
    done = await run_control_plane(host, wf, step, time.time() + 60)  # type: ignore[arg-type]
    assert isinstance(done, Ok)
    assert done.result == {"got": 1}
    assert host.runs == [1, 1, 1]
    assert len(reads) == 1
    wf, step = rows(attempt=2)
    host.runs = [0, 0, 0]
    done = await run_control_plane(host, wf, step, time.time() + 60)  # type: ignore[arg-type]
    assert isinstance(done, Ok)
    assert done.result == {"got": 2}
