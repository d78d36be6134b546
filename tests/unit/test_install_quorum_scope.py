"""Issue 22 gap 5: the quorum covers installs. A profile whose own steps give the machine a
medium or boot entry to boot must say whether it writes disks; one that does puts every boot
command (the medium, the boot device, the power cycle into it) in its workflow's batch scope."""

from __future__ import annotations

from typing import Any

from bc_engine.resolve import resolve_profile
from bc_engine.steps.quorum import batch_kinds
from better_compute.metal.steps.profiles import lifecycle_profiles
from better_compute.provision import define_profile, profile_from_document
from better_compute.testing.metal_sim.app import AUTOINSTALL_STEPS, app


def _profile(**over: Any) -> Any:
    return define_profile(
        id="installer", version=1, target="metal", role="host", steps=AUTOINSTALL_STEPS, **over
    )


def _scope(profile: Any) -> list[str]:
    res = resolve_profile(app, profile, has_node=True)
    assert res.problems == []
    return sorted(batch_kinds(app, res.command_kinds, writes_disk=profile.writes_disk))


def test_a_profile_that_boots_a_medium_without_saying_whether_it_writes_a_disk_is_refused() -> None:
    res = resolve_profile(app, _profile())
    [problem] = res.problems
    assert (problem.path, problem.code) == ("writesDisk", "INVALID_CONFIG")
    assert "steps[1] (media.insert)" in problem.message
    entry = {"mac": "52:54:00:00:00:01", "script": "#!ipxe"}
    netboot = define_profile(
        id="pxe-installer", version=1, target="metal", role="host",
        steps=[{"use": "netboot.setEntry", "on": "site", "with": entry}],
    )  # fmt: skip
    assert [p.path for p in resolve_profile(app, netboot).problems] == ["writesDisk"]
    # said either way, it validates; the document keeps it
    assert resolve_profile(app, _profile(writes_disk=False)).problems == []
    assert profile_from_document(_profile(writes_disk=True).to_document()).writes_disk is True


def test_the_boot_commands_of_a_profile_that_writes_disks_are_in_its_batch_scope() -> None:
    # the page's installer: nothing destructive is sent, yet the disk is rewritten
    assert _scope(_profile(writes_disk=False)) == []
    # (wait.agentJoined ejects a ramdisk's token medium and clears its boot entries)
    assert _scope(_profile(writes_disk=True)) == [
        "management.setBootDevice", "media.eject", "media.insert", "netboot.clearEntry", "power.setPower",
    ]  # fmt: skip
    shipped = {p.id: p for p in lifecycle_profiles()}
    # the ramdisk's boot: a token medium (a BMC with virtual media), the entries, the cycle
    boots = ["management.setBootDevice", "media.eject", "media.insert", "netboot.clearEntry",
             "netboot.setEntry", "power.setPower"]  # fmt: skip
    assert _scope(shipped["metal.inspect"]) == []  # the ramdisk reads, writes nothing
    assert _scope(shipped["metal.commission"]) == sorted([*boots, "node.wipe"])
    assert _scope(shipped["metal.deploy"]) == sorted([*boots, "node.imageWrite"])
    assert _scope(shipped["metal.release"]) == sorted([*boots, "node.wipe"])
    assert _scope(shipped["metal.retire"]) == sorted([*boots, "node.wipe"])
