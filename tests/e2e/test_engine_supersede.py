"""A new attempt of a step never overlaps the previous one: retry and resume wait for attempt N's
commands to end at the agent, cancel them on every node, fence attempt N's late enqueues, and
revoke the join tokens and secrets attempt N minted.

Executions are counted at the agent (its own exec log, start and end of every run), not from
the command queue's view.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from better_compute.agent import Agent, Command, Enrollment
from better_compute.agent.sim import join_agent
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.workflows import wait_workflow
from better_compute.wire import Subjects, unwrap
from better_compute.wire.agent import payload_digest
from better_compute.wire.cmdq import EnqueueCommand
from engine_stack import FAST, AgentStack, sim_bmc
from engine_test_app import create_tables

ROUNDS = int(os.environ.get("BC_SUPERSEDE_ROUNDS", "3"))  # of each verb; raise it for a longer sweep


@dataclass(frozen=True)
class Run:
    command_id: str
    key: str
    start: float
    end: float | None


class ExecLog:
    """The agent's own record: a line at the start and at the end of every execution.

    Commands of a first attempt (key ``…#1``) hold until ``release()``: a destructive
    operation that takes a while, still running when the operator retries or resumes.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.released = asyncio.Event()
        self.enrollment: Enrollment | None = None
        """The agent's enrollment: a second process with it may claim as the same agent."""

    def _write(self, what: str, command: Command) -> None:
        with open(self.path, "a") as fh:
            fh.write(f"{time.time():.6f} {what} {command.id} {command.key}\n")
            fh.flush()
            os.fsync(fh.fileno())

    async def handle(self, command: Command) -> dict[str, Any]:
        self._write("start", command)
        if command.key.endswith("#1"):
            await self.released.wait()
        else:
            await asyncio.sleep(0.2)
        self._write("end", command)
        return {"ok": True}

    def release(self) -> None:
        self.released.set()

    def hold(self) -> None:
        self.released = asyncio.Event()

    def runs(self) -> list[Run]:
        if not self.path.exists():
            return []
        starts: list[tuple[str, str, float]] = []
        ends: dict[str, list[float]] = {}
        for line in self.path.read_text().splitlines():
            at, what, command_id, key = line.split(" ")
            if what == "start":
                starts.append((command_id, key, float(at)))
            else:
                ends.setdefault(command_id, []).append(float(at))
        runs = []
        for command_id, key, at in starts:
            done = ends.get(command_id) or []
            runs.append(Run(command_id, key, at, done.pop(0) if done else None))
        return runs

    def started(self, key: str) -> bool:
        return any(r.key == key for r in self.runs())


def overlaps(runs: list[Run]) -> list[tuple[Run, Run]]:
    """Pairs of runs of the same workflow step (any attempts) that ran at the same time."""
    found = []
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            if a.key.split("#")[0] != b.key.split("#")[0]:
                continue
            a_end = a.end if a.end is not None else float("inf")
            b_end = b.end if b.end is not None else float("inf")
            if a.start < b_end and b.start < a_end:
                found.append((a, b))
    return found


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[AgentStack]:
    settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    await create_tables(bc_settings.database_url)
    bc_processes.settings = settings
    bc_processes.extra_env.update(
        FAST,
        BC_PKI_KEY_FILE=str(tmp_path / "pki.key"),
        BC_SECRETS_KEY_FILE=str(tmp_path / "secrets.key"),
    )
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    yield AgentStack(bc_api, settings, tmp_path)


@pytest_asyncio.fixture(loop_scope="session")
async def agent(stack: AgentStack, bc_subjects: Subjects, tmp_path: Path) -> AsyncIterator[ExecLog]:
    """A site agent of site ``lab1`` on the agent SDK, in this process, with its own exec log."""
    log = ExecLog(tmp_path / "exec.log")
    enrollment = await join_agent(stack.api, site_id="lab1")
    log.enrollment = enrollment
    agent = Agent(
        enrollment=enrollment,
        handlers={"driver.invoke": log.handle},
        journal=tmp_path / "journal.db",
        nats_url=stack.settings.nats_url,
        subjects=bc_subjects,
        stop_grace=0.5,
    )
    async with agent:
        task = asyncio.create_task(agent.run())
        await agent.ready.wait()
        yield log
        log.release()
        agent.request_stop()
        await asyncio.wait_for(task, 10)


async def _superseded_while_running(stack: AgentStack, log: ExecLog, wf_id: str) -> None:
    """Attempt 1 still runs at the agent, attempt 2 was asked for: until the step waits for
    attempt 1 (or, wrongly, attempt 2 started), then let attempt 1 end."""

    async def waits_or_overlaps() -> bool:
        step = await stack.step(wf_id)
        waiting = (step.waiting_for or {}).get("reason") == "previous-attempt-running"
        return waiting or log.started(f"wf:{wf_id}:0#2")

    await until(waits_or_overlaps)
    log.release()
    done = await wait_workflow(stack.api, wf_id, timeout=60)
    assert done.state == "succeeded", done
    assert done.steps[0].attempt == 2


MAC = "52:54:00:00:00:01"  # any driver operation: driver.invoke is destructive


async def test_retry_and_resume_never_overlap_a_destructive_command_still_running(
    stack: AgentStack, agent: ExecLog
) -> None:
    await stack.profile("erase", [{"use": "netboot.clearEntry", "on": "site", "with": {"mac": MAC}}])
    await stack.profile(
        "erase-slowly", [{"use": "netboot.clearEntry", "on": "site", "with": {"mac": MAC}, "timeout": "2s"}]
    )
    workflows = []
    for _ in range(ROUNDS):
        # abort -> resume while attempt 1's command runs at the agent
        agent.hold()
        node = await stack.engine.create_node(site_id="lab1", bmc=sim_bmc())
        wf_id = await stack.start("erase", node.id)
        await until(lambda: agent.started(f"wf:{wf_id}:0#1"))  # noqa: B023 - awaited at once
        await stack.engine.abort_workflow(id=wf_id)
        await stack.engine.resume_workflow(id=wf_id)
        await _superseded_while_running(stack, agent, wf_id)
        workflows.append(wf_id)

        # timeout -> retry while attempt 1's command runs at the agent
        agent.hold()
        node = await stack.engine.create_node(site_id="lab1", bmc=sim_bmc())
        wf_id = await stack.start("erase-slowly", node.id)
        await until(lambda: agent.started(f"wf:{wf_id}:0#1"))  # noqa: B023 - awaited at once
        failed = await wait_workflow(stack.api, wf_id, timeout=30)
        assert (failed.state, failed.steps[0].error["code"]) == ("failed", "TIMEOUT")
        await stack.engine.retry_workflow(id=wf_id)
        await _superseded_while_running(stack, agent, wf_id)
        workflows.append(wf_id)

    runs = agent.runs()
    assert all(r.end is not None for r in runs), runs
    twice = [r.command_id for r in runs if sum(o.command_id == r.command_id for o in runs) > 1]
    assert twice == [], f"commands run twice at the agent: {twice}"
    overlapping = overlaps(runs)
    assert overlapping == [], (
        f"{len({a.key.split('#')[0] for a, _ in overlapping})} of {len(workflows)} workflows ran"
        f" attempt 2 while attempt 1 still ran: {overlapping}"
    )
    # each round: attempt 1 ran to its end, then attempt 2 ran once
    assert len(runs) == 2 * len(workflows)


async def _as_second_process(
    stack: AgentStack, enrollment: Enrollment, kind: str, doc: dict[str, Any]
) -> Any:
    """An event of another process with the same enrollment and a fresh journal (a second
    site agent started with a copy of the first one's state folder, minus its journal), signed
    with the agent's real key, as that process's SDK sends it."""
    doc = {
        "site": enrollment.site_id, "agent": enrollment.agent_id, "signerId": enrollment.cert_id,
        "signedAtMs": time.time_ns() // 1_000_000, "journalId": "journal-of-the-second-process", **doc,
    }  # fmt: skip
    _data, signature = enrollment.identity.sign(f"agent.{kind}", doc)
    data = msgspec.json.encode({**doc, "signature": base64.b64encode(signature).decode()})
    subject = stack.api.subjects.agent_event(enrollment.site_id, enrollment.agent_id, kind)
    return unwrap((await stack.api.nc.request(subject, data, timeout=5)).data)


async def test_a_retry_waits_for_a_run_another_journal_interrupted(stack: AgentStack, agent: ExecLog) -> None:
    # Issue 22 gap 4. Attempt 1 runs at the site agent (held: a long wipe); a second process
    # with the same enrollment and a fresh journal claims the command (JetStream redelivered it
    # while the first was cut off), which settles it failed (interrupted) and fails the step.
    # The operator retries: attempt 2 must not start while attempt 1 still runs at the first
    # process. Counted at the agent's exec log.
    assert agent.enrollment is not None
    await stack.profile("erase-once", [{"use": "netboot.clearEntry", "on": "site", "with": {"mac": MAC}}])
    workflows = []
    for _ in range(2):
        agent.hold()
        node = await stack.engine.create_node(site_id="lab1", bmc=sim_bmc())
        wf_id = await stack.start("erase-once", node.id)
        await until(lambda: agent.started(f"wf:{wf_id}:0#1"))  # noqa: B023 - awaited at once
        [first] = (await stack.cq.list_commands(workflow_id=wf_id)).commands
        first = await stack.cq.get(id=first.id)
        await _as_second_process(stack, agent.enrollment, "hello", {"incarnation": "second"})
        canonical = msgspec.json.encode(first.payload, order="sorted")
        claim = {"commandId": first.id, "digest": payload_digest(first.kind, canonical)}
        taken = await _as_second_process(stack, agent.enrollment, "ack", claim)
        assert (taken["proceed"], taken["reason"]) == (False, "interrupted")
        failed = await wait_workflow(stack.api, wf_id, timeout=30)
        assert failed.state == "failed", failed
        await stack.engine.retry_workflow(id=wf_id)

        async def waits_or_overlaps() -> bool:
            step = await stack.step(wf_id)  # noqa: B023 - awaited at once
            waiting = (step.waiting_for or {}).get("reason") == "previous-attempt-running"
            return waiting or agent.started(f"wf:{wf_id}:0#2")  # noqa: B023

        await until(waits_or_overlaps)
        if not agent.started(f"wf:{wf_id}:0#2"):  # why names the journal it waits for
            why = await stack.engine.why(id=wf_id)
            assert f"{first.id} on journal " in why.answer, why.answer
        await _superseded_while_running(stack, agent, wf_id)
        workflows.append(wf_id)
    runs = agent.runs()
    overlapping = overlaps(runs)
    assert overlapping == [], (
        f"{len({a.key.split('#')[0] for a, _ in overlapping})} of {len(workflows)} workflows ran"
        f" attempt 2 while attempt 1 still ran: {overlapping}"
    )
    assert len(runs) == 2 * len(workflows)


async def test_a_retry_cancels_every_node_the_step_sent_to_and_fences_late_enqueues(
    stack: AgentStack,
) -> None:
    # no agent in these sites: every command stays pending
    node = await stack.engine.create_node(site_id="lab7", bmc=sim_bmc())
    other = await stack.engine.create_node(site_id="lab8", bmc=sim_bmc())
    await stack.profile(
        "other-node",
        [{"use": "test.awaitPowerOn", "with": {"nodeId": other.id, "siteId": "lab8"}, "timeout": "2s"}],
    )
    wf_id = await stack.start("other-node", node.id)
    failed = await wait_workflow(stack.api, wf_id, timeout=30)
    assert (failed.state, failed.steps[0].error["code"]) == ("failed", "TIMEOUT")
    [first] = (await stack.cq.list_commands(workflow_id=wf_id)).commands
    assert (first.node_id, first.key, first.state) == (other.id, f"wf:{wf_id}:0#1:power", "pending")

    await stack.engine.retry_workflow(id=wf_id)

    async def second_attempt_sent() -> bool:
        keys = {c.key for c in (await stack.cq.list_commands(workflow_id=wf_id)).commands}
        return f"wf:{wf_id}:0#2:power" in keys

    await until(second_attempt_sent)
    # attempt 1's command was on another node than the workflow's: cancelled all the same
    assert (await stack.cq.get(id=first.id)).state == "cancelled"

    # an engine that lost its shard but still runs attempt 1 cannot send anything for it now
    def late(key: str) -> EnqueueCommand:
        return EnqueueCommand(
            node_id=other.id, site_id="lab8", kind="power.setPower", payload={"action": "on"},
            key=key, target="site", workflow_id=wf_id, step=0,
        )  # fmt: skip

    with pytest.raises(BcError) as refused:
        await stack.cq.enqueue(late(f"wf:{wf_id}:0#1:late"))
    assert refused.value.code is ErrorCode.INVALID_STATE
    assert refused.value.reason == "attempt-superseded"
    # the fence is attempt 1's and nothing else's: #12 is another attempt
    assert (await stack.cq.enqueue(late(f"wf:{wf_id}:0#12"))).state == "pending"


async def test_a_new_attempt_revokes_the_tokens_and_secrets_of_the_one_it_supersedes(
    stack: AgentStack,
) -> None:
    node = await stack.engine.create_node(site_id="lab1", bmc=sim_bmc())
    await stack.profile("mints", [{"use": "test.mintThenFail", "with": {"flag": f"go-{uuid.uuid4().hex}"}}])
    wf_id = await stack.start("mints", node.id)
    failed = await wait_workflow(stack.api, wf_id, timeout=30)
    assert failed.state == "failed", failed
    first = failed.steps[0].error["details"]
    assert (await stack.pki.get_join_token(join_token_id=first["joinTokenId"])).state == "active"

    await stack.engine.retry_workflow(id=wf_id)

    async def revoked() -> bool:
        return (await stack.pki.get_join_token(join_token_id=first["joinTokenId"])).state == "revoked"

    async def secret_gone() -> BcError | None:
        try:
            await stack.secrets.get(ref=first["secretRef"])
        except BcError as err:
            return err
        return None

    # the supersede revokes attempt 1's token, then its secrets (two services, one after the
    # other): wait for each, as a reader of either would see it
    await asyncio.wait_for(until(revoked), 30)  # attempt 1's token cannot join any more
    gone = await asyncio.wait_for(until(secret_gone), 30)
    assert gone.reason == "secret-revoked"
    failed = await wait_workflow(stack.api, wf_id, timeout=30)
    second = failed.steps[0].error["details"]
    assert second["attempt"] == 2
    assert second["joinTokenId"] != first["joinTokenId"]
    assert (await stack.pki.get_join_token(join_token_id=second["joinTokenId"])).state == "active"
    assert (await stack.secrets.get(ref=second["secretRef"])).startswith(b"rendered with ")


async def test_an_abort_revokes_what_the_cancelled_attempt_minted(stack: AgentStack) -> None:
    node = await stack.engine.create_node(site_id="lab1", bmc=sim_bmc())
    flag = f"go-{uuid.uuid4().hex}"
    await stack.profile("mints-waits", [{"use": "test.mintThenFail", "with": {"flag": flag, "wait": True}}])
    wf_id = await stack.start("mints-waits", node.id)

    async def minted() -> list[Any]:
        return [t for t in await stack.pki.list_join_tokens(site_id="lab1") if t.node_id == node.id]

    [token] = await until(minted)
    await stack.engine.abort_workflow(id=wf_id)

    async def revoked() -> bool:
        return (await stack.pki.get_join_token(join_token_id=token.join_token_id)).state == "revoked"

    await asyncio.wait_for(until(revoked), 30)
