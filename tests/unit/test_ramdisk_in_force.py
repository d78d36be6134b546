"""Which ramdisk ``metal.ensureRamdisk`` boots: the operator's (``bcx ramdisk set``) or the step's."""

from __future__ import annotations

from better_compute.metal.steps.ramdisk import configured_in_force, ramdisk_in_force

OWN = {"kernel": "https://a/vmlinuz", "initrd": "https://a/initrd", "cmdline": "console=ttyS0"}
SET = {"kernel": "https://b/vmlinuz", "initrd": "https://b/initrd"}


def test_the_operators_ramdisk_wins_for_the_shipped_profiles_and_fills_an_empty_step() -> None:
    assert ramdisk_in_force({**OWN, "bmc": {"driver": "sim"}}, SET, shipped=True) == {
        **SET,
        "bmc": {"driver": "sim"},
    }
    assert ramdisk_in_force({}, SET, shipped=False) == SET
    assert ramdisk_in_force({"script": "https://a/boot.ipxe"}, SET, shipped=True) == SET


def test_a_custom_profiles_own_ramdisk_and_no_override_are_left_alone() -> None:
    assert ramdisk_in_force(OWN, SET, shipped=False) == OWN
    assert ramdisk_in_force(OWN, None, shipped=True) == OWN


def test_a_changed_bc_toml_ramdisk_replaces_only_what_the_engines_started_with() -> None:
    """[ramdisk] edited while the engines run (row 2: doc and replaces): the shipped profiles'
    step, which carries the start's ramdisk, and a step with none boot the new one; an app's or a
    custom profile's own ramdisk stays."""
    change = {"doc": SET, "replaces": OWN}
    assert configured_in_force({**OWN, "bmc": {"driver": "sim"}}, change) == {**SET, "bmc": {"driver": "sim"}}
    assert configured_in_force({**OWN, "cmdline": "console=ttyS0"}, change) == SET
    other = {"kernel": "https://c/vmlinuz", "initrd": "https://c/initrd"}
    assert configured_in_force(other, change) == other
    assert configured_in_force({}, {"doc": SET, "replaces": {}}) == SET
    assert configured_in_force({}, change) == {}
