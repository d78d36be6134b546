"""``better_compute.testing.steps``: one control-plane step run as the engine runs it, for plugin
authors' unit tests (docs/plugins.md)."""

from __future__ import annotations

from typing import Any

import pytest

from better_compute.core import ErrorCode, field, manifest
from better_compute.provision import define_step
from better_compute.testing import refused
from better_compute.testing.steps import FakeNode, FakeStepContext, run_step

pytestmark = pytest.mark.unit


async def _echo(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"input": input, "inventory": ctx.node.inventory, "key": ctx.idempotency_key}


ECHO = define_step(
    id="acme.echo",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({"count": field.int(min=1).default(2)}),
    run=_echo,
)


async def test_with_is_validated_and_defaulted_then_the_step_runs() -> None:
    got = await run_step(ECHO, node=FakeNode(inventory={"memory": {"totalBytes": 1}}))
    assert got["input"] == {"count": 2}
    assert got["inventory"] == {"memory": {"totalBytes": 1}}
    assert got["key"] == "wf:wf_00000000000000000000000001:0#1"
    err = await refused(run_step(ECHO, {"count": 0}, node=FakeNode()))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "with.count")


async def test_what_the_test_gave_no_fake_of_refuses_with_invalid_config() -> None:
    async def uses_sql(input: dict[str, Any], ctx: Any) -> Any:
        return await ctx.sql.query("SELECT 1")

    step = define_step(id="acme.sql", runs_on="control-plane", timeout="1m", input=manifest({}), run=uses_sql)
    err = await refused(run_step(step, ctx=FakeStepContext(node=FakeNode())))
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "sql")
    agent = define_step(
        id="acme.agent", runs_on="site", timeout="1m", input=manifest({}), command="power.setPower"
    )
    assert (await refused(run_step(agent))).code is ErrorCode.INVALID_CONFIG


async def test_once_keeps_a_read_for_the_runs_of_one_context_as_for_one_attempt() -> None:
    reads: list[str] = []

    async def read() -> str:
        reads.append("read")
        return f"value-{len(reads)}"

    async def reads_once(input: dict[str, Any], ctx: Any) -> Any:
        return await ctx.once("acme.setting", read)

    step = define_step(
        id="acme.once", runs_on="control-plane", timeout="1m", input=manifest({}), run=reads_once
    )
    ctx = FakeStepContext(node=FakeNode())
    assert [await run_step(step, ctx=ctx) for _ in range(3)] == ["value-1"] * 3
    assert await run_step(step, ctx=FakeStepContext(node=FakeNode(), attempt=2)) == "value-2"
    assert reads == ["read", "read"]
