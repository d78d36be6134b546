"""``bcx why <node|workflow>``: what the current step of a node's or a workflow's workflow waits
for, in one answer (``workflows.why``). ``bcx workflows get`` and ``bcx nodes show`` print the
same answer (``why_line``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..clients import EngineClient
from ..config import Settings
from ..core.errors import BcError
from ..wire.engine import WhyAnswer
from .common import engine_client
from .node_refs import node_ref
from .output import print_json

__all__ = ["register", "why_line", "why_reason"]


async def why_line(engine: EngineClient, id: str) -> WhyAnswer | None:
    """The answer for ``id``, or None when the engine cannot give one (an older engine)."""
    try:
        return await engine.why(id=id)
    except BcError:
        return None


_QUIET_KINDS = frozenset({"deadline", "running"})
"""Parts of a ``why`` answer that say nothing the line does not (it runs, its deadline)."""


def why_reason(answer: WhyAnswer | None) -> str | None:
    """The first part of ``bcx why``'s answer that says what the step waits for, or None."""
    if answer is None or not answer.waiting:
        return None
    for reason in answer.reasons:
        if reason.kind not in _QUIET_KINDS:
            return reason.text
    return None


async def cmd_why(args: argparse.Namespace, settings: Settings) -> int:
    async with engine_client(settings) as engine:
        answer = await engine.why(id=args.id)
    if args.json:
        print_json(answer)
        return 0
    where = f"workflow {answer.workflow_id}" if answer.workflow_id else "no workflow"
    if answer.node_id:
        named = f" ({answer.node_name})" if answer.node_name else ""
        where = f"node {answer.node_id}{named}  {where}"
    print(f"{where}  {answer.workflow_state or '-'}")
    print(answer.answer)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "why", parents=[common], help="what a node's or workflow's current step waits for, in one answer"
    )
    p.add_argument(
        "id", type=node_ref, help="a node id or name (its running workflow, else its latest) or a workflow id"
    )
    p.set_defaults(func=cmd_why)
