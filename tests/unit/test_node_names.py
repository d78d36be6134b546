"""Node names on bcx's command line (issue 26): a name or site/name becomes the node's id before
the command runs, an id is left alone without a request; the BMC's view in one line; the reason a
watch line takes from bcx why."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from better_compute.cli.main import build_parser
from better_compute.cli.metal_commands import _checks_of, _inventory_check, bmc_view
from better_compute.cli.node_refs import NodeRef, resolve_node, run
from better_compute.cli.why_commands import why_reason
from better_compute.core.errors import BcError
from better_compute.wire.engine import NodeList, NodeView, WhyAnswer, WhyReason, WorkflowStep


def _node(node_id: str, site: str, name: str) -> NodeView:
    return NodeView(
        id=node_id, tenant_id="root", site_id=site, labels={}, name=name, generation=1,
        observed_generation=1, created_at=None,
    )  # fmt: skip


class FakeEngine:
    """``list_nodes`` over a few nodes, filtered by name and site as the engine does."""

    def __init__(self, *nodes: NodeView) -> None:
        self.nodes = nodes
        self.asked: list[dict[str, Any]] = []

    async def list_nodes(self, *, name: str, site_id: str | None, limit: int) -> NodeList:
        self.asked.append({"name": name, "site": site_id})
        found = [n for n in self.nodes if n.name == name and site_id in (None, n.site_id)]
        return NodeList(nodes=found[:limit])


NODES = (_node("node_a", "lab1", "m1"), _node("node_b", "lab1", "m2"), _node("node_c", "lab2", "m2"))


async def test_a_name_is_the_nodes_id_and_site_name_picks_between_sites() -> None:
    engine = FakeEngine(*NODES)
    assert await resolve_node(engine, "m1", path="id") == "node_a"  # type: ignore[arg-type]
    assert await resolve_node(engine, "lab2/m2", path="id") == "node_c"  # type: ignore[arg-type]
    with pytest.raises(BcError) as ambiguous:
        await resolve_node(engine, "m2", path="node")  # type: ignore[arg-type]
    assert (ambiguous.value.code.value, ambiguous.value.details) == (
        "INVALID_INPUT", {"path": "node", "reason": "ambiguous-name"},
    )  # fmt: skip
    assert "lab1/m2" in ambiguous.value.message
    with pytest.raises(BcError) as missing:
        await resolve_node(engine, "m3", path="id")  # type: ignore[arg-type]
    assert (missing.value.code.value, missing.value.details["path"]) == ("NOT_FOUND", "id")
    with pytest.raises(BcError) as bad:
        await resolve_node(engine, "Not A Name", path="id")  # type: ignore[arg-type]
    assert bad.value.code.value == "INVALID_INPUT"
    # an id (it has a '_', a name never does) costs no request
    engine.asked.clear()
    assert await resolve_node(engine, "node_zzz", path="id") == "node_zzz"  # type: ignore[arg-type]
    assert engine.asked == []


async def test_run_hands_the_command_plain_ids_and_makes_no_request_for_ids() -> None:
    seen: dict[str, Any] = {}

    async def command(args: argparse.Namespace, settings: Any) -> int:
        seen.update(vars(args))
        return 0

    args = build_parser(["inspect", "node_x"]).parse_args(["inspect", "node_x"])
    assert isinstance(args.node, NodeRef)
    args.func = command
    assert await run(args, settings=None) == 0  # type: ignore[arg-type]  # no settings: no bus
    assert seen["node"] == "node_x"
    assert type(seen["node"]) is str  # the codec encodes str, not a subclass
    bulk = build_parser(["bulk"]).parse_args(["bulk", "inspect", "--node", "node_1", "--node", "node_2"])
    bulk.func = command
    await run(bulk, settings=None)  # type: ignore[arg-type]
    assert [type(v) for v in seen["node"]] == [str, str]


def test_the_bmc_view_in_one_line() -> None:
    assert bmc_view(None) is None
    line = bmc_view({
        "system": {"manufacturer": "Dell", "model": "R650", "serial": "SN1", "powerState": "Off"},
        "processors": [{"cores": 16}, {"cores": 16}], "memory": {"totalGiB": 256}, "nics": [{}, {}, {}],
    })  # fmt: skip
    assert line == "Dell R650, serial SN1, 2 processors (32 cores), 256 GiB, 3 NICs, power off"
    assert bmc_view({"system": {}}) == "a machine"


def test_the_watch_line_takes_the_first_reason_that_says_what_it_waits_for() -> None:
    def answer(*kinds: str, waiting: bool = True) -> WhyAnswer:
        return WhyAnswer(
            node_id="node_a", workflow_id="wf_1", workflow_state="running", waiting=waiting, answer="…",
            reasons=[WhyReason(kind=k, text=f"{k} text", facts={}) for k in kinds],
        )  # fmt: skip

    assert why_reason(answer("running", "no-agent", "deadline")) == "no-agent text"
    assert why_reason(answer("running", "deadline")) is None
    assert why_reason(answer("finished", waiting=False)) is None
    assert why_reason(None) is None


def _step(index: int, action: str, state: str, result: Any = None, error: Any = None) -> WorkflowStep:
    return WorkflowStep(
        index=index, action=action, runs_on="control-plane", mode="control-plane", command=None, state=state,
        attempt=1, started_at=None, deadline=None, finished_at=None, result=result, error=error,
        command_id=None, waiting_for=None,
    )  # fmt: skip


def test_enrolls_checks_come_from_the_result_or_the_error_and_the_read_is_one_more_line() -> None:
    refused = {"check": "credentials", "status": "failed", "message": "the BMC refused the credentials"}
    reach = {"check": "reach", "status": "ok"}
    error = {"code": "DRIVER_ERROR", "message": "…", "details": {"checks": [reach, refused]}}
    failed = _step(0, "enroll.validateBmc", "failed", error=error)
    assert _checks_of(failed) == [reach, refused]
    # the read never ran after a failed check: no line for it
    assert _inventory_check("wf_1", [_step(1, "enroll.readBmc", "pending")]) == []
    # metal.validate's step keeps the agent's answer under result
    ok = _step(0, "management.validate", "succeeded", result={"result": {"checks": [{"check": "reach"}]}})
    assert _checks_of(ok) == [{"check": "reach"}]
    read = _step(1, "enroll.readBmc", "succeeded", result={
        "powerState": "off", "system": {"manufacturer": "Dell", "model": "R650", "serial": "SN1"},
    })  # fmt: skip
    assert _inventory_check("wf_1", [read]) == [
        {"check": "inventory", "status": "ok", "message": "Dell R650, serial SN1, power off"}
    ]
    blank = _step(1, "enroll.readBmc", "succeeded", result={"powerState": None, "system": {}})
    assert _inventory_check("wf_1", [blank])[0]["status"] == "skipped"  # a simulated agent's answer
    broken = _step(1, "enroll.readBmc", "failed", error={"code": "DRIVER_ERROR", "message": "no answer"})
    assert _inventory_check("wf_1", [broken]) == [
        {"check": "inventory", "status": "failed", "message": "workflow wf_1: no answer"}
    ]
