"""The command queue's parts on an in-memory store, for its unit tests: no PostgreSQL, no NATS.

``Queue`` wires the real ``Claims``, ``Runs``, ``Batches``, ``Sweeper`` and ``Agents`` to a
``MemoryStore`` and records what they would publish (command events, deliveries, batch events,
sites whose pending commands were dispatched). bc-pki is a dict of certificate states.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric import ed25519

from bc_command_queue.agents import Agents
from bc_command_queue.batches import Batches
from bc_command_queue.claims import Claims
from bc_command_queue.commands import Commands
from bc_command_queue.config import CmdqConfig, Quorum, QuorumSource, load_quorum
from bc_command_queue.presence import Presence
from bc_command_queue.rows import CommandRow
from bc_command_queue.runs import Runs
from bc_command_queue.signers import Signer
from bc_command_queue.storage import NewCommand
from bc_command_queue.sweeper import Sweeper
from bc_command_queue.testing import MemoryStore
from better_compute.app import load_app
from better_compute.config import DEFAULT_APP
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiRequest
from better_compute.testing.approvers import approver_keys, write_approvers
from better_compute.wire.agent import Ack, Progress, Result, payload_digest

SITE = "site-a"


class Log:
    """A logger that keeps what was said: ``("claim_digest_mismatch", {...})``."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def _say(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    debug = info = warning = error = _say

    def said(self, event: str) -> list[dict[str, Any]]:
        return [kw for name, kw in self.lines if name == event]


class Deliveries:
    """Stands for the site streams: what was delivered, in order."""

    def __init__(self) -> None:
        self.sent: list[CommandRow] = []

    async def publish(self, row: CommandRow, *, again: bool = False) -> bool:
        self.sent.append(row)
        return True

    async def deliver(self, rows: Sequence[CommandRow], *, again: bool = False) -> bool:
        self.sent += rows
        return True


class Streams:
    on_leaves = False  # the site streams on the hub (cmdq.site_domain unset)

    async def ensure_consumer(self, site_id: str, agent_id: str) -> tuple[str, str]:
        return f"stream-{site_id}", f"consumer-{agent_id}"


class Pki:
    """bc-pki's word on certificates: ``states[cert_id]`` (absent: NOT_FOUND)."""

    def __init__(self) -> None:
        self.states: dict[str, str] = {}

    async def get_certificate(self, *, cert_id: str) -> Any:
        if cert_id not in self.states:
            raise BcError(ErrorCode.NOT_FOUND, f"no certificate {cert_id}")
        return SimpleNamespace(state=self.states[cert_id])


class NoSigners:
    def evict(self, cert_id: str) -> None:
        pass


def signer(
    agent: str, *, site: str = SITE, role: str = "site", cert: str = "cert_x", public_key: Any = None
) -> Signer:
    return Signer(
        cert_id=cert, agent_id=agent, site_id=site, tenant_id="root", role=role,
        not_after=dt.datetime.now(dt.UTC) + dt.timedelta(days=1), public_key=public_key,
    )  # fmt: skip


@dataclass
class Queue:
    store: MemoryStore
    config: CmdqConfig
    claims: Claims
    commands: Commands
    runs: Runs
    batches: Batches
    sweeper: Sweeper
    agents: Agents
    pki: Pki
    deliveries: Deliveries
    log: Log
    changed: list[CommandRow] = field(default_factory=list)
    batch_events: list[Any] = field(default_factory=list)
    connected: bool = True
    dispatched_sites: list[str] = field(default_factory=list)
    spawned: list[asyncio.Future[None]] = field(default_factory=list)
    """What the agents ran beside an event (redelivery after a hello), as tasks."""

    def states(self) -> list[tuple[str, str, str | None]]:
        """The command events published so far: (id, state, reason)."""
        return [(r.id, r.state, r.reason) for r in self.changed]


def queue(*, quorum: Quorum | None = None, reruns: bool = False, **cfg: Any) -> Queue:
    store = MemoryStore()
    config = CmdqConfig(quorum_source=QuorumSource(quorum or Quorum()), **cfg)
    log = Log()
    deliveries = Deliveries()
    box: list[Queue] = []

    async def changed(rows: Sequence[CommandRow]) -> None:
        box[0].changed.extend(rows)

    async def publish(_stream: str, _key: str, event: Any) -> None:
        box[0].batch_events.append(event)

    sweeper = Sweeper(
        store=store, config=config, deliveries=deliveries,  # type: ignore[arg-type]
        changed=changed, connected=lambda: box[0].connected, log=log, clock=store.now,
    )  # fmt: skip
    app = load_app(DEFAULT_APP)
    pki = Pki()

    async def dispatch_pending(*, site_id: str | None = None, batch_id: str | None = None) -> int:
        if site_id is not None:
            box[0].dispatched_sites.append(site_id)
        return await sweeper.dispatch_pending(site_id=site_id, batch_id=batch_id)

    agents = Agents(
        store=store, config=config, streams=Streams(), deliveries=deliveries, pki=pki,  # type: ignore[arg-type]
        signers=NoSigners(), changed=changed, dispatch_pending=dispatch_pending,  # type: ignore[arg-type]
        spawn=lambda coro: box[0].spawned.append(asyncio.ensure_future(coro)), log=log,
        presence=Presence(store=store, config=config, log=log, clock=store.now),
    )  # fmt: skip
    q = Queue(
        store=store,
        config=config,
        claims=Claims(store=store, config=config, changed=changed, log=log, reruns=lambda _k, _p: reruns),
        commands=Commands(
            store=store,
            config=config,
            app=app,
            deliveries=deliveries,  # type: ignore[arg-type]
            changed=changed,
            log=log,
        ),
        runs=Runs(store=store, pki=None, changed=changed, log=log),  # type: ignore[arg-type]
        batches=Batches(
            store=store,
            config=config,
            app=app,
            changed=changed,
            dispatch_pending=sweeper.dispatch_pending,
            log=log,
            publish=publish,
        ),
        sweeper=sweeper,
        agents=agents,
        pki=pki,
        deliveries=deliveries,
        log=log,
    )
    box.append(q)
    return q


def approvers(
    tmp_path: Any, names: Sequence[str] = ("alice", "bob", "carol"), *, threshold: int = 2
) -> tuple[Quorum, dict[str, ed25519.Ed25519PrivateKey]]:
    """A quorum of ``threshold`` of ``names``, as the approvers file gives it, and their keys."""
    keys = approver_keys(names)
    return load_quorum(write_approvers(tmp_path / "quorum.toml", keys, threshold=threshold)), keys


PAYLOADS: dict[str, Any] = {"node.wipe": {}, "node.inventory": {}, "media.eject": {}}


def payload_of(kind: str) -> str:
    return msgspec.json.encode(PAYLOADS.get(kind, {}), order="sorted").decode()


def digest_of(kind: str) -> str:
    return payload_digest(kind, payload_of(kind).encode())


async def command(
    q: Queue,
    *,
    kind: str = "node.inventory",
    node: str | None = None,
    target: str = "node",
    timeout_s: float = 60.0,
    batch_id: str | None = None,
    destructive: bool | None = None,
    may_dispatch: bool = True,
    key: str | None = None,
) -> CommandRow:
    """Insert a command as ``commands.enqueue`` does (a node command goes to its node at once)."""
    node = node or new_id("node")
    row = await q.store.insert_command(
        NewCommand(
            id=new_id("cmd"), node_id=node, site_id=SITE, tenant_id="root", key=key or f"k-{new_id('cmd')}",
            kind=kind, destructive=destructive if destructive is not None else kind == "node.wipe",
            target=target, payload=payload_of(kind), digest=bytes.fromhex(digest_of(kind)),
            batch_id=batch_id, workflow_id=None, step=None,
            not_after_ms=int(q.store.now() * 1000 + timeout_s * 1000), may_dispatch=may_dispatch,
        ),
        silent_after_ms=q.config.silent_after_ms,
    )  # fmt: skip
    assert row is not None
    return row


_signed = itertools.count(int(time.time() * 1000))


def ack(row: CommandRow, *, agent: str | None = None, journal: str = "j1", **over: Any) -> Ack:
    """An agent's claim, signed a millisecond after the one before (as an agent signs them)."""
    fields: dict[str, Any] = {
        "site": SITE, "agent": agent or row.agent_id or row.node_id, "signer_id": "cert_x",
        "signed_at_ms": next(_signed), "command_id": row.id, "digest": digest_of(row.kind),
        "journal_id": journal, **over,
    }  # fmt: skip
    return Ack(**fields)


def progress(row: CommandRow, message: str = "working") -> Progress:
    return Progress(
        site=SITE, agent=row.agent_id or row.node_id, signer_id="cert_x", signed_at_ms=0,
        command_id=row.id, message=message,
    )  # fmt: skip


def result(row: CommandRow, status: str = "succeeded", *, journal: str = "j1", **over: Any) -> Result:
    fields: dict[str, Any] = {
        "site": SITE, "agent": row.agent_id or row.node_id, "signer_id": "cert_x", "signed_at_ms": 0,
        "command_id": row.id, "status": status, "result": b"{}", "journal_id": journal, **over,
    }  # fmt: skip
    return Result(**fields)


def request(body: msgspec.Struct) -> ApiRequest:
    return ApiRequest("t.cmdq", msgspec.json.encode(body), None)
