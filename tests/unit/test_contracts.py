"""The contracts of issue 9: replies and events keep their JSON, events decode once into their
union, and the engine's client sends the same requests as the hand-built dicts did."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import pytest

from better_compute.clients import EngineClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import AgentIdentity, new_agent_key, sign_event
from better_compute.wire.agent import Ack, Heartbeat, Hello, open_event, read_event
from better_compute.wire.cmdq import CommandEvent, decode_command_event
from better_compute.wire.engine import (
    NodeView,
    StepChange,
    StepChanged,
    VerbApplied,
    WorkflowFinished,
    WorkflowProfile,
    WorkflowView,
    decode_workflow_event,
)

pytestmark = pytest.mark.unit


class FakeApi:
    """Answers each route with a canned reply and keeps what was sent, as JSON."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies
        self.sent: list[tuple[str, str, Any]] = []

    async def call_as(self, service: str, route: str, payload: Any, typ: type[Any], **_: Any) -> Any:
        self.sent.append((service, route, msgspec.json.decode(msgspec.json.encode(payload))))
        return msgspec.convert(self.replies[route], typ, strict=False)


WORKFLOW = {
    "id": "wf_1", "tenantId": "root", "nodeId": None,
    "profile": {"tenantId": "builtin", "id": "p", "version": 1}, "state": "running", "owner": None,
    "commandKinds": [], "batchId": None, "error": None, "createdAt": "2026-12-01T09:00:00+00:00",
    "finishedAt": None, "queued": False,
}  # fmt: skip


def test_a_workflow_without_steps_leaves_steps_and_their_cursor_out() -> None:
    view = msgspec.convert(WORKFLOW, WorkflowView)
    assert msgspec.json.decode(msgspec.json.encode(view)) == WORKFLOW
    paged = msgspec.structs.replace(view, steps=[], steps_next=None)
    assert msgspec.json.decode(msgspec.json.encode(paged)) == {**WORKFLOW, "steps": [], "stepsNext": None}


def test_a_node_reply_has_the_fields_of_the_old_document() -> None:
    node = NodeView(
        id="node_1", tenant_id="root", site_id="lab1", labels={"rack": "4"}, generation=1,
        observed_generation=0, created_at="2026-12-01T09:00:00+00:00",
    )  # fmt: skip
    # the document as metal's nodes.* wrote it: the lifecycle fields, the inventory's summary
    assert list(msgspec.json.decode(msgspec.json.encode(node))) == [
        "id", "tenantId", "siteId", "labels", "macs", "bmc", "state", "stateReason", "workflowId",
        "powerState", "image", "lastError", "generation", "observedGeneration", "inventorySummary",
        "hardware", "enrolledByRule", "quarantine", "maintenance", "discoveryConflict", "pendingEnrollment",
        "name", "bmcInventory", "createdAt", "updatedAt",
    ]  # fmt: skip
    # nodes.get adds the inventory, the host section and the workflow moving the node
    full = msgspec.structs.replace(node, inventory=None, host_section=None, current_workflow=None)
    assert list(msgspec.json.decode(msgspec.json.encode(full)))[-3:] == [
        "inventory", "hostSection", "currentWorkflow",
    ]  # fmt: skip


async def test_the_engine_client_sends_what_the_dicts_sent_and_returns_structs() -> None:
    api = FakeApi(
        {"workflows.start": {**WORKFLOW, "steps": []}, "workflows.abort": {**WORKFLOW, "steps": []}}
    )
    engine = EngineClient(api)  # type: ignore[arg-type]
    wf = await engine.start_workflow(profile_id="p", node_id="node_1", owner="me")
    assert wf.profile == WorkflowProfile(tenant_id="builtin", id="p", version=1)
    assert wf.steps == []
    await engine.abort_workflow(id="wf_1", reason="no")
    sent_id = api.sent[0][2].pop("id")
    assert sent_id.startswith("wf_")  # chosen by the client, so a retry can say it again
    assert api.sent[0] == (
        "engine", "workflows.start",
        {"tenantId": "root", "profileId": "p", "profileVersion": None, "nodeId": "node_1", "owner": "me"},
    )  # fmt: skip
    assert api.sent[1][2] == {"id": "wf_1", "reason": "no"}


class LosingApi(FakeApi):
    """The first ``lose`` calls get no answer (TIMEOUT), as when the engine dies mid-reply."""

    def __init__(self, replies: dict[str, Any], lose: int) -> None:
        super().__init__(replies)
        self.lose = lose

    async def call_as(self, service: str, route: str, payload: Any, typ: type[Any], **kw: Any) -> Any:
        got = await super().call_as(service, route, payload, typ, **kw)
        if self.lose:
            self.lose -= 1
            raise BcError(ErrorCode.TIMEOUT, f"{route} did not answer")
        return got


async def test_a_start_whose_answer_is_lost_is_asked_again_with_the_same_id() -> None:
    api = LosingApi({"workflows.start": {**WORKFLOW, "steps": []}}, lose=2)
    wf = await EngineClient(api).start_workflow(profile_id="p")  # type: ignore[arg-type]
    assert wf.id == "wf_1"
    assert len(api.sent) == 3
    assert len({sent["id"] for _, _, sent in api.sent}) == 1
    api = LosingApi({"workflows.start": {**WORKFLOW, "steps": []}}, lose=3)
    with pytest.raises(BcError) as e:  # three tries, then the caller hears of it
        await EngineClient(api).start_workflow(profile_id="p", id="wf_01M8S3TDWXXK9J7GZ70BD5587P")  # type: ignore[arg-type]
    assert e.value.code is ErrorCode.TIMEOUT
    assert [sent["id"] for _, _, sent in api.sent] == ["wf_01M8S3TDWXXK9J7GZ70BD5587P"] * 3


def test_workflow_events_decode_once_into_their_union() -> None:
    step = StepChanged(
        workflow_id="wf_1", node_id=None, workflow_state="running", at=1.0,
        step=StepChange(index=0, action="a", state="running", attempt=1),
    )  # fmt: skip
    data = msgspec.json.encode(step)
    # the fields of before, and the tag; unset error/waitingFor stay out as they did
    assert msgspec.json.decode(data) == {
        "event": "step", "workflowId": "wf_1", "nodeId": None, "workflowState": "running", "at": 1.0,
        "step": {"index": 0, "action": "a", "state": "running", "attempt": 1},
    }  # fmt: skip
    verb = VerbApplied(workflow_id="wf_1", workflow_state="aborted", verb="abort")
    seen = []
    for raw in (data, msgspec.json.encode(verb)):
        match decode_workflow_event(raw):
            case StepChanged(step=StepChange(index=i)):
                seen.append(("step", i))
            case VerbApplied(verb=name):
                seen.append(("verb", name))
            case WorkflowFinished() | None:
                seen.append(("other", None))
    assert seen == [("step", 0), ("verb", "abort")]
    assert decode_workflow_event(b"changed") is None
    assert decode_workflow_event(b'{"event": "sideways", "workflowId": "wf_1"}') is None


def test_a_command_event_is_tagged_and_an_untagged_one_still_reads() -> None:
    event = CommandEvent(id="cmd_1", key="k", node_id="node_1", state="succeeded")
    assert msgspec.json.decode(msgspec.json.encode(event))["event"] == "command"
    untagged = b'{"id": "cmd_1", "key": "k", "nodeId": "node_1", "state": "succeeded"}'
    assert decode_command_event(untagged) == event


def test_an_agent_event_is_read_as_the_kind_its_subject_names() -> None:
    identity = AgentIdentity(cert_id="cert_1", agent_id="agent_1", private_key=new_agent_key())
    base = {"site": "lab1", "agent": "agent_1", "signer_id": "cert_1", "signed_at_ms": 1}
    doc, signature = open_event(sign_event(identity, "heartbeat", Heartbeat(**base, running=2)))
    assert base64.b64encode(signature)
    assert doc["event"] == "heartbeat"
    assert read_event("heartbeat", doc) == Heartbeat(**base, running=2)
    # the subject wins over the tag a document names
    assert isinstance(read_event("hello", doc), Hello)
    with pytest.raises(BcError) as e:
        read_event("ack", doc)  # an ack needs its command and digest
    assert e.value.code is ErrorCode.INVALID_INPUT
    assert e.value.path in ("commandId", "digest")
    assert isinstance(read_event("ack", {**doc, "commandId": "cmd_1", "digest": "00"}), Ack)
