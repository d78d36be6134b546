"""Metal and the image catalog on the contracts of issue 9: their replies keep the JSON the
engine wrote as dicts, node events decode once into their union, and ``EngineClient`` sends
what bcx's hand-built requests sent."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import pytest

from better_compute.clients import EngineClient
from better_compute.wire.engine import NodeChanged, NodeRemoved, decode_node_event
from better_compute.wire.images import ImageView
from better_compute.wire.metal import BulkRefusal, BulkRun, NodeBmc, VerbProfile, VerbRun, VerbStarted

pytestmark = pytest.mark.unit


class FakeApi:
    """Answers each route with a canned reply and keeps what was sent, as JSON."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies
        self.sent: list[tuple[str, Any]] = []

    async def call_as(self, service: str, route: str, payload: Any, typ: type[Any], **_: Any) -> Any:
        self.sent.append((route, msgspec.json.decode(msgspec.json.encode(payload))))
        return msgspec.convert(self.replies[route], typ, strict=False)


def _json(value: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


STARTED = {
    "nodeId": "node_1",
    "state": "deploying",
    "workflowId": "wf_1",
    "profile": {"id": "metal.deploy", "version": 1},
}
IMAGE: dict[str, Any] = {
    "tenantId": "root", "name": "ubuntu", "version": "24.04", "ref": "ubuntu@24.04", "public": False,
    "url": "https://images.example/u.raw", "sha256": "ab" * 32, "format": "raw", "size": None,
    "signer": "acme", "createdAt": "2026-12-01T09:00:00+00:00",
}  # fmt: skip


def test_verb_and_bulk_replies_keep_the_documents_of_before() -> None:
    started = VerbStarted(
        node_id="node_1",
        state="deploying",
        workflow_id="wf_1",
        profile=VerbProfile(id="metal.deploy", version=1),
    )
    run = VerbRun(**msgspec.structs.asdict(started), batch_id=None)
    assert _json(run) == {**STARTED, "batchId": None}
    bulk = BulkRun(
        verb="deploy", batch_id="bat_1", started=[started],
        refused=[BulkRefusal(node_id="node_2", code="INVALID_STATE", message="no", reason="wrong-state")],
    )  # fmt: skip
    assert _json(bulk) == {
        "verb": "deploy", "batchId": "bat_1", "started": [STARTED],
        "refused": [{"nodeId": "node_2", "code": "INVALID_STATE", "message": "no", "reason": "wrong-state"}],
    }  # fmt: skip


def test_an_image_shows_its_signer_status_only_where_the_engine_set_it() -> None:
    image = msgspec.convert(IMAGE, ImageView)
    assert _json(image) == IMAGE  # images.register
    assert _json(msgspec.structs.replace(image, signer_status="removed")) == {
        **IMAGE,
        "signerStatus": "removed",
    }


def test_node_events_decode_once_into_their_union() -> None:
    changed = NodeChanged(
        node_id="node_1",
        state="ready",
        workflow_id=None,
        generation=2,
        observed_generation=1,
        power_state="off",
    )
    # the fields of before (verb only when a request made the change), and the tag
    assert _json(changed) == {
        "event": "changed", "nodeId": "node_1", "state": "ready", "workflowId": None, "generation": 2,
        "observedGeneration": 1, "powerState": "off",
    }  # fmt: skip
    assert _json(NodeRemoved(node_id="node_1")) == {"event": "deleted", "nodeId": "node_1", "deleted": True}
    seen = []
    for raw in (msgspec.json.encode(changed), msgspec.json.encode(NodeRemoved(node_id="node_2")), b"{}"):
        match decode_node_event(raw):
            case NodeChanged(state=state):
                seen.append(state)
            case NodeRemoved(node_id=node_id):
                seen.append(f"deleted {node_id}")
            case None:
                seen.append("nothing")
    assert seen == ["ready", "deleted node_2", "nothing"]


async def test_the_engine_client_sends_what_bcx_sent_for_metal_and_images() -> None:
    api = FakeApi(
        {
            "metal.deploy": {**STARTED, "batchId": None},
            "metal.bulk": {"verb": "release", "batchId": None, "started": [], "refused": []},
            "images.register": IMAGE,
            "images.get": {**IMAGE, "signerStatus": "allowlisted"},
        }
    )
    engine = EngineClient(api)  # type: ignore[arg-type]
    run = await engine.run_verb("deploy", node_id="node_1", image="ubuntu@24.04")
    assert (run.workflow_id, run.profile.id, run.batch_id) == ("wf_1", "metal.deploy", None)
    await engine.bulk("release", selector={"site": "lab1", "rack": "r12"})
    image = await engine.register_image(
        name="ubuntu", version="24.04", url=IMAGE["url"], sha256=IMAGE["sha256"], signature=b"\x01\x02",
        signer="acme",
    )  # fmt: skip
    assert image.ref == "ubuntu@24.04"
    assert (await engine.get_image(ref="ubuntu@24.04")).signer_status == "allowlisted"
    assert api.sent[0] == (
        "metal.deploy",
        {"nodeId": "node_1", "tenantId": None, "image": "ubuntu@24.04", "profile": None},
    )
    assert api.sent[1] == (
        "metal.bulk",
        {"verb": "release", "nodeIds": None, "selector": {"site": "lab1", "rack": "r12"}, "tenantId": None,
         "image": None, "profile": None},
    )  # fmt: skip
    registered = api.sent[2][1]
    assert registered["signature"] == base64.b64encode(b"\x01\x02").decode()  # base64, as bcx sent it
    assert (registered["tenantId"], registered["format"], registered["public"]) == ("root", "raw", False)
    assert api.sent[3] == ("images.get", {"tenantId": "root", "ref": "ubuntu@24.04"})


def test_a_bmc_travels_as_the_node_stores_it() -> None:
    bmc = NodeBmc(
        driver="redfish", address="https://10.0.0.1", credentials_ref="sec_01J0000000000000000000000A"
    )
    assert bmc.to_document() == {
        "driver": "redfish", "address": "https://10.0.0.1",
        "credentialsRef": "sec_01J0000000000000000000000A", "insecure": False,
    }  # fmt: skip
