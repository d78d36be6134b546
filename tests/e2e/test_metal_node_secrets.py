"""A node's standing secret (its BMC credential, as ``bcx nodes enroll`` stores it): an agent reads
it only while a live command **for that node**, of any workflow, carries the reference; bc-secrets
asks the real bc-command-queue."""

from __future__ import annotations

from better_compute.agent.sim import join_agent
from better_compute.clients import CommandQueueClient, SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, refused
from better_compute.wire.cmdq import EnqueueCommand

VALUE = b'{"username": "admin", "password": "pw-for-the-bmc"}'


def write(node: str, wf: str, ref: str, key: str) -> EnqueueCommand:
    return EnqueueCommand(
        node_id=node, site_id="site-s", kind="node.imageWrite", key=f"wf:{wf}:0#1:{key}", target="node",
        workflow_id=wf, step=0,
        payload={"url": "https://img.example/os.raw", "sha256": "b" * 64, "userDataRef": ref},
    )  # fmt: skip


async def test_a_nodes_secret_opens_only_to_a_live_command_for_that_node(
    bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    for service in ("bc-pki", "bc-secrets", "bc-command-queue"):
        bc_processes.start(service)
    await bc_processes.wait_ready()
    cq, secrets = CommandQueueClient(bc_api), SecretsClient(bc_api)
    node, other = new_id("node"), new_id("node")
    info = await secrets.put_for_node(VALUE, tenant_id="root", node_id=node, label="bmc")
    assert (info.node_id, info.workflow_id) == (node, None)
    mine = await join_agent(bc_api, site_id="site-s", role="node", node_id=node)
    theirs = await join_agent(bc_api, site_id="site-s", role="node", node_id=other)

    async def denied(identity: object) -> BcError:
        try:
            await secrets.fetch(ref=info.ref, identity=identity)  # type: ignore[arg-type]
        except BcError as err:
            return err
        raise AssertionError("the fetch was granted")

    assert (await denied(mine.identity)).code is ErrorCode.PERMISSION_DENIED  # nothing carries it yet
    # another node's command carrying the reference opens nothing
    stray = await cq.enqueue(write(other, new_id("wf"), info.ref, "stray"))
    assert stray.state == "dispatched"
    assert (await denied(theirs.identity)).code is ErrorCode.PERMISSION_DENIED
    # a command of any workflow for this node opens it, to this node's agent only
    live = await cq.enqueue(write(node, new_id("wf"), info.ref, "mine"))
    assert live.state == "dispatched"
    assert await secrets.fetch(ref=info.ref, identity=mine.identity) == VALUE
    await cq.cancel(id=live.id, reason="done")
    assert (await denied(mine.identity)).code is ErrorCode.PERMISSION_DENIED

    # exactly one owner: a workflow step or a node
    err = await refused(bc_api.call("secrets", "secrets.put", {"tenantId": "root", "value": "eA=="}))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "workflowId")
