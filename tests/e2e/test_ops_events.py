"""Issue 15 acceptance: the durable event feed. A consumer outside the project (its own
process, plain nats-py, no project imports) reads stream BC_EVENTS and reconstructs a workflow's
timeline; ``bcx events tail`` shows the same events, filtered by workflow, node and kind."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx
from better_compute.testing.workflows import wait_workflow
from ops_stack import PROFILE, OpsStack, create_power_profile, ops_stack

SITE = "lab-events"
ACTIONS = ("on", "cycle", "off")

# What an external system would write: nothing but nats-py and the documented schema
# (docs/events.md). It prints the workflow's timeline as JSON.
CONSUMER = r"""
import asyncio, json, sys
import nats
from nats.js.api import DeliverPolicy

async def main(url, stream, root, workflow_id):
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await js.subscribe(f"{root}.events.>", stream=stream, ordered_consumer=True,
                             deliver_policy=DeliverPolicy.ALL)
    steps, commands, finished = [], {}, None
    while True:
        msg = await sub.next_msg(timeout=10)
        _, _, kind, ident = msg.subject.split(".")
        event = json.loads(msg.data)
        if kind == "workflow" and ident == workflow_id:
            if event["event"] == "step":
                s = event["step"]
                entry = [s["index"], s["action"], s["state"], s["attempt"], event["at"]]
                if not steps or steps[-1][:4] != entry[:4]:  # a new wait of the same state
                    steps.append(entry)
            elif event["event"] == "finished":
                finished = [event["workflowState"], event["at"]]
        elif kind == "command" and event.get("workflowId") == workflow_id:
            commands.setdefault(ident, {"step": event["step"], "kind": event["kind"], "states": []})
            commands[ident]["states"].append(event["state"])
        if msg.metadata.num_pending == 0:
            break
    await nc.close()
    print(json.dumps({"steps": steps, "commands": commands, "finished": finished}))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path
) -> AsyncIterator[OpsStack]:
    async with ops_stack(bc_api, bc_processes, bc_settings, tmp_path, site=SITE) as made:
        yield made


@pytest.mark.timeout(150)
async def test_an_outside_consumer_reconstructs_a_workflow_timeline_and_bcx_tails_the_feed(
    stack: OpsStack, bc_api: ApiClient, bc_settings: Settings, tmp_path: Path
) -> None:
    engine = EngineClient(bc_api)
    await create_power_profile(engine, ACTIONS, address="sim-events")
    node = await engine.create_node(site_id=SITE)
    other = await engine.create_node(site_id=SITE)
    wf = await engine.start_workflow(profile_id=PROFILE, node_id=node.id)
    wf_other = await engine.start_workflow(profile_id=PROFILE, node_id=other.id)
    assert (await wait_workflow(engine, wf.id, timeout=60)).state == "succeeded"
    assert (await wait_workflow(engine, wf_other.id, timeout=60)).state == "succeeded"

    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    stream = bc_settings.subject_root.upper() + "_EVENTS"
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-I", str(script), bc_settings.nats_url or "", stream, bc_settings.subject_root,
         wf.id],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    timeline = json.loads(run.stdout)
    expected = []
    for index in range(len(ACTIONS)):
        expected += [[index, "power.setPower", "running", 1], [index, "power.setPower", "succeeded", 1]]
    assert [s[:4] for s in timeline["steps"]] == expected
    times = [s[4] for s in timeline["steps"]] + [timeline["finished"][1]]
    assert times == sorted(times)
    assert timeline["finished"][0] == "succeeded"
    commands = sorted(timeline["commands"].values(), key=lambda c: c["step"])
    assert [c["step"] for c in commands] == list(range(len(ACTIONS)))
    for c in commands:
        assert c["kind"] == "power.setPower"
        assert c["states"][0] in ("pending", "dispatched")
        assert c["states"][-1] == "succeeded"

    # bcx events tail: the same workflow's events, as JSON lines and as words
    tail = ("events", "tail", "--no-follow")
    code, out, err = await bcx(bc_settings, *tail, "--workflow", wf.id, "--since", "all", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert {line["kind"] for line in lines} == {"workflow", "command"}
    assert all(line["id"] == wf.id or line["event"]["workflowId"] == wf.id for line in lines)
    assert lines[-1]["event"]["event"] == "finished"
    code, out, err = await bcx(bc_settings, *tail, "--workflow", wf.id, "--since", "10m")
    assert code == 0, err
    assert f"workflow {wf.id}  step 2 power.setPower succeeded attempt 1" in out
    assert out.rstrip().endswith("workflow succeeded")

    # by node and kind: only the other node's commands
    code, out, err = await bcx(bc_settings, *tail, "--node", other.id, "--kind", "command", "--since", "all")
    assert code == 0, err
    rows = out.splitlines()
    assert len(rows) >= 2 * len(ACTIONS)
    assert all(" command " in r and f"node {other.id}" in r for r in rows), out
    assert sum("power.setPower succeeded" in r for r in rows) == len(ACTIONS)

    # the site agent's join is in the feed too
    code, out, err = await bcx(bc_settings, *tail, "--kind", "join", "--since", "all")
    assert code == 0, err
    assert "joined: site agent agent_" in out
    assert f"at site {SITE}" in out

    code, out, err = await bcx(bc_settings, *tail, "--since", "yesterday")
    assert code == 1
    assert "error: INVALID_INPUT" in err
    assert "(at since)" in err
