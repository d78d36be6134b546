"""The site streams on the sites' leaf nodes (``cmdq.site_domain = "{site}"``): each site's
command stream and results stream live in its leaf's JetStream domain, so a site cut off from
the hub keeps its commands, its agent's result waits on the leaf, and it is applied once the
link returns (by one of two command-queue instances reading the site's results stream); the
other site goes on meanwhile. The long story (a rollout, a 5-minute cut) is
tests/e2e/test_site_cut.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import pytest
from test_cmdq_delivery import FAST, executions, running

from bc_command_queue.config import CmdqConfig, check_site_domain
from bc_command_queue.service import CommandQueueService
from bc_command_queue.site_results import CONSUMER
from better_compute.agent import Agent
from better_compute.agent.sim import join_agent, sim_handlers
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.core.ids import new_id
from better_compute.service import ApiClient, connect
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.leaves import SiteLeaves
from better_compute.wire import Subjects
from better_compute.wire.cmdq import EnqueueCommand

LEAVES = dataclasses.replace(FAST, site_domain="{site}")


async def _held(url: str, subjects: Subjects, site: str) -> tuple[int, int]:
    """Messages in the site's command and results streams, asked of its leaf's own JetStream."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=3.0)
        cmd = await js.stream_info(subjects.site_stream(site))
        res = await js.stream_info(subjects.site_results_stream(site))
        return cmd.state.messages, res.state.messages
    finally:
        await nc.close()


@pytest.mark.long  # 7-10 s on the shared 2-core machine (a hub, two leaves, bc-pki, two agents)
async def test_a_cut_sites_result_waits_on_its_leaf_and_is_applied_once_after(
    bc_settings: Settings, tmp_path: Path
) -> None:
    leaves = await asyncio.to_thread(SiteLeaves(tmp_path / "nats", ["lab1", "lab2"], domains=True).start)
    settings = msgspec.structs.replace(bc_settings, nats_url=leaves.hub_url)
    procs = ServiceProcesses(settings, tmp_path)
    nc = await connect(leaves.hub_url, name="bc-test")
    try:
        procs.start("bc-pki")
        await procs.wait_ready()
        api = ApiClient(nc, Subjects(root=settings.subject_root))
        cq = CommandQueueClient(api, timeout=3.0)
        async with CommandQueueService(settings, config=LEAVES) as svc:
            run = asyncio.create_task(svc.run())
            agents = {}
            for site in ("lab1", "lab2"):
                folder = tmp_path / site
                folder.mkdir()
                agents[site] = Agent(
                    enrollment=await join_agent(api, site_id=site),
                    handlers=sim_handlers(
                        ["power.setPower"], exec_log=folder / "exec.log", delays_ms={"power.setPower": 800}
                    ),
                    journal=folder / "journal.db",
                    nats_url=leaves.url(site),
                    subjects=api.subjects,
                )
            async with (
                running(agents["lab1"]),
                running(agents["lab2"]),
                CommandQueueService(settings, config=LEAVES) as second,
            ):
                # a second instance, started after the agents' hellos: it finds their sites in the
                # store and reads their results streams too (one durable consumer, shared)
                run_second = asyncio.create_task(second.run())

                async def both_read() -> bool:
                    leaf = await nats.connect(leaves.url("lab2"))
                    try:
                        info = await leaf.jetstream().consumer_info(
                            api.subjects.site_results_stream("lab2"), CONSUMER
                        )
                    finally:
                        await leaf.close()
                    return info.num_waiting >= 2

                await until(both_read, timeout=20, what="both instances pull lab2's results")
                # the sites' streams are on their leaves, none on the hub
                for site in ("lab1", "lab2"):
                    assert await _held(leaves.url(site), api.subjects, site) == (0, 0)
                    with pytest.raises(nats.js.errors.NotFoundError):
                        await nc.jetstream().stream_info(api.subjects.site_stream(site))

                def power(site: str, key: str) -> EnqueueCommand:
                    return EnqueueCommand(
                        node_id=new_id("node"), site_id=site, kind="power.setPower", payload={"action": "on"},
                        key=key,
                    )  # fmt: skip

                held = await cq.enqueue(power("lab2", "held"))
                events = await nc.subscribe(api.subjects.event("command", held.id))

                async def running_at_lab2() -> bool:
                    return (await cq.get(id=held.id)).state == "running"

                await until(running_at_lab2, timeout=20, what="lab2's agent runs the command")
                leaves.gate("lab2").cut(3600)
                await until(lambda: not leaves.linked("lab2"), timeout=10, what="lab2's link down")

                async def stored() -> bool:
                    return (await _held(leaves.url("lab2"), api.subjects, "lab2"))[1] == 1

                await until(stored, timeout=20, what="lab2's result stored on its leaf")
                # the hub has not seen it: the command still runs for the command queue
                assert (await cq.get(id=held.id)).state == "running"
                # the other site goes on meanwhile
                other = await cq.enqueue(power("lab1", "other"))
                assert (await cq.wait(id=other.id, timeout=20)).state == "succeeded"
                assert (await cq.get(id=held.id)).state == "running"

                leaves.gate("lab2").heal()
                assert (await cq.wait(id=held.id, timeout=30)).state == "succeeded"

                async def drained() -> bool:
                    return (await _held(leaves.url("lab2"), api.subjects, "lab2")) == (0, 0)

                await until(drained, timeout=20, what="lab2's leaf streams drained")
                # applied once: one change to succeeded, whichever instance read it
                states = []
                with contextlib.suppress(TimeoutError):
                    while True:
                        states.append(json.loads((await events.next_msg(timeout=0.5)).data)["state"])
                assert states.count("succeeded") == 1, states
                second.request_stop()
                await run_second
            # run once, applied once (a delivery after the link returned: tests/e2e/test_site_cut.py)
            assert executions(tmp_path / "lab2" / "exec.log") == [f"{held.id} power.setPower"]
            assert executions(tmp_path / "lab1" / "exec.log") == [f"{other.id} power.setPower"]
            svc.request_stop()
            await run
    finally:
        await nc.close()
        procs.close()
        await asyncio.to_thread(leaves.close)


@pytest.mark.parametrize("template", ["lab", "{site}.x", "{site} x", "$JS"])
def test_a_site_domain_template_must_name_the_site_in_a_domain_name(template: str) -> None:
    with pytest.raises(BcError) as err:
        check_site_domain(template)
    assert err.value.path == "cmdq.site_domain"


def test_the_site_domain_defaults_to_the_services_own_jetstream() -> None:
    assert CmdqConfig().site_domain == ""
    assert check_site_domain("{site}") == "{site}"
    assert check_site_domain("leaf-{site}") == "leaf-{site}"
