"""The rollout view's bookkeeping (``cli.rollout.Progress``): what ends a watch, what a line
shows, and the summary's durations and failed steps, from node reads and step events."""

from __future__ import annotations

import io
import json
from typing import Any

import msgspec
import pytest

from better_compute.cli.rollout import Progress, _Plain, final_states
from better_compute.core.errors import BcError
from better_compute.wire.engine import (
    CurrentStep,
    CurrentWorkflow,
    NodeChanged,
    NodeView,
    StepChange,
    StepChanged,
)

pytestmark = pytest.mark.unit


def node(
    id: str, state: str, *, step: tuple[int, str] | None = None, wf: str | None = "wf_1", **kw: Any
) -> NodeView:
    current = None
    if step is not None:
        current = CurrentWorkflow(
            id=wf or "wf_1", state="running", profile_id="p", batch_id=kw.pop("batch", None),
            step=CurrentStep(index=step[0], action=step[1]), waiting_for=kw.pop("waiting", None),
        )  # fmt: skip
    return NodeView(
        id=id, tenant_id="root", site_id="lab1", labels={}, state=state, workflow_id=wf, generation=1,
        observed_generation=1, created_at=None, current_workflow=current, **kw,
    )  # fmt: skip


def test_final_states_are_the_verbs_resting_state_or_failed_else_anything_not_moving() -> None:
    assert final_states("deploy") == {"deployed", "failed"}
    assert final_states("commission") == {"ready", "failed"}
    resting = final_states(None)
    assert {"ready", "deployed", "discovered", "failed"} <= resting
    assert not {"deploying", "inspecting", "releasing"} & resting
    with pytest.raises(BcError):
        final_states("reboot")


def test_a_node_moves_through_its_steps_to_its_end_with_its_duration() -> None:
    p = Progress([node("n1", "ready", wf=None)], final_states("deploy"), started=1000.0)
    assert not p.done
    assert p.apply_node(node("n1", "deploying", step=(0, "autoinstall.renderIso")), (990.0, None), 1001.0)
    assert p.rows["n1"].step == "0 autoinstall.renderIso"
    assert p.rows["n1"].elapsed(1005.0) == 15.0  # since its workflow was created
    event = StepChanged(
        workflow_id="wf_1", node_id="n1", workflow_state="running", at=1002.0,
        step=StepChange(index=3, action="power.setPower", state="running", attempt=1),
    )  # fmt: skip
    assert p.apply_step(event)
    assert not p.apply_step(event)  # nothing new to show
    assert p.rows["n1"].step == "3 power.setPower"
    assert p.apply_node(node("n1", "deployed", wf=None), (None, None), 1030.0)
    assert p.done
    [row] = p.summary(1100.0)
    assert (row["state"], row["seconds"], row["failedStep"]) == ("deployed", 40.0, None)


def test_a_failed_node_names_its_step_and_error_and_approvals_show_while_they_are_awaited() -> None:
    waits = {"reason": "batch-approval", "batchId": "batch_1", "approvals": 0, "threshold": 2}
    p = Progress([node("n1", "ready", wf=None)], final_states("release"), started=0.0)
    p.apply_node(node("n1", "releasing", step=(2, "disk.wipe"), waiting=waits), (0.0, None), 1.0)
    assert p.rows["n1"].step == "2 disk.wipe (waits for approvals: 0 of 2)"
    reason = {"workflowId": "wf_1", "verb": "release", "step": "disk.wipe", "code": "DRIVER_ERROR",
              "message": "EIO"}  # fmt: skip
    p.apply_node(node("n1", "failed", wf=None, state_reason=reason), (0.0, 9.0), 12.0)
    assert p.done
    [row] = p.summary(20.0)
    assert (row["state"], row["failedStep"], row["error"], row["seconds"]) == (
        "failed",
        "disk.wipe",
        "DRIVER_ERROR: EIO",
        12.0,
    )


def test_a_node_that_ended_before_the_watch_began_takes_its_workflows_own_times() -> None:
    reason = {"workflowId": "wf_9", "step": "x", "code": "C", "message": "m"}
    p = Progress([node("n1", "failed", wf=None)], final_states(None), started=500.0)
    p.apply_node(node("n1", "failed", wf=None, state_reason=reason), (100.0, 130.0), 500.0)
    assert p.summary(600.0)[0]["seconds"] == 30.0


def test_plain_lines_show_each_change_and_the_counts_when_they_change() -> None:
    p = Progress(
        [node("a", "ready", wf=None), node("b", "ready", wf=None)], final_states("deploy"), started=0.0
    )
    out = io.StringIO()
    view = _Plain(out, as_json=False)
    p.apply_node(node("a", "deploying", step=(1, "media.insert")), (0.0, None), 2.0)
    view.show(p, ["a"], 2.0)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["2.0s", "a", "deploying", "1", "media.insert"]
    assert lines[1].strip() == "ready 1, deploying 1"  # in lifecycle order


def test_a_state_the_events_say_a_node_passed_through_is_shown_though_the_read_finds_it_past_it() -> None:
    """The race of the e2e watch test: the engine moved the node to inspecting and on to inspected
    before the watch read it. The event carried ``inspecting``; the watch shows it, then the read,
    and a late event never moves the node back."""
    p = Progress([node("n1", "enrolled", wf=None)], final_states("inspect"), started=0.0)
    out = io.StringIO()
    view = _Plain(out, as_json=True)
    passing = NodeChanged(
        node_id="n1", state="inspecting", workflow_id="wf_9", generation=1, observed_generation=1,
        power_state=None,
    )  # fmt: skip
    assert p.apply_passing(passing, 1.0)
    view.show(p, ["n1"], 1.0)
    assert p.apply_node(node("n1", "inspected", wf="wf_9"), (1.0, 2.0), 2.0)
    view.show(p, ["n1"], 2.0)
    assert [json.loads(line)["state"] for line in out.getvalue().splitlines()] == ["inspecting", "inspected"]
    assert not p.apply_passing(passing, 3.0)  # late: the read already put it at its end
    assert p.rows["n1"].state == "inspected"
    assert p.summary(5.0)[0]["seconds"] == 1.0
    # the next verb's workflow is new: its running state shows again
    again = msgspec.structs.replace(passing, workflow_id="wf_10")
    assert p.apply_passing(again, 6.0)
    assert p.rows["n1"].state == "inspecting"


def test_the_line_says_what_the_step_waits_for_as_why_does() -> None:
    p = Progress([node("n1", "ready", wf=None)], final_states("inspect"), started=0.0)
    waits = {"reason": "step-not-ready", "message": "no agent at site lab1 (last seen 12s ago)"}
    assert p.apply_node(
        node("n1", "inspecting", step=(1, "wait.agentJoined"), waiting=waits), (0.0, None), 1.0
    )
    assert p.rows["n1"].step == "1 wait.agentJoined (waits: no agent at site lab1 (last seen 12s ago))"
    same = StepChanged(
        workflow_id="wf_1", node_id="n1", workflow_state="running", at=2.0,
        step=StepChange(index=1, action="wait.agentJoined", state="running", attempt=1),
    )  # fmt: skip
    assert not p.apply_step(same)  # the same step: the reason stays on the line
    away = {"reason": "service-unavailable", "service": "pki", "code": "UNAVAILABLE", "tries": 4}
    assert p.apply_node(
        node("n1", "inspecting", step=(1, "wait.agentJoined"), waiting=away), (0.0, None), 3.0
    )
    assert p.rows["n1"].step == "1 wait.agentJoined (waits: pki unavailable (4 tries))"
