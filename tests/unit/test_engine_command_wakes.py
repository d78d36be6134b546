"""Which command events wake what in the engine (``EngineService._on_command``): a command's end
wakes the key that waits for it; its live states (dispatched, acked, running) wake nothing, for
a workflow's step and a plug-in's owner alike (``EngineHooks.wake_prefixes``: "when it settles").
A host converge's owner key was woken by each live event of its command, and each look was an
enqueue: 3.5 a machine in a 200-machine deploy (bench_fleet --agent-events)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bc_engine.core import queue
from bc_engine.metal.lifecycle import HOST_OWNER
from bc_engine.metal.names import HOST_KEY_PREFIX
from bc_engine.service import EngineService
from better_compute.wire.cmdq import CommandEvent
from better_compute.wire.codec import encode

pytestmark = pytest.mark.unit


def _engine() -> tuple[EngineService, list[str], list[str]]:
    engine = object.__new__(EngineService)
    woken: list[str] = []
    now: list[str] = []

    async def wake(rkey: str) -> None:
        woken.append(rkey)

    engine.wake = wake  # type: ignore[method-assign]
    engine.hooks = SimpleNamespace(wake_prefixes={HOST_KEY_PREFIX: HOST_OWNER})  # type: ignore[assignment]
    engine._rkeys = {"wf_1": "wf:wf_1"}
    engine.scheduler = SimpleNamespace(now=now.append)  # type: ignore[assignment]
    engine._owns_key = lambda _rkey: True  # type: ignore[method-assign]
    return engine, woken, now


async def _told(state: str) -> tuple[list[str], list[str]]:
    """A host converge's event and a workflow step's command's event, both in ``state``, told
    to the engine: the owner keys it woke and the workflow keys it looks at now."""
    engine, woken, now = _engine()
    host = CommandEvent(id="cmd_1", key=f"{HOST_KEY_PREFIX}2", node_id="node_1", state=state)
    step = CommandEvent(id="cmd_2", key="wf:wf_1:s0:a1", node_id="node_1", workflow_id="wf_1", state=state)
    for event in (host, step):
        await engine._on_command(SimpleNamespace(data=encode(event)))  # type: ignore[arg-type]
    return woken, now


@pytest.mark.parametrize("state", ["pending", "dispatched", "acked", "running", "cancelling"])
async def test_a_live_state_wakes_neither_a_plug_in_owner_nor_a_workflow(state: str) -> None:
    assert await _told(state) == ([], [])


@pytest.mark.parametrize("state", ["succeeded", "failed", "expired", "cancelled"])
async def test_an_end_wakes_the_owner_of_a_plug_in_command_and_the_workflow_of_a_step(state: str) -> None:
    assert await _told(state) == ([queue.owner_key(HOST_OWNER, "node_1")], ["wf:wf_1"])
