"""A plugin package, installed, end to end (issue 26): examples/acme-plugin is built and installed
with uv (``uv pip install --target``: the wheel build and the dist-info with its entry point that
``pip install acme-plugin`` makes) into a folder on the service processes' ``sys.path``, and the
services run the default app: no ``BC_APP``, no app module.

Why a target folder and not the workspace's ``.venv``: every other test (and every parallel
worker) runs the default app from that venv, which would then load the plugin too, and the next
``uv sync --frozen`` removes it again. The folder is that install, seen by these processes only.

What an operator would notice: ``bcx plugins list`` shows the package's plugin with its step,
profile and config unit; ``bcx steps list`` shows its step; a workflow of its profile runs on a
node whose bcd (a simulated agent) reports 64 GiB, and the step's result shows the memory it
read from the node's inventory; a broken plugin package stops the engine with INVALID_CONFIG at
``entry_points.<name>``, without a traceback.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from better_compute.clients import CommandQueueClient, EngineClient, PkiClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx
from better_compute.testing.agents import SimAgent, start_sim_agent
from better_compute.testing.workflows import wait_workflow
from doc_blocks import doc_block
from plugin_install import uv_install

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "acme-plugin"
FAST = {"BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SILENT_AFTER": "1500ms", "BC_CMDQ_SWEEP": "100ms"}
GIB = 1 << 30
INVENTORY = {"cpus": {"model": "Sim Xeon", "cores": 8}, "memory": {"totalBytes": 64 * GIB}}


def doc_examples() -> list[str]:
    """docs/plugins.md's run of the acme profile, which this test runs as written there."""
    return doc_block("docs/plugins.md", "tests/e2e/test_plugins.py")


@pytest_asyncio.fixture(loop_scope="session")
async def site(tmp_path: Path) -> Path:
    """The example plugin, installed into a folder the services get on ``sys.path``."""
    target = tmp_path / "site-packages"
    uv_install(EXAMPLE, target)
    assert (target / "acme_plugin-0.1.0.dist-info" / "entry_points.txt").read_text().split() == [
        "[better_compute.plugins]", "acme", "=", "acme_plugin:plugin",
    ]  # fmt: skip
    return target


def start(bc_processes: ServiceProcesses, site: Path, *services: str) -> None:
    bc_processes.extra_env.update({**FAST, "PYTHONPATH": str(site)})
    for name in services:
        bc_processes.start(name)


@pytest_asyncio.fixture(loop_scope="session")
async def agents() -> AsyncIterator[list[SimAgent]]:
    made: list[SimAgent] = []
    yield made
    for agent in made:
        agent.close()


async def test_an_installed_plugin_runs_with_the_default_app(
    bc_settings: Settings,
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    site: Path,
    tmp_path: Path,
    agents: list[SimAgent],
) -> None:
    assert bc_settings.app == "better_compute.app.default:app"
    start(bc_processes, site, "bc-pki", "bc-secrets", "bc-command-queue", "bc-engine")
    await bc_processes.wait_ready(timeout=120)

    code, out, err = await bcx(bc_settings, "plugins", "list")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["PLUGIN", "FROM", "STEPS", "PROFILES", "UNITS", "SIGNERS"]
    assert len(rows) == 1
    assert rows[0].split() == [
        "acme", "acme-plugin", "0.1.0", "(entry", "point", "acme)", "acme.checkMemory",
        "acme-memory-check@1", "acme-nic-firmware", "-",
    ]  # fmt: skip
    code, out, err = await bcx(bc_settings, "plugins", "list", "--json")
    assert code == 0, err
    (acme,) = json.loads(out)["plugins"]
    assert (acme["source"], acme["target"], acme["distribution"], acme["lent"]) == (
        "entry-point", "acme_plugin:plugin", "acme-plugin", True,
    )  # fmt: skip

    code, out, err = await bcx(bc_settings, "steps", "list", "--plugin", "acme")
    assert code == 0, err
    assert [line.split() for line in out.splitlines()[1:]] == [
        ["acme.checkMemory", "control-plane", "acme", "minMemoryGiB"]
    ]

    # a node whose bcd (simulated, node-signed) reports 64 GiB; the shipped profile of the plugin
    engine = EngineClient(bc_api)
    node = (await engine.create_node(site_id="lab1")).id
    agent, _ = await start_sim_agent(
        bc_settings, tmp_path / "bcd", site_id="lab1", pki=PkiClient(bc_api), cq=CommandQueueClient(bc_api),
        role="node", node_id=node, args=["--answer", f"node.inventory={json.dumps(INVENTORY)}"],
    )  # fmt: skip
    agents.append(agent)
    # docs/plugins.md's lines as written there: the start (--wait), then its step's result
    start_line, get_line, shown = doc_examples()
    code, out, err = await bcx(
        bc_settings, *[node if w == "node_01J…" else w for w in shlex.split(start_line)[1:]]
    )
    assert code == 0, out + err
    found = re.search(r"wf_[0-9A-Z]{26}", out)
    assert found is not None, out
    get, _, jq = get_line.partition(" | jq ")
    code, out, err = await bcx(
        bc_settings, *[found[0] if w == "wf_01J…" else w for w in shlex.split(get)[1:]]
    )
    assert code == 0, err
    result: Any = json.loads(out)
    for key, index in re.findall(r"\.(\w+)|\[(\d+)\]", shlex.split(jq)[0]):  # jq's path, as jq reads it
        result = result[key] if key else result[int(index)]
    assert result == json.loads(shown) == {
        "memoryBytes": 64 * GIB, "memoryGiB": 64.0, "minMemoryGiB": 16, "cpuModel": "Sim Xeon",
    }  # fmt: skip

    # asking for more than the node has fails the workflow with the step's reason
    profile = {"id": "big", "version": 1, "target": "metal", "role": "host",
               "steps": [{"use": "acme.checkMemory", "with": {"minMemoryGiB": 128}}]}  # fmt: skip
    await engine.create_profile(document=profile)
    wf = await engine.start_workflow(profile_id="big", node_id=node)
    done = await wait_workflow(engine, wf.id, timeout=60)
    assert done.state == "failed", done
    error: Any = done.steps[0].error
    assert (error["code"], error["details"]["reason"]) == ("INVALID_STATE", "too-little-memory")


async def test_a_broken_plugin_package_stops_the_engine_naming_its_entry_point(
    bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-plugin"
    (broken / "src" / "broken_plugin").mkdir(parents=True)
    (broken / "src" / "broken_plugin" / "__init__.py").write_text("raise RuntimeError('acme lost a file')\n")
    text = (EXAMPLE / "pyproject.toml").read_text()
    (broken / "pyproject.toml").write_text(
        text.replace('name = "acme-plugin"', 'name = "broken-plugin"')
        .replace('acme = "acme_plugin:plugin"', 'flaky = "broken_plugin:plugin"')
        .split("[tool.pytest")[0]
    )
    target = tmp_path / "site-packages"
    uv_install(broken, target)
    start(bc_processes, target, "bc-engine")
    proc = bc_processes.procs[-1]
    assert await proc.wait_exit(timeout=60) == 1
    failed = [json.loads(line) for line in proc.output().splitlines() if '"service_failed"' in line]
    assert [(f["code"], f["path"]) for f in failed] == [("INVALID_CONFIG", "entry_points.flaky")]
    assert "acme lost a file" in failed[0]["error"]
    assert "Traceback" not in proc.output()
