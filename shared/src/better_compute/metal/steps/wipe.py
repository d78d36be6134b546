"""``disk.wipe``: erase the node's disks through its own agent. Destructive.

``node.wipe`` is a destructive kind, so with the quorum on it goes out only in the workflow's
approved batch (the step declares it in ``sends``). Its result decides a transition (a released
node becomes ``ready``), so it counts only when ``attested``: signed with the node's key and
verified against that node's certificate. An unattested result fails the step
(``UNAUTHENTICATED``, reason ``not-attested``), and the workflow with it: the node does not move
on to ``ready``.
"""

from __future__ import annotations

from typing import Any, Final

from better_compute.core.manifest import manifest
from better_compute.provision.steps import define_step

from ..commands import NODE_WIPE
from ._relay import attested_result

__all__ = ["disk_wipe"]

STEP_ID: Final = "disk.wipe"


async def _run(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    payload = {k: v for k, v in step_input.items() if v is not None}
    done = await attested_result(ctx, kind=NODE_WIPE.name, payload=payload, step=STEP_ID)
    return {"commandId": done["commandId"], "attested": True, "mode": step_input["mode"]}


disk_wipe = define_step(
    id=STEP_ID,
    runs_on="control-plane",
    relays=["node"],
    sends=[NODE_WIPE.name],
    timeout="2h",
    input=manifest(dict(NODE_WIPE.payload.fields)),
    run=_run,
    retry_safe=False,
    description="Erase the node's disks (destructive); counts only when the node signed the result",
)
