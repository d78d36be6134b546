"""Waiting for workflows in tests, through the engine's API (never its tables)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ..service.client import ApiClient

__all__ = ["FINISHED", "wait_workflow", "wait_workflows"]

FINISHED = ("succeeded", "failed", "aborted")


async def wait_workflow(
    api: ApiClient,
    workflow_id: str,
    *,
    states: Iterable[str] = FINISHED,
    timeout: float = 30.0,
    poll: float = 0.05,
) -> dict[str, Any]:
    """The workflow once it is in one of ``states``; ``TimeoutError`` with its last view otherwise."""
    want = set(states)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: dict[str, Any] = {}
    while loop.time() < deadline:
        last = await api.call("engine", "workflows.get", {"id": workflow_id})
        if last["state"] in want:
            return last
        await asyncio.sleep(poll)
    raise TimeoutError(f"workflow {workflow_id} not in {sorted(want)} after {timeout}s: {last}")


async def wait_workflows(
    api: ApiClient, workflow_ids: Iterable[str], *, timeout: float = 60.0
) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(wait_workflow(api, w, timeout=timeout) for w in workflow_ids)))
