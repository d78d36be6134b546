"""The app the workflow benchmark runs: one no-op control-plane step."""

from __future__ import annotations

import time
from typing import Any

from better_compute.app import better_compute
from better_compute.core import manifest
from better_compute.metal import metal
from better_compute.provision import define_step, provision_module


async def _noop(_input: dict[str, Any], _ctx: Any) -> dict[str, Any]:
    # when the step really ran, so the benchmark measures settle -> next run, not bookkeeping
    return {"ranAt": time.time()}


noop = define_step(id="bench.noop", runs_on="control-plane", timeout="1m", input=manifest({}), run=_noop)
app = better_compute(modules=[metal(), provision_module(modules=[metal()], steps=[noop])])
