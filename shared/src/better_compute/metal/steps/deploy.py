"""``deploy.deploy``: write the image to the node's disk, with its rendered user data.

The image is a catalog reference ``name@version``: the step's ``with.image``, else the node's
(``bcx deploy --image``), else the profile's ``image``. It is resolved in the machine owner's
tenant with ``resolve_image_ref`` (the tenant's image first, then a public one; refused if its
signer was removed; the app's ``image_verifier`` decides instead of the allowlist when set).
The user data is the reference ``userdata.render`` stored earlier in the same workflow
(``rendered_user_data``), read from the store; the document never travels, only its SecretRef.
``userdata.render`` stored it for the workflow's node, so the secrets gate opens it to that node
while this step's live command to it carries the reference; bcd fetches it and writes it onto a
NoCloud config drive after the image (docs/bcd.md).

``node.imageWrite`` is destructive and its result decides the deploy, so it counts only when
attested (node-signed, checked against the node's certificate).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import field, manifest
from better_compute.provision._names import IMAGE_REF_PATTERN
from better_compute.provision.results import rendered_user_data
from better_compute.provision.steps import define_step

from ..commands import NODE_IMAGE_WRITE
from ..images import resolve_image_ref
from ._relay import attested_result, workflow_node

__all__ = ["NODE_IMAGE", "deploy_deploy"]

STEP_ID: Final = "deploy.deploy"
NODE_IMAGE: Final = "SELECT image FROM nodes WHERE id = $1"


async def _image_ref(step_input: Mapping[str, Any], ctx: Any, node_id: str) -> str:
    ref = step_input.get("image")
    if ref is None:
        rows = await ctx.sql.query(NODE_IMAGE, node_id)
        ref = rows[0]["image"] if rows else None
    if ref is None:
        ref = getattr(ctx.profile, "image", None)
    if ref is None:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"no image to deploy on node {node_id}: give deploy --image, with.image or the profile's image",
            {"path": "image"},
        )
    return str(ref)


async def _run(step_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = workflow_node(ctx, STEP_ID)
    ref = await _image_ref(step_input, ctx, node.id)
    verifier = getattr(ctx.provision, "image_verifier", None)
    async with ctx.sql.transaction() as tx:
        image = await resolve_image_ref(tx, node.tenant_id, ref, verifier=verifier)
    payload: dict[str, Any] = {"url": image["url"], "sha256": image["sha256"]}
    if image.get("format"):
        payload["format"] = image["format"]
    if step_input.get("disk"):
        payload["disk"] = step_input["disk"]
    user_data = await rendered_user_data(ctx.sql, ctx.workflow_id)
    if user_data is not None:
        payload["userDataRef"] = user_data
    done = await attested_result(ctx, kind=NODE_IMAGE_WRITE.name, payload=payload, step=STEP_ID)
    return {
        "commandId": done["commandId"],
        "attested": True,
        "image": ref,
        "sha256": image["sha256"],
        "userDataRef": user_data,
    }


deploy_deploy = define_step(
    id=STEP_ID,
    runs_on="control-plane",
    relays=["node"],
    sends=[NODE_IMAGE_WRITE.name],
    timeout="1h",
    input=manifest(
        {
            "image": field.string(pattern=IMAGE_REF_PATTERN).optional(),
            "disk": NODE_IMAGE_WRITE.payload.fields["disk"],
        }
    ),
    run=_run,
    retry_safe=False,
    description="Write the catalog image to the node's disk with the workflow's rendered user data",
)
