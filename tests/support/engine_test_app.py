"""An app with steps made for tests: side effects, waits and failures under our control.

Services load it with ``--app engine_test_app:app`` (tests/support is on PYTHONPATH).
The steps keep their state in ``public.plg_test_*`` tables that the tests create.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import asyncpg

from better_compute.app import better_compute
from better_compute.core import field, manifest
from better_compute.core.errors import BcError
from better_compute.core.plugins import DriverOperation, define_plugin
from better_compute.metal import metal
from better_compute.provision import (
    UserData,
    await_command,
    define_profile,
    define_step,
    provision_module,
    step_not_ready,
)

TABLES = """
CREATE TABLE IF NOT EXISTS public.plg_test_effects (step_key text PRIMARY KEY, n serial);
CREATE TABLE IF NOT EXISTS public.plg_test_runs (step_key text, at timestamptz DEFAULT now());
CREATE TABLE IF NOT EXISTS public.plg_test_flags (name text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS public.plg_test_children (step_key text PRIMARY KEY, child text NOT NULL);
CREATE TABLE IF NOT EXISTS public.plg_test_checks (flag text PRIMARY KEY, n int NOT NULL);
"""


async def create_tables(database_url: str) -> None:
    """Create the steps' tables (``TABLES``) in the test's database, before a service runs them."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(TABLES)
    finally:
        await conn.close()


async def _noop(_input: dict[str, Any], _ctx: Any) -> dict[str, Any]:
    return {"ok": True}


async def _side_effect(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    await ctx.sql.query("INSERT INTO plg_test_runs (step_key) VALUES ($1)", ctx.idempotency_key)
    async with ctx.sql.transaction() as tx:
        rows = await tx.query("SELECT n FROM plg_test_effects WHERE step_key = $1", ctx.idempotency_key)
        if rows:
            effect = rows[0]["n"]  # a re-run after a crash finds the first run's work
        else:
            rows = await tx.query(
                "INSERT INTO plg_test_effects (step_key) VALUES ($1) RETURNING n", ctx.idempotency_key
            )
            effect = rows[0]["n"]
    if input["holdMs"]:
        # hold between the side effect and the settle, so a test can kill the engine here
        flag = await ctx.sql.query("SELECT 1 FROM plg_test_flags WHERE name = 'release'")
        if not flag:
            await asyncio.sleep(input["holdMs"] / 1000)
    return {"effect": effect, "key": ctx.idempotency_key}


async def _wait_flag(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    rows = await ctx.sql.query("SELECT 1 FROM plg_test_flags WHERE name = $1", input["flag"])
    if not rows:
        # counted, so a test waits on "checked twice" rather than sleeping
        await ctx.sql.query(
            "INSERT INTO plg_test_checks VALUES ($1, 1) ON CONFLICT (flag) DO UPDATE"
            " SET n = plg_test_checks.n + 1",
            input["flag"],
        )
        raise step_not_ready(input["pollMs"], reason=input.get("reason"))
    return {"flag": input["flag"], "attempt": ctx.attempt}


async def _fail_unless_flag(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    rows = await ctx.sql.query("SELECT 1 FROM plg_test_flags WHERE name = $1", input["flag"])
    if rows:
        return {"attempt": ctx.attempt}
    if input["crash"]:
        raise RuntimeError("unexpected trouble with s3cr3t-internal-detail")
    raise BcError("CONFLICT", "the flag is not set", {"path": "flag", "flag": input["flag"]})


async def _start_child(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    async with ctx.sql.transaction() as tx:
        rows = await tx.query("SELECT child FROM plg_test_children WHERE step_key = $1", ctx.idempotency_key)
        if rows:
            child = rows[0]["child"]
        else:
            child = await ctx.workflows.start(tx, profile_id=input["profileId"], owner="test-owner")
            await tx.query(
                "INSERT INTO plg_test_children (step_key, child) VALUES ($1, $2)", ctx.idempotency_key, child
            )
    state = (await ctx.sql.query("SELECT state FROM workflows WHERE id = $1", child))[0]["state"]
    if state == "running":
        raise step_not_ready(100)
    return {"child": child, "state": state}


async def _await_power(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    got = await await_command(
        ctx, node_id=ctx.node.id, kind="power.setPower", payload={"action": input["action"]}, key="power"
    )
    return {"commandId": got["command_id"], "result": json.loads(got["result"]), "attested": got["attested"]}


async def _mint_then_fail(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    # mints a join token and stores a secret, then fails (or waits) until a flag is set
    node = ctx.node
    token = await ctx.pki.issue_join_token(
        tenant_id=node.tenant_id, role="provisioned", site_id=node.site_id, ttl_seconds=3600
    )
    ref = await ctx.secrets.put(b"rendered with " + token.token.encode(), idempotency_key=ctx.idempotency_key)
    minted = {"joinTokenId": token.join_token_id, "secretRef": ref, "attempt": ctx.attempt}
    rows = await ctx.sql.query("SELECT 1 FROM plg_test_flags WHERE name = $1", input["flag"])
    if rows:
        return minted
    if input["wait"]:
        raise step_not_ready(200)
    raise BcError("CONFLICT", "the flag is not set", {"path": "flag", **minted})


async def _fail_times(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    # fails its first `times` attempts with `code`, then succeeds
    if ctx.attempt <= input["times"]:
        raise BcError(input["code"], f"attempt {ctx.attempt} fails on purpose", {"path": "times"})
    return {"attempt": ctx.attempt}


async def _raise_unavailable(_input: dict[str, Any], _ctx: Any) -> dict[str, Any]:
    # the step's own verdict: its device is unavailable (not one of our services)
    raise BcError("UNAVAILABLE", "the test device does not answer", {"path": "device"})


async def _raise_refused(_input: dict[str, Any], _ctx: Any) -> dict[str, Any]:
    # the step's own call to its device was refused: looks transient, but it is the step's failure
    raise ConnectionRefusedError(111, "Connection refused")


async def _return_value(input: dict[str, Any], _ctx: Any) -> Any:
    return input["value"]


async def _previous(_input: dict[str, Any], ctx: Any) -> Any:
    return {"previous": await ctx.from_step("test.returnValue")}


async def _return_datetime(_input: dict[str, Any], _ctx: Any) -> Any:
    # not plain JSON types, but JSON all the same (an ISO string), as msgspec encodes it
    return {"at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)}


async def _node_seen(_input: dict[str, Any], ctx: Any) -> Any:
    node = ctx.node
    if node is None:
        return None
    return {"id": node.id, "siteId": node.site_id, "tenantId": node.tenant_id, "labels": dict(node.labels),
            "macs": list(node.macs), "bmc": node.bmc, "state": node.state}  # fmt: skip


async def _inventory_seen(_input: dict[str, Any], ctx: Any) -> Any:
    inventory = ctx.node.inventory
    seen = json.loads(json.dumps(inventory))
    if isinstance(inventory, dict):
        inventory["changedByAStep"] = True  # its own copy: the next run must not see this
    return {"inventory": seen}


async def _set_inventory(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    await ctx.sql.query("UPDATE nodes SET inventory = $2::jsonb WHERE id = $1", ctx.node.id,
                        json.dumps(input["inventory"]))  # fmt: skip
    return {}


async def _await_power_on(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    # a command for another node than the workflow's
    got = await await_command(
        ctx, node_id=input["nodeId"], site_id=input["siteId"], kind="power.setPower",
        payload={"action": "on"}, key="power",
    )  # fmt: skip
    return {"commandId": got["command_id"]}


noop = define_step(id="test.noop", runs_on="control-plane", timeout="1m", input=manifest({}), run=_noop)
side_effect = define_step(
    id="test.sideEffect",
    runs_on="control-plane",
    timeout="2m",
    input=manifest({"holdMs": field.int(min=0).default(0)}),
    run=_side_effect,
)
wait_flag = define_step(
    id="test.waitFlag",
    runs_on="control-plane",
    timeout="1h",
    input=manifest(
        {
            "flag": field.string(),
            "pollMs": field.int(min=1).default(200),
            "reason": field.string(min_length=1).optional(),
        }
    ),
    run=_wait_flag,
)
fail_unless_flag = define_step(
    id="test.failUnlessFlag",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({"flag": field.string(), "crash": field.bool().default(False)}),
    run=_fail_unless_flag,
)

start_child = define_step(
    id="test.startChild",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({"profileId": field.string()}),
    run=_start_child,
)

power = define_step(
    id="test.power",
    runs_on="site",
    timeout="1m",
    input=manifest({"action": field.enum(["on", "off", "cycle"]).default("cycle")}),
    command="power.setPower",
)
await_power = define_step(
    id="test.awaitPower",
    runs_on="control-plane",
    relays=["site"],
    timeout="1m",
    input=manifest({"action": field.enum(["on", "off", "cycle"]).default("cycle")}),
    run=_await_power,
)

mint_then_fail = define_step(
    id="test.mintThenFail",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({"flag": field.string(), "wait": field.bool().default(False)}),
    run=_mint_then_fail,
)
raise_unavailable = define_step(
    id="test.raiseUnavailable",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({}),
    run=_raise_unavailable,
)
raise_refused = define_step(
    id="test.raiseRefused",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({}),
    run=_raise_refused,
)
return_value = define_step(
    id="test.returnValue",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({"value": field.json()}),
    run=_return_value,
)
previous = define_step(
    id="test.previous", runs_on="control-plane", timeout="1m", input=manifest({}), run=_previous
)
return_datetime = define_step(
    id="test.returnDatetime", runs_on="control-plane", timeout="1m", input=manifest({}), run=_return_datetime
)
node_seen = define_step(
    id="test.nodeSeen", runs_on="control-plane", timeout="1m", input=manifest({}), run=_node_seen
)
inventory_seen = define_step(
    id="test.inventorySeen", runs_on="control-plane", timeout="1m", input=manifest({}), run=_inventory_seen
)
set_inventory = define_step(
    id="test.setInventory", runs_on="control-plane", timeout="1m",
    input=manifest({"inventory": field.json()}), run=_set_inventory,
)  # fmt: skip
await_power_on = define_step(
    id="test.awaitPowerOn",
    runs_on="control-plane",
    relays=["site"],
    timeout="1m",
    input=manifest({"nodeId": field.string(), "siteId": field.string()}),
    run=_await_power_on,
)

fail_times = define_step(
    id="test.failTimes",
    runs_on="control-plane",
    timeout="1m",
    retry_safe=True,
    input=manifest({"times": field.int(min=0), "code": field.string().default("UNAVAILABLE")}),
    run=_fail_times,
)
# the same, with a default retry policy of its own
flaky = define_step(
    id="test.flaky",
    runs_on="control-plane",
    timeout="1m",
    retry_safe=True,
    retry={"attempts": 3, "backoff": "300ms", "on": ["UNAVAILABLE"]},
    input=manifest({"times": field.int(min=0), "code": field.string().default("UNAVAILABLE")}),
    run=_fail_times,
)

chain = define_profile(
    id="test-chain", version=1, target="metal", role="host", steps=[{"use": "test.noop"}] * 6
)


async def _owner(_engine: Any, workflow_id: str) -> None:
    # the owner hears that a workflow ended: record it where the test can see it
    await _engine.db.execute(
        "INSERT INTO public.plg_test_flags (name) VALUES ($1) ON CONFLICT DO NOTHING",
        f"owner-heard:{workflow_id}",
    )


class OwnerModule:
    """A module whose reconciler owns workflows started with owner 'test-owner'."""

    id = "test-owner"
    command_kinds = ()
    steps = ()
    profiles = ()
    reconcilers = {"test-owner": _owner}


provision = provision_module(
    modules=[metal()],
    steps=[
        noop,
        side_effect,
        wait_flag,
        fail_unless_flag,
        start_child,
        power,
        await_power,
        mint_then_fail,
        raise_unavailable,
        raise_refused,
        return_value,
        previous,
        await_power_on,
        return_datetime,
        node_seen,
        inventory_seen,
        set_inventory,
        fail_times,
        flaky,
    ],
    profiles=[chain],
    user_data=UserData(
        control_plane_url="https://bc.test.example",
        bcd_url="https://downloads.test.example/bcd/0.1.0/bcd-linux-amd64",
        bcd_sha256="ab" * 32,
        templates={"plain.txt": "node={{nodeId}} host={{hostname}} token={{joinToken}}"},
    ),
)
# A plugin's own driver operation: validated in profiles and listed like metal's.
BIOS = define_plugin(
    id="test-bios",
    driver_operations=[
        DriverOperation(
            name="bios.flash",
            input=manifest({"image": field.string(min_length=1), "slot": field.int(min=0, max=1).default(0)}),
            description="Flashes a BIOS image",
        )
    ],
)
app = better_compute(modules=[metal(), provision], plugins=[OwnerModule(), BIOS])
