"""The workflow feed (``bc.events.workflow.<id>``): each step's change and each workflow's end, as
the engine's ``WorkflowEvents``; the step and workflow metrics are counted here too."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from better_compute.core.errors import BcError
from better_compute.wire import engine as m

from .. import metrics
from ..store import StepRow, WorkflowRow
from .hooks import Publish

__all__ = ["WorkflowFeed"]


class WorkflowFeed:
    def __init__(self, publish: Publish) -> None:
        self.publish = publish

    async def changed(
        self,
        wf: WorkflowRow,
        state: str,
        step: StepRow | None,
        *,
        result: Any = None,
        error: BcError | None = None,
    ) -> None:
        event: m.WorkflowEvent
        if step is None:
            metrics.WORKFLOWS_FINISHED.labels(wf.profile_id, wf.state).inc()
            event = m.WorkflowFinished(
                workflow_id=wf.id, node_id=wf.node_id, workflow_state=wf.state, at=time.time()
            )
        else:
            if state in ("succeeded", "failed"):
                metrics.observe_step(step.action, state, step.started_at, time.time())
            failed = {"code": error.code.value, "message": error.message} if error is not None else None
            waits = step.waiting_for if step.waiting_for and state in ("pending", "running") else None
            change = m.StepChange(
                index=step.idx,
                action=step.action,
                state=state,
                attempt=step.attempt,
                error=failed if failed is not None else msgspec.UNSET,
                waiting_for=waits if waits is not None else msgspec.UNSET,
            )
            event = m.StepChanged(
                workflow_id=wf.id, node_id=wf.node_id, workflow_state=wf.state, at=time.time(), step=change
            )
        await self.publish(m.EVENTS, wf.id, event)
