"""The demo deployment: metal, provision with user-data settings, and two small demo steps.

``make demo`` starts every service with ``BC_APP=demo_app:app`` (this folder on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

from better_compute.app import better_compute
from better_compute.core import field, manifest
from better_compute.metal import metal
from better_compute.provision import UserData, define_step, provision_module, step_not_ready


async def _settle_time(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    # Waits the way every built-in wait does: not ready until the moment has come.
    rows = await ctx.sql.query(
        "SELECT extract(epoch FROM (clock_timestamp() - started_at)) * 1000 AS ms FROM workflow_steps"
        " WHERE workflow_id = $1 AND idx = $2",
        ctx.workflow_id,
        ctx.step,
    )
    waited = int(rows[0]["ms"])
    if waited < input["ms"]:
        raise step_not_ready(min(500, input["ms"] - waited))
    return {"waitedMs": waited}


async def _report(_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    # Later steps read earlier results from the store, never from memory.
    rendered = await ctx.from_step("userdata.render")
    return {
        "node": ctx.node.id,
        "userDataRef": rendered["userDataRef"],
        "joinTokenId": rendered["joinTokenId"],
    }


settle_time = define_step(
    id="demo.settleTime",
    runs_on="control-plane",
    timeout="1m",
    input=manifest({"ms": field.int(min=0, max=60000).default(1500)}),
    run=_settle_time,
)
report = define_step(
    id="demo.report", runs_on="control-plane", timeout="30s", input=manifest({}), run=_report
)

app = better_compute(
    modules=[
        metal(),
        provision_module(
            modules=[metal()],
            steps=[settle_time, report],
            user_data=UserData(
                control_plane_url="https://bc.lab.example",
                bcd_url="https://downloads.lab.example/bcd/0.1.0/bcd-linux-amd64",
                bcd_sha256="9f" * 32,
            ),
        ),
    ]
)
