"""Metal's lifecycle table, selectors, BMC URLs, inline credentials, the verb-profile mapping, the
BMC relay and the node document: pure logic."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from bc_engine.documents import node_doc
from bc_engine.metal.lifecycle import HOST_LOOK_MAX_MS, HOST_LOOK_MS, host_look_ms, record_command_result
from bc_engine.metal.relay import needs_bmc, relay_bmc
from bc_engine.metal.store import OBSERVED_GENERATION
from better_compute.app import better_compute
from better_compute.cli.metal_commands import read_credentials, show_lines
from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal import metal
from better_compute.metal.lifecycle import (
    DEFAULT_PROFILES,
    NODE_STATES,
    TRANSITIONS,
    check_verb,
    parse_bmc_url,
    parse_selector,
)
from better_compute.wire.commands import ConvergeResult, UnitReport
from better_compute.wire.engine import CurrentStep, CurrentWorkflow
from better_compute.wire.metal import find_inline_secret, normal_mac

BMC = {"driver": "redfish", "address": "https://10.0.0.1", "credentialsRef": "sec_01JB0000000000000000000000"}


def test_every_transition_names_known_states_and_resting_states_only_start_verbs() -> None:
    running = {t.running for t in TRANSITIONS.values()}
    for t in TRANSITIONS.values():
        assert {*t.start, t.running, t.done} <= set(NODE_STATES)
        assert not set(t.start) & running  # a verb never starts while another one runs
    assert TRANSITIONS["deploy"].start == ("ready",)
    assert (TRANSITIONS["release"].running, TRANSITIONS["release"].done) == ("releasing", "ready")
    assert TRANSITIONS["adopt"].done == "deployed"


def test_a_verb_in_the_wrong_state_says_why() -> None:
    assert check_verb("node_1", "ready", "deploy").running == "deploying"
    with pytest.raises(BcError) as err:
        check_verb("node_1", "deploying", "release")
    assert err.value.code is ErrorCode.INVALID_STATE
    assert err.value.message == "node node_1 is deploying; release needs deployed or failed"
    assert (err.value.details["reason"], err.value.details["state"]) == ("wrong-state", "deploying")
    with pytest.raises(BcError) as err:
        check_verb("node_1", "ready", "explode")
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_INPUT, "verb")
    for verb in TRANSITIONS:
        with pytest.raises(BcError):
            check_verb("node_1", "retired", verb)


def test_selectors() -> None:
    assert parse_selector("site=lab1,rack=r12") == {"site": "lab1", "rack": "r12"}
    assert parse_selector(" rack = r12 ".replace(" ", "")) == {"rack": "r12"}
    for bad in ("", "rack", "=x", "rack=a=b", "a b=c"):
        with pytest.raises(BcError) as err:
            parse_selector(bad)
        assert (err.value.code, err.value.path) == (ErrorCode.INVALID_INPUT, "selector")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redfish://10.0.0.5/redfish/v1/Systems/1",
         {"driver": "redfish", "address": "https://10.0.0.5", "systemId": "/redfish/v1/Systems/1"}),
        ("redfish://bmc.lab:8443", {"driver": "redfish", "address": "https://bmc.lab:8443"}),
        ("redfish+http://[fd00::5]:8000/", {"driver": "redfish", "address": "http://[fd00::5]:8000"}),
        ("ipmi://10.0.0.6:623", {"driver": "ipmi", "address": "10.0.0.6:623"}),
        ("sim://bmc-7", {"driver": "sim", "address": "bmc-7"}),
    ],
)  # fmt: skip
def test_bmc_urls(url: str, expected: dict[str, Any]) -> None:
    assert parse_bmc_url(url) == expected


@pytest.mark.parametrize(
    "url", ["https://10.0.0.5", "redfish://admin:hunter2@10.0.0.5", "redfish://", "redfish://h:99999"]
)
def test_bad_bmc_urls_are_refused_without_repeating_them(url: str) -> None:
    with pytest.raises(BcError) as err:
        parse_bmc_url(url)
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_INPUT, "bmc")
    assert "hunter2" not in err.value.message


def test_inline_credentials_are_found_anywhere() -> None:
    assert find_inline_secret({"bmc": {**BMC, "password": "x"}}) == "bmc.password"
    assert find_inline_secret({"nodes": [{}, {"bmc": {"Secret": "x"}}]}) == "nodes[1].bmc.Secret"
    assert find_inline_secret({"bmc": BMC, "siteId": "lab1"}) is None  # credentialsRef is the way
    assert normal_mac("52-54-00-AA-BB-CC") == "52:54:00:aa:bb:cc"


def test_the_verbs_profiles_can_be_overridden_and_unknown_verbs_are_refused() -> None:
    assert metal().verb_profiles == DEFAULT_PROFILES
    assert dict(metal(profiles={"deploy": "acme.deploy"}).verb_profiles) == {
        **DEFAULT_PROFILES,
        "deploy": "acme.deploy",
    }
    with pytest.raises(BcError) as err:
        metal(profiles={"explode": "x"})
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_CONFIG, "profiles.explode")


def test_the_engine_relays_the_nodes_bmc_to_bmc_commands_only() -> None:
    app = better_compute(modules=[metal()])
    assert relay_bmc(app, "power.setPower", {"action": "on"}, "node_1", BMC) == {"action": "on", "bmc": BMC}
    given = {"action": "on", "bmc": {"driver": "sim", "address": "x"}}
    assert relay_bmc(app, "power.setPower", given, "node_1", BMC) == given  # the step's own wins
    invoke = {"operation": "media.eject", "input": {"device": "cd"}}
    assert relay_bmc(app, "driver.invoke", invoke, "node_1", BMC)["input"]["bmc"] == BMC
    netboot = {"operation": "netboot.clearEntry", "input": {"mac": "52:54:00:00:00:01"}}
    assert relay_bmc(app, "driver.invoke", netboot, "node_1", None) == netboot
    assert relay_bmc(app, "node.wipe", {}, "node_1", None) == {}
    with pytest.raises(BcError) as err:
        relay_bmc(app, "management.setBootDevice", {"device": "pxe"}, "node_9", None)
    assert (err.value.code, err.value.details["reason"]) == (ErrorCode.INVALID_STATE, "no-bmc")
    assert err.value.message.startswith("node node_9 has no BMC")
    # the engine reads a node for a command only when it fills its BMC
    assert needs_bmc(app, "power.setPower", {"action": "on"})
    assert not needs_bmc(app, "power.setPower", given)
    assert needs_bmc(app, "driver.invoke", invoke)
    assert not needs_bmc(app, "driver.invoke", netboot)
    assert not needs_bmc(app, "node.wipe", {})
    assert not needs_bmc(app, "no.suchKind", {})


def test_the_node_document_summarises_the_inventory() -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    row = {
        "id": "node_1", "tenant_id": "root", "site_id": "lab1", "labels": {"rack": "r1"},
        "macs": ["52:54:00:00:00:01"], "bmc": BMC, "state": "inspected", "state_reason": None,
        "workflow_id": None, "power_state": "off", "image": None, "last_error": None, "generation": 1,
        "observed_generation": 0, "host_section": None, "created_at": now, "updated_at": now,
        "inventory": {"cpus": {"model": "EPYC", "cores": 64}, "memory": {"totalBytes": 1 << 40},
                      "disks": [{}, {}], "nics": [{}], "gpus": []},
    }  # fmt: skip
    doc = msgspec.to_builtins(node_doc(row))  # the reply as it travels
    assert doc["inventorySummary"] == {
        "cpuModel": "EPYC", "cores": 64, "memoryBytes": 1 << 40, "disks": 2, "nics": 1, "gpus": 0,
    }  # fmt: skip
    assert "inventory" not in doc
    assert msgspec.to_builtins(node_doc(row, full=True))["inventory"] == row["inventory"]


def test_nodes_show_says_what_the_workflow_waits_for() -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    row = {
        "id": "node_1", "tenant_id": "root", "site_id": "lab1", "labels": {}, "macs": [], "bmc": None,
        "state": "releasing", "state_reason": None, "workflow_id": "wf_1", "power_state": None,
        "image": None, "last_error": None, "generation": 1, "observed_generation": 0, "host_section": None,
        "inventory": None, "created_at": now, "updated_at": now,
    }  # fmt: skip
    doc = node_doc(row, full=True, current_workflow=CurrentWorkflow(
        id="wf_1", state="running", profile_id="metal.release", batch_id="batch_1",
        step=CurrentStep(index=2, action="disk.wipe"),
        waiting_for={"reason": "batch-approval", "batchId": "batch_1", "approvals": 1, "threshold": 2},
    ))  # fmt: skip
    text = "\n".join(show_lines(doc))
    assert "state       releasing" in text
    assert "  step      2 disk.wipe" in text
    assert "  waits for approvals of batch batch_1: 1 of 2" in text


def test_nodes_show_says_what_a_failed_verb_left_and_maintenance() -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    left = "deploy failed at deploy.deploy: the disk may hold part of an image; run deploy again or release"
    reason = {"workflowId": "wf_1", "verb": "deploy", "step": "deploy.deploy", "code": "DRIVER_ERROR",
              "message": "write failed", "left": left, "image": "ubuntu@24.04"}  # fmt: skip
    row = {
        "id": "node_1", "tenant_id": "root", "site_id": "lab1", "labels": {}, "macs": [], "bmc": None,
        "state": "failed", "state_reason": reason, "workflow_id": None, "power_state": None,
        "image": None, "last_error": reason, "generation": 1, "observed_generation": 0, "host_section": None,
        "inventory": None, "created_at": now, "updated_at": now,
        "maintenance": {"reason": "PSU swap", "by": "ann@ops", "at": "2026-12-01T00:00:00+00:00"},
    }  # fmt: skip
    lines = show_lines(node_doc(row, full=True))
    assert "image       -" in lines
    assert f"left        {left}" in lines
    assert any(line.startswith("maintenance PSU swap (set by ann@ops at 2026-12-01") for line in lines), lines


def test_credentials_come_from_a_file_and_a_bad_file_is_not_quoted(tmp_path: Any) -> None:
    good = tmp_path / "c.txt"
    good.write_text("admin:s3cret:with:colons\n")
    assert read_credentials(str(good), user=None, interactive=False) == (
        b'{"username": "admin", "password": "s3cret:with:colons"}'
    )
    assert read_credentials(None, user=None, interactive=False) is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"username": "admin", "pass": "s3cret"}')
    with pytest.raises(BcError) as err:
        read_credentials(str(bad), user=None, interactive=False)
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_INPUT, "bmcCredentialsFile")
    assert "s3cret" not in err.value.message


_converged = msgspec.to_builtins(
    ConvergeResult(generation=3, observed_generation=3, units=[UnitReport(name="sysctl", status="changed")])
)


class _Db:
    def __init__(self) -> None:
        self.asked: list[tuple[str, tuple[Any, ...]]] = []

    async def fetchrow(self, sql: str, *args: Any) -> None:
        self.asked.append((sql, args))


@pytest.mark.parametrize(
    ("result", "recorded"),
    [
        # bcd's node.converge result, as it sends it: the generation it observed is recorded
        (_converged, 3),
        ({"generation": 3, "observedGeneration": 2, "units": [{"name": "x", "status": "new-word"}]}, 2),
        ({"generation": 3, "observedGeneration": "3"}, None),  # does not fit: says nothing
        (None, None),
    ],
)
async def test_a_converge_result_records_the_generation_bcd_observed(
    result: Any, recorded: int | None
) -> None:
    db = _Db()
    await record_command_result(SimpleNamespace(db=db), "node_1", "node.converge", None, result)  # type: ignore[arg-type]
    assert db.asked == ([(OBSERVED_GENERATION, ("node_1", recorded))] if recorded is not None else [])


def test_a_live_converge_is_looked_at_less_often_the_longer_it_waits() -> None:
    """Its settle event wakes the node's key; the look stands in for a lost one. A node that is
    off (its bcd never comes) was an enqueue every 10 s for the converge's hour: 360 per node."""
    sent = 1_000_000.0
    looks, now = 0, sent
    while now < sent + 3600:
        now += host_look_ms(sent, now) / 1000
        looks += 1
    assert host_look_ms(sent, sent + 0.5) == HOST_LOOK_MS  # at first as before
    assert host_look_ms(sent, sent + 120) == 120_000
    assert host_look_ms(sent, sent + 7200) == HOST_LOOK_MAX_MS
    assert looks <= 15, looks  # an hour's wait: at 10, 20, 40, 80 s …, then 10 minutes apart
