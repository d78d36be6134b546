"""Issue 22: what an abort undoes at the site (from the aborted workflow's own commands), and
which command kinds run again after their agent died while running them."""

from __future__ import annotations

from typing import Any

from bc_engine.metal.lifecycle import _undo_plan
from better_compute.metal.commands import COMMAND_KINDS
from better_compute.wire.cmdq import CommandView

BMC = {"driver": "redfish", "address": "https://10.0.0.9"}


def _cmd(
    kind: str, payload: dict[str, Any], state: str = "succeeded", progress: str | None = None
) -> CommandView:
    return CommandView(
        id=f"cmd_{kind}", node_id="node_x", site_id="lab1", kind=kind, key="k", state=state,  # type: ignore[arg-type]
        payload=payload, progress=progress,
    )  # fmt: skip


def test_an_abort_undoes_what_reached_the_site_and_nothing_the_workflow_undid_itself() -> None:
    sent = [
        _cmd("management.setBootDevice", {"device": "pxe", "bmc": BMC}),
        _cmd("netboot.setEntry", {"mac": "52-54-00-00-00-01", "kernel": "http://k"}, state="cancelled"),
        _cmd("media.insert", {"url": "http://iso", "device": "cd", "bmc": BMC}),
        _cmd("media.eject", {"device": "cd", "bmc": BMC}),
        # cancelled before its agent made a try: it never reached the BMC
        _cmd("power.setPower", {"action": "cycle", "bmc": BMC}, state="cancelled"),
    ]
    assert _undo_plan(sent) == {
        "boot-device": ("management.setBootDevice", {"device": "disk", "bmc": BMC}),
        "netboot-52:54:00:00:00:01": ("netboot.clearEntry", {"mac": "52:54:00:00:00:01"}),
    }
    # a power cycle its agent tried before the cancel stopped it is undone too
    cycle = {"action": "cycle", "bmc": BMC}
    tried = _cmd("power.setPower", cycle, state="cancelled", progress="try 2: POST …")
    assert _undo_plan([tried]) == {"power": ("power.setPower", {"action": "off", "bmc": BMC})}
    # a driver operation counts as its operation
    invoked = _cmd("driver.invoke", {"operation": "power.setPower", "input": {"action": "on", "bmc": BMC}})
    assert _undo_plan([invoked]) == {"power": ("power.setPower", {"action": "off", "bmc": BMC})}


def test_only_idempotent_payloads_of_non_destructive_kinds_run_again() -> None:
    power = COMMAND_KINDS["power.setPower"]
    assert power.reruns({"action": "on"})
    assert power.reruns({"action": "off"})
    assert not power.reruns({"action": "cycle"})  # twice is a second interruption
    assert not power.reruns({"action": "reset"})
    assert COMMAND_KINDS["management.setBootDevice"].reruns({"device": "pxe"})
    assert COMMAND_KINDS["media.eject"].reruns({"device": "cd"})
    assert not COMMAND_KINDS["media.insert"].reruns({"url": "http://iso"})
    assert not COMMAND_KINDS["node.wipe"].reruns({})
    invoke = {"operation": "power.setPower", "input": {"action": "on"}}
    assert not COMMAND_KINDS["driver.invoke"].reruns(invoke)  # destructive
