"""bc-pki or bc-secrets briefly down: a control-plane step that needs it waits, then carries on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.workflows import wait_workflow
from engine_stack import sim_bmc


@pytest.fixture
async def stack(bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path) -> ServiceProcesses:
    bc_processes.settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    bc_processes.extra_env = {
        "BC_PKI_KEY_FILE": str(tmp_path / "pki.key"),
        "BC_SECRETS_KEY_FILE": str(tmp_path / "secrets.key"),
    }
    for name in ("bc-engine", "bc-pki", "bc-secrets"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    return bc_processes


async def _render_while_down(stack: ServiceProcesses, api: ApiClient, service: str, pid: str) -> None:
    engine_api = EngineClient(api)
    [proc] = [p for p in stack.procs if p.service == service and p.alive()]
    proc.kill()
    node = await engine_api.create_node(site_id="lab1", bmc=sim_bmc())
    doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "userData": {"kind": "cloud-init"},
           "steps": [{"use": "userdata.render"}]}  # fmt: skip
    await engine_api.create_profile(document=doc)
    wf = await engine_api.start_workflow(profile_id=pid, node_id=node.id)

    async def waiting_or_finished() -> dict[str, Any] | None:
        view = await engine_api.get_workflow(id=wf.id)
        waiting = view.steps[0].waiting_for
        return view if view.state != "running" or waiting else None

    view = await until(waiting_or_finished)
    assert view.state == "running", view.steps[0].error
    waiting = view.steps[0].waiting_for
    assert (waiting["reason"], waiting["service"]) == ("service-unavailable", service)

    stack.start(service)
    await stack.wait_ready()
    done = await wait_workflow(api, wf.id, timeout=60)
    assert done.state == "succeeded", done
    assert done.steps[0].attempt == 1  # the same attempt, run again: one token, one document
    assert done.steps[0].waiting_for is None
    # the run after the outage got its own token back (the engine's mint secret for the
    # attempt): the document holds the one token minted, and it is still good
    tokens = (await api.call("pki", "tokens.list", {}))["tokens"]
    assert [(t["joinTokenId"], t["state"]) for t in tokens] == [
        (done.steps[0].result["joinTokenId"], "active")
    ]


async def test_a_step_waits_while_bc_pki_is_down(stack: ServiceProcesses, bc_api: ApiClient) -> None:
    await _render_while_down(stack, bc_api, "bc-pki", "ci-pki")


async def test_a_step_waits_while_bc_secrets_is_down(stack: ServiceProcesses, bc_api: ApiClient) -> None:
    await _render_while_down(stack, bc_api, "bc-secrets", "ci-secrets")
