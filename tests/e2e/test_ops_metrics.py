"""Issue 15 acceptance: after a small rollout, every service's ``/metrics`` (scraped over HTTP,
each service its own process) counts what happened: N workflows of M power steps each on a
site agent's sim BMCs are N*M commands succeeded, N*M steps timed, N*M BMC calls, one join accepted,
one refused, one secret fetch denied."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from better_compute.clients import EngineClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.crypto import make_csr, new_agent_key
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses
from better_compute.testing.workflows import wait_workflows
from ops_stack import PROFILE, SERVICES, OpsStack, create_power_profile, ops_stack

SITE = "lab-metrics"
N_WORKFLOWS = 3
ACTIONS = ("on", "cycle")


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_api: ApiClient, bc_processes: ServiceProcesses, bc_settings: Settings, tmp_path: Path
) -> AsyncIterator[OpsStack]:
    async with ops_stack(bc_api, bc_processes, bc_settings, tmp_path, site=SITE) as made:
        yield made


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample at ``url``: (name, labels) → value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.timeout(120)
async def test_every_service_metrics_count_a_small_rollout(stack: OpsStack, bc_api: ApiClient) -> None:
    engine = EngineClient(bc_api)
    await create_power_profile(engine, ACTIONS, address="sim-metrics")
    nodes = [await engine.create_node(site_id=SITE) for _ in range(N_WORKFLOWS)]
    started = [await engine.start_workflow(profile_id=PROFILE, node_id=n.id) for n in nodes]
    done = await wait_workflows(engine, [w.id for w in started], timeout=60)
    assert [w.state for w in done] == ["succeeded"] * N_WORKFLOWS
    # one join refused (a revoked token) and one secret fetch denied (a malformed request)
    pki_client = PkiClient(bc_api)
    spare = await pki_client.issue_join_token(tenant_id="root", role="site", site_id=SITE, ttl_seconds=600)
    await pki_client.revoke_join_token(join_token_id=spare.join_token_id)
    with pytest.raises(BcError) as refused:
        await pki_client.join(token=spare.token, csr=make_csr(new_agent_key()))
    assert refused.value.reason == "token-revoked"
    with pytest.raises(BcError):
        await bc_api.call("secrets", "secrets.fetch", {"ref": "sec_nope"})
    commands = N_WORKFLOWS * len(ACTIONS)

    url = {s: stack.metrics_url(s) for s in (*SERVICES, "site-agent")}
    cmdq = await asyncio.to_thread(_scrape, url["bc-command-queue"])
    kind = {"kind": "power.setPower"}
    assert _value(cmdq, "bc_command_results_total", **kind, state="succeeded") == commands
    assert _value(cmdq, "bc_command_latency_seconds_count", **kind, state="succeeded") == commands
    assert not [k for k in cmdq if k[0] == "bc_commands_live"]  # every command has finished
    assert not [k for k in cmdq if k[0] == "bc_command_results_total" and ("state", "succeeded") not in k[1]]
    assert _value(cmdq, "bc_agents_connected", site=SITE, role="site") == 1
    assert ("bc_batches_awaiting_approval", frozenset()) in cmdq

    eng = await asyncio.to_thread(_scrape, url["bc-engine"])
    assert _value(eng, "bc_workflows_finished_total", profile=PROFILE, state="succeeded") == N_WORKFLOWS
    assert not [k for k in eng if k[0] == "bc_workflows_running"]  # none runs now
    steps = _value(eng, "bc_step_duration_seconds_count", action="power.setPower", outcome="succeeded")
    assert steps == commands
    assert _value(eng, "bc_reconciler_lag_seconds_count") >= N_WORKFLOWS

    pki = await asyncio.to_thread(_scrape, url["bc-pki"])
    assert _value(pki, "bc_joins_total", result="accepted", reason="joined") == 1
    assert _value(pki, "bc_joins_total", result="refused", reason="token-revoked") == 1

    secrets = await asyncio.to_thread(_scrape, url["bc-secrets"])
    assert _value(secrets, "bc_secret_fetches_total", outcome="denied", reason="malformed") == 1
    assert _value(secrets, "bc_secret_fetches_total", outcome="granted", reason="") == 0

    site = await asyncio.to_thread(_scrape, url["site-agent"])
    labels = {"driver": "sim", "operation": "power.setPower"}
    assert _value(site, "bc_bmc_call_duration_seconds_count", **labels, outcome="ok") == commands
    assert not [k for k in site if k[0] == "bc_bmc_call_errors_total"]
    # not on the port every host of the boot network reaches (http_listen): only on metrics_listen
    with pytest.raises(urllib.error.HTTPError) as hidden:
        await asyncio.to_thread(_scrape, f"{stack.agent.url}/metrics")
    hidden.value.close()  # its socket (a ResourceWarning otherwise)
    assert hidden.value.code == 404

    # no ids as labels: no label value anywhere names a node or a workflow
    ids = {n.id for n in nodes} | {w.id for w in started}
    for samples in (cmdq, eng, pki, secrets, site):
        assert not {v for _name, labels_ in samples for _k, v in labels_} & ids
