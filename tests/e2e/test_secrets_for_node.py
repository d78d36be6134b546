"""A workflow step's value meant for the workflow's node (``userdata.render``'s user data, stored
with ``forNode``): besides the creating step's commands, a live command of another step of the
same workflow (the deploy step's ``node.imageWrite``) opens it, to that node only. bc-secrets asks
the real bc-command-queue; every case below is a fetch the node's or another agent's key signs."""

from __future__ import annotations

from better_compute.agent.sim import join_agent
from better_compute.clients import CommandQueueClient, SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, refused
from better_compute.wire.cmdq import EnqueueCommand

USER_DATA = b"#cloud-config\nwrite_files: [{path: /etc/bcd/join-token, content: bcjt_for_the_node}]\n"
RENDER, DEPLOY = 2, 3  # the steps of metal.deploy that store and carry the user data


def image_write(node: str, wf: str, ref: str, *, step: int = DEPLOY, key: str = "w") -> EnqueueCommand:
    return EnqueueCommand(
        node_id=node, site_id="site-s", kind="node.imageWrite", key=f"wf:{wf}:{step}#1:{key}", target="node",
        workflow_id=wf, step=step,
        payload={"url": "https://img.example/os.raw", "sha256": "b" * 64, "userDataRef": ref},
    )  # fmt: skip


async def test_user_data_opens_to_the_workflows_node_through_another_steps_command(
    bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    for service in ("bc-pki", "bc-secrets", "bc-command-queue"):
        bc_processes.start(service)
    await bc_processes.wait_ready()
    cq, secrets = CommandQueueClient(bc_api), SecretsClient(bc_api)
    wf, node, other = new_id("wf"), new_id("node"), new_id("node")
    key = f"wf:{wf}:{RENDER}#1"  # what userdata.render's first attempt stores under
    info = await secrets.put(value=USER_DATA, tenant_id="root", workflow_id=wf, step=RENDER, for_node=node,
                             idempotency_key=key)  # fmt: skip
    assert (info.workflow_id, info.step, info.for_node) == (wf, RENDER, node)
    strict = await secrets.put(value=USER_DATA, tenant_id="root", workflow_id=wf, step=RENDER,
                               idempotency_key=f"{key}:strict")  # fmt: skip
    mine = await join_agent(bc_api, site_id="site-s", role="node", node_id=node)
    theirs = await join_agent(bc_api, site_id="site-s", role="node", node_id=other)

    async def denied(identity: object, ref: str = info.ref) -> BcError:
        try:
            await secrets.fetch(ref=ref, identity=identity)  # type: ignore[arg-type]
        except BcError as err:
            return err
        raise AssertionError("the fetch was granted")

    assert (await denied(mine.identity)).code is ErrorCode.PERMISSION_DENIED  # nothing carries it yet
    # another workflow's command to the node carrying the reference opens nothing
    stray = await cq.enqueue(image_write(node, new_id("wf"), info.ref, key="stray"))
    assert stray.state == "dispatched"
    assert (await denied(mine.identity)).code is ErrorCode.PERMISSION_DENIED
    # the same workflow's command, but to another node: opens nothing to either
    elsewhere = await cq.enqueue(image_write(other, wf, info.ref, key="elsewhere"))
    assert elsewhere.state == "dispatched"
    assert (await denied(theirs.identity)).code is ErrorCode.PERMISSION_DENIED
    assert (await denied(mine.identity)).code is ErrorCode.PERMISSION_DENIED

    # the deploy step's image write to the workflow's node: the node reads its user data
    write = await cq.enqueue(image_write(node, wf, info.ref))
    assert write.state == "dispatched"
    assert await secrets.fetch(ref=info.ref, identity=mine.identity) == USER_DATA
    assert (await denied(theirs.identity)).code is ErrorCode.PERMISSION_DENIED
    # a value not stored for the node stays its creating step's only
    carried = await cq.enqueue(image_write(node, wf, strict.ref, key="strict"))
    assert carried.state == "dispatched"
    assert (await denied(mine.identity, strict.ref)).code is ErrorCode.PERMISSION_DENIED

    # the render attempt superseded (a retry): its value is revoked, whatever carries it
    await secrets.revoke_attempt(workflow_id=wf, step=RENDER, attempt=1, reason="retried")
    assert (await denied(mine.identity)).code is ErrorCode.PERMISSION_DENIED
    await cq.cancel(id=write.id, reason="done")

    # for a node only with a workflow step
    both = {"tenantId": "root", "nodeId": node, "forNode": node, "value": "eA=="}
    err = await refused(bc_api.call("secrets", "secrets.put", both))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "forNode")
