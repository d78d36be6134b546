"""An app with a command kind made for bc-secrets' fetch-gate tests, and helpers to use it.

Every service of such a test loads it (``settings.app`` / ``BC_APP`` = ``secrets_test_app:app``;
tests/support is on PYTHONPATH): the default app's only kind that carries a secret reference,
``node.imageWrite``, is destructive, while ``test.useSecret`` is not and carries nothing but the
reference. Its agent has nothing to do with the value: ``settle`` lets a real agent of the SDK
run the command to ``succeeded``.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, Final

from better_compute.agent import Agent, Enrollment
from better_compute.agent.sim import sim_handlers
from better_compute.app import better_compute
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.core.manifest import field, manifest
from better_compute.core.plugins import CommandKind, define_plugin
from better_compute.metal import metal
from better_compute.provision import provision_module
from better_compute.service import ApiClient
from better_compute.wire.cmdq import CommandView, EnqueueCommand

__all__ = ["APP", "USE_SECRET", "app", "enqueue_ref", "settle"]

APP: Final = "secrets_test_app:app"
USE_SECRET: Final = CommandKind(
    name="test.useSecret",
    destructive=False,
    description="Hands a secret reference to the node's agent (the test's stand-in for user data)",
    payload=manifest({"ref": field.secret_ref(), "note": field.string(max_length=200).optional()}),
)

plugin = define_plugin(id="secrets-test", command_kinds=[USE_SECRET])
app = better_compute(modules=[metal(), provision_module(modules=[metal()])], plugins=[plugin])


async def enqueue_ref(
    cq: CommandQueueClient,
    *,
    node_id: str,
    site_id: str,
    key: str,
    payload: Any,
    workflow_id: str | None = None,
    step: int | None = None,
) -> CommandView:
    """A new ``test.useSecret`` command for the node's own agent (agent id = node id);
    dispatched at once, so live until it settles."""
    view = await cq.enqueue(
        EnqueueCommand(
            node_id=node_id,
            site_id=site_id,
            kind=USE_SECRET.name,
            key=key,
            target="node",
            workflow_id=workflow_id,
            step=step,
            payload=payload,
        )
    )
    assert view.created, view
    assert (view.state, view.agent_id) == ("dispatched", node_id), view
    return view


async def settle(api: ApiClient, enrollment: Enrollment, command_id: str, state_dir: Path) -> CommandView:
    """Run the enrolled agent (the SDK's runner, on ``api``'s connection, its journal in the
    existing ``state_dir``) until the command settled, then stop it; returns the command."""
    agent = Agent(
        enrollment=enrollment,
        handlers=sim_handlers([USE_SECRET.name]),
        journal=state_dir / f"{enrollment.agent_id}.journal.db",
        nc=api.nc,
        subjects=api.subjects,
    )
    await agent.start()
    run = asyncio.create_task(agent.run())
    try:
        return await CommandQueueClient(api).wait(id=command_id, timeout=30)
    finally:
        await agent.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(run, 10)
