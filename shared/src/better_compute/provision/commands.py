"""Sending commands from a control-plane step: ``await_command`` and ``site_agent_for``.

>>> async def run(input, ctx):
...     agent = await site_agent_for(ctx, ctx.node.id)
...     if agent is None:
...         raise step_not_ready(5_000)  # no site agent connected yet
...     done = await await_command(ctx, node_id=ctx.node.id, kind="power.setPower",
...                                payload={"action": "cycle"}, key="power-cycle")
...     return {"powerCommand": done["command_id"]}

The step's context reaches the command queue through ``ctx.commands`` (``CommandQueueAccess``),
which the engine provides: it fills in the workflow's coordinates, its batch on destructive
kinds and the step's declared ``sends``.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Protocol, TypedDict

from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.cmdq import (
    DEFAULT_COMMAND_TIMEOUT_MS,
    LIVE_STATES,
    CommandView,
    EnqueueCommand,
)

from .context import StepCoordinates, StepNode, step_command_key
from .waiting import CommandNotReady

__all__ = [
    "COMMAND_POLL_MS",
    "CommandQueueAccess",
    "CommandResult",
    "CommandStepContext",
    "await_command",
    "site_agent_for",
]

COMMAND_POLL_MS: Final = 2_000
"""The ``retry_after_ms`` of what ``await_command`` raises while its command is live. The engine
does not run the step again after it: it waits for the command's settle event (its command watch
is the safety net, every 10 s), so a step waiting on a command costs no pass of its own; whatever
treats it as a plain ``StepNotReady`` (a test's own loop over ``run_step``) runs it again then."""


class CommandQueueAccess(Protocol):
    """``ctx.commands``: the command queue as a step sees it (the engine provides it)."""

    async def enqueue(self, command: EnqueueCommand) -> CommandView:
        """Find the command by (node, key), or create it. The engine sets the workflow id,
        step, tenant, the workflow's batch (destructive kinds only) and the step's ``sends``."""
        ...

    async def site_agent_for(self, node_id: str) -> str | None:
        """A connected agent of the node's site, the boot-lease holder first, or None."""
        ...


class CommandStepContext(StepCoordinates, Protocol):
    """What ``await_command`` and ``site_agent_for`` read from a step's context."""

    @property
    def node(self) -> StepNode | None: ...

    @property
    def batch_id(self) -> str | None: ...

    @property
    def commands(self) -> CommandQueueAccess: ...


class CommandResult(TypedDict):
    """What ``await_command`` returns once the command succeeded."""

    command_id: str
    result: bytes
    """The agent's raw result bytes."""
    attested: bool
    """True only when a node signed the result and its certificate checked out."""


def _commands(ctx: Any) -> CommandQueueAccess:
    commands = getattr(ctx, "commands", None)
    if commands is None:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "this step context has no command queue (ctx.commands)",
            {"path": "ctx.commands"},
        )
    return commands  # type: ignore[no-any-return]


async def await_command(
    ctx: CommandStepContext,
    *,
    node_id: str,
    kind: str,
    payload: Any = None,
    key: str | None = None,
    timeout_ms: int = DEFAULT_COMMAND_TIMEOUT_MS,
    target: Literal["site", "node"] | None = None,
    site_id: str | None = None,
) -> CommandResult:
    """Find-before-create a command of this step attempt, then wait for it.

    The command's key is ``wf:<workflow>:<step>#<attempt>[:<key>]`` on ``node_id``; it is
    enqueued only when absent, with ``notAfter`` now plus ``timeout_ms``.

    Args:
        ctx: the step's context.
        node_id: the node the command is for.
        kind: a registered command kind (``power.setPower``).
        payload: the kind's payload (validated by the command queue).
        key: tells several commands of one step apart (``boot-device``).
        timeout_ms: how long the command may take, from when it is first enqueued.
        target: ``site`` (the node's site agent) or ``node`` (the node's own bcd); by default
            ``node`` for ``node.*`` kinds, else ``site``.
        site_id: the node's site; taken from ``ctx.node`` when the command is for the
            workflow's node, required otherwise.

    Returns:
        ``{command_id, result, attested}`` once the command succeeded.

    Raises:
        StepNotReady: while the command is pending, dispatched, acked or running: a
            ``CommandNotReady`` (``COMMAND_POLL_MS``, and the command's id, key, kind and
            state), which the engine waits on until the command settles.
        BcError: ``DRIVER_ERROR`` with ``details.state`` and ``details.reason`` once it
            failed, was rejected, expired or was cancelled; the command queue's refusals
            (``INVALID_CONFIG`` for an unknown or undeclared kind, ``INVALID_INPUT`` for a bad
            payload, ``INVALID_STATE`` with reason ``batch-required``) as they are.
    """
    commands = _commands(ctx)
    command_key = step_command_key(ctx, key)
    node = ctx.node
    if site_id is None:
        if node is None or node.id != node_id:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                "give site_id for a node other than the workflow's",
                {"path": "site_id"},
            )
        site_id = node.site_id
    if target is None:
        target = "node" if kind.startswith("node.") else "site"
    command = EnqueueCommand(
        node_id=node_id,
        site_id=site_id,
        kind=kind,
        payload=payload if payload is not None else {},
        key=command_key,
        target=target,
        workflow_id=ctx.workflow_id,
        step=ctx.step,
        batch_id=ctx.batch_id,
        timeout_ms=timeout_ms,
        tenant_id=node.tenant_id if node is not None else "root",
    )
    view = await commands.enqueue(command)
    if view.state in LIVE_STATES:
        raise CommandNotReady(
            COMMAND_POLL_MS, command_id=view.id, key=command_key, kind=view.kind, state=view.state
        )
    if view.state == "succeeded":
        return CommandResult(command_id=view.id, result=view.result or b"", attested=view.attested)
    raise BcError(
        ErrorCode.DRIVER_ERROR,
        f"command {view.kind} {view.state}" + (f": {view.reason}" if view.reason else ""),
        {"state": view.state, "reason": view.reason, "commandId": view.id, "kind": view.kind},
    )


async def site_agent_for(ctx: CommandStepContext, node_id: str) -> str | None:
    """A connected agent of the node's site, the boot-lease holder first, or None (then
    ``raise step_not_ready(...)`` and wait for one)."""
    return await _commands(ctx).site_agent_for(node_id)
