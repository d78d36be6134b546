"""Running one control-plane step in a unit test, without servers.

A plugin author checks a step's logic the way the engine calls it: ``with`` validated against the
step's input (``INVALID_INPUT`` at ``with.<field>`` as ``workflows.start`` would refuse it), then
``run(input, ctx)`` once with a ``StepContext`` of small stand-ins::

    node = FakeNode(inventory={"memory": {"totalBytes": 64 << 30}})
    assert await run_step(check_memory, {"minMemoryGiB": 32}, node=node) == {...}

``ctx.sql``, ``ctx.pki``, ``ctx.secrets`` and ``ctx.workflows`` are absent or refuse by default
(give your own fakes for steps that use them); what the engine really does around a step (claims,
retries, deadlines, waking) is for the integration and e2e tiers (``bc_processes``, the metal
simulator).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ..core.errors import BcError, ErrorCode
from ..core.keys import attempt_key
from ..logging import get_logger
from ..provision.steps import Step

__all__ = ["FakeNode", "FakeStepContext", "run_step"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class FakeNode:
    """A ``StepNode``: the node a workflow runs for, as a step sees it."""

    id: str = "node_00000000000000000000000001"
    site_id: str = "lab1"
    tenant_id: str = "root"
    labels: Mapping[str, str] = field(default_factory=dict)
    macs: Sequence[str] = ()
    bmc: Mapping[str, Any] | None = None
    state: str = "enrolled"
    inventory: Mapping[str, Any] | None = None


class _Refuses:
    """Stands in for a service the test gave no fake of: any use is ``INVALID_CONFIG``."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"ctx.{self._what}.{name}: this test gave run_step no {self._what} (pass {self._what}=…)",
            {"path": self._what},
        )


@dataclass(kw_only=True)
class FakeStepContext:
    """A ``StepContext`` for ``run_step``; every part can be replaced."""

    workflow_id: str = "wf_00000000000000000000000001"
    step: int = 0
    attempt: int = 1
    node: FakeNode | None = None
    batch_id: str | None = None
    sql: Any = field(default_factory=lambda: _Refuses("sql"))
    pki: Any = None
    secrets: Any = None
    workflows: Any = field(default_factory=lambda: _Refuses("workflows"))
    log: Any = field(default_factory=lambda: get_logger(test="run_step"))
    found: dict[str, Any] = field(default_factory=dict)
    """What ``once`` kept, by name: one context is one attempt (run the step again with the same
    context for its later runs)."""

    @property
    def idempotency_key(self) -> str:
        return attempt_key(self.workflow_id, self.step, self.attempt, None)

    async def once(self, name: str, load: Callable[[], Awaitable[T]]) -> T:
        """As the engine's: ``load()`` at the first call of ``name``, what it gave after."""
        if name not in self.found:
            self.found[name] = await load()
        return cast(T, self.found[name])


async def run_step(
    step: Step,
    with_: Mapping[str, Any] | None = None,
    *,
    node: FakeNode | None = None,
    ctx: FakeStepContext | None = None,
) -> Any:
    """Validate ``with_`` as ``workflows.start`` does, then run the control-plane ``step`` once.

    Args:
        step: a control-plane step (``define_step(runs_on="control-plane", run=…)``).
        with_: the profile step's ``with``.
        node: the workflow's node (``ctx.node``), when ``ctx`` is not given.
        ctx: the whole context, for steps that use ``ctx.sql``, ``ctx.pki`` or ``ctx.secrets``.

    Returns:
        What ``run`` returned: the step's result, as ``workflows.get`` would show it.

    Raises:
        BcError: ``INVALID_INPUT`` at ``with.<field>`` for ``with_`` the step's input refuses, or
            what the step raised (``step_not_ready`` raises ``StepNotReady``).
    """
    if step.run is None:
        raise BcError(
            ErrorCode.INVALID_CONFIG, f"{step.id} is an agent step: nothing to run", {"path": "step"}
        )
    try:
        value = step.input.validate(dict(with_ or {}))
    except BcError as err:
        raise err.with_path_prefix("with") from err
    context = ctx if ctx is not None else FakeStepContext(node=node)
    return await step.run(value, context)
