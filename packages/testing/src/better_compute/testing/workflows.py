"""Waiting for workflows in tests, through the engine's API (never its tables)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ..clients import EngineClient
from ..service.client import ApiClient
from ..wire.engine import WorkflowView

__all__ = ["FINISHED", "wait_workflow", "wait_workflows"]

FINISHED = ("succeeded", "failed", "aborted")


async def wait_workflow(
    engine: EngineClient | ApiClient,
    workflow_id: str,
    *,
    states: Iterable[str] = FINISHED,
    timeout: float = 30.0,
    poll: float = 0.05,
) -> WorkflowView:
    """The workflow once it is in one of ``states``; ``TimeoutError`` with its last view otherwise.

    ``engine`` is an ``EngineClient``, or the ``ApiClient`` to build one on.
    """
    client = engine if isinstance(engine, EngineClient) else EngineClient(engine)
    want = set(states)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: WorkflowView | None = None
    while loop.time() < deadline:
        last = await client.get_workflow(id=workflow_id)
        if last.state in want:
            return last
        await asyncio.sleep(poll)
    raise TimeoutError(f"workflow {workflow_id} not in {sorted(want)} after {timeout}s: {last}")


async def wait_workflows(
    engine: EngineClient | ApiClient, workflow_ids: Iterable[str], *, timeout: float = 60.0
) -> list[WorkflowView]:
    return list(await asyncio.gather(*(wait_workflow(engine, w, timeout=timeout) for w in workflow_ids)))
