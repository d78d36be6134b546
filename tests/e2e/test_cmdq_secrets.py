"""bc-secrets asks the real bc-command-queue (``commands.live_with_ref``) before an agent may
read a value: only while a live command of the secret's workflow step for that very agent
carries the reference."""

from __future__ import annotations

from better_compute.agent.sim import join_agent
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses
from better_compute.wire.cmdq import EnqueueCommand


async def test_an_agent_reads_a_secret_only_while_its_command_carries_it(
    bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    for service in ("bc-pki", "bc-secrets", "bc-command-queue"):
        bc_processes.start(service)
    await bc_processes.wait_ready()
    cq, secrets = CommandQueueClient(bc_api), SecretsClient(bc_api)
    wf, node = new_id("wf"), new_id("node")
    ref = (
        await secrets.put(
            value=b"#cloud-config\npassword: hunter2\n", tenant_id="root", workflow_id=wf, step=2
        )
    ).ref
    bcd = await join_agent(bc_api, site_id="site-s", role="node", node_id=node)
    stranger = await join_agent(bc_api, site_id="site-s", role="node", node_id=new_id("node"))

    async def denied(identity: object) -> BcError:
        try:
            await secrets.fetch(ref=ref, identity=identity)  # type: ignore[arg-type]
        except BcError as err:
            return err
        raise AssertionError("the fetch was granted")

    assert (await denied(bcd.identity)).code is ErrorCode.PERMISSION_DENIED  # nothing carries it yet
    write = await cq.enqueue(
        EnqueueCommand(
            node_id=node,
            site_id="site-s",
            kind="node.imageWrite",
            key=f"wf:{wf}:2#1:write",
            target="node",
            workflow_id=wf,
            step=2,
            payload={"url": "https://img.example/os.raw", "sha256": "b" * 64, "userDataRef": ref},
        )
    )
    assert write.state == "dispatched"
    assert await secrets.fetch(ref=ref, identity=bcd.identity) == b"#cloud-config\npassword: hunter2\n"
    assert (await denied(stranger.identity)).code is ErrorCode.PERMISSION_DENIED
    await cq.cancel(id=write.id, reason="step retried")
    assert (await denied(bcd.identity)).code is ErrorCode.PERMISSION_DENIED
