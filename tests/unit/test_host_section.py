"""Host configuration: the when: label grammar, the built-in units' settings, resolve_host_section."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bcd.converger import SUPPORTED_UNITS
from better_compute.core import BcError, ErrorCode
from better_compute.core.manifest import field, manifest
from better_compute.provision import (
    BUILTIN_CONFIG_UNITS,
    ConfigUnit,
    define_profile,
    parse_label_expression,
    provision_module,
    resolve_host_section,
)
from better_compute.provision.profiles import HostUnit

pytestmark = pytest.mark.unit

LABELS = {"gpu": "nvidia", "rack": "r12", "nvidia.com/gpu.product": "H100-SXM5", "site": "lab1"}


def refusal(fn: Callable[[], object]) -> BcError:
    with pytest.raises(BcError) as info:
        fn()
    return info.value


# -- the grammar ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "selected"),
    [
        ("gpu=nvidia", True),
        ("gpu==nvidia", True),
        ("gpu=amd", False),
        ("gpu!=amd", True),
        ("maintenance!=yes", True),  # absent counts as different, as in Kubernetes
        ("rack in (r11, r12)", True),
        ("rack in (r1,r2)", False),
        ("rack notin (r1, r2)", True),
        ("maintenance notin (yes)", True),
        ("gpu exists", True),
        ("gpu", True),
        ("maintenance exists", False),
        ("!maintenance", True),
        ("!gpu", False),
        ("gpu=nvidia and rack=r12", True),
        ("gpu=nvidia, rack=r11", False),
        ("site=lab1,rack=r12", True),
        ('nvidia.com/gpu.product in ("H100-SXM5", A100)', True),
        ('gpu="nvidia"', True),
        ("gpu=nvidia and rack in (r12) and !maintenance and site exists", True),
    ],
)
def test_expressions_select_nodes_by_their_labels(expression: str, selected: bool) -> None:
    assert parse_label_expression(expression).matches(LABELS) is selected


def test_a_quoted_value_may_hold_spaces_commas_and_quotes() -> None:
    labels = {"note": 'a, "b"'}
    assert parse_label_expression(r'note="a, \"b\""').matches(labels)
    assert str(parse_label_expression(r'note="a, \"b\""')) == r'note="a, \"b\""'


def test_an_expression_prints_back_as_itself() -> None:
    text = "gpu=nvidia and rack in (r1, r2) and !maintenance and zone exists and os!=talos"
    assert str(parse_label_expression(text)) == text
    assert str(parse_label_expression("site=lab1,rack=r12")) == "site=lab1 and rack=r12"


@pytest.mark.parametrize(
    ("expression", "at"),
    [
        ("gpu=", 4),
        ("gpu=nvidia and", 14),
        ("gpu=nvidia or rack=r1", 11),
        ("rack in r1", 8),
        ("rack in (r1", 11),
        ("rack in ()", 9),
        ("=nvidia", 0),
        ("gpu=nvidia; rm -rf /", 10),
        ("and=x", 0),
        ("gpu = and", 6),
        ("-gpu", 0),
    ],
)
def test_a_malformed_expression_names_where_it_went_wrong(expression: str, at: int) -> None:
    err = refusal(lambda: parse_label_expression(expression, path="hostConfig.units[0].when"))
    assert err.code is ErrorCode.INVALID_INPUT
    assert err.path == "hostConfig.units[0].when"
    assert err.details["at"] == at, err.message
    assert f"character {at + 1}" in err.message


@pytest.mark.parametrize("bad", ["", "   ", None, 3, "x" * 5000])
def test_an_expression_is_a_non_empty_bounded_string(bad: Any) -> None:
    err = refusal(lambda: parse_label_expression(bad, code=ErrorCode.INVALID_CONFIG))
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "when")


def test_profiles_and_units_refuse_a_malformed_when_where_they_are_defined() -> None:
    err = refusal(
        lambda: define_profile(
            id="gpu-host",
            version=1,
            target="metal",
            role="host",
            steps=[],
            host_config={"units": [{"name": "sysctl", "when": "gpu in nvidia"}]},
        )
    )
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "hostConfig.units[0].when")
    err = refusal(lambda: ConfigUnit(name="acme-x", description="x", settings=manifest({}), when="a=("))
    assert (err.code, err.path) == (ErrorCode.INVALID_CONFIG, "when")


# -- the built-in units --------------------------------------------------------------


def test_the_nine_built_ins_are_the_units_bcd_applies() -> None:
    assert set(BUILTIN_CONFIG_UNITS) == {
        "kernel-modules", "sysctl", "hugepages", "nvidia-driver", "fabric-manager",
        "mig-layout", "gpu-sharing", "container-toolkit", "k8s-join",
    }  # fmt: skip
    assert set(BUILTIN_CONFIG_UNITS) == SUPPORTED_UNITS


GOOD: dict[str, dict[str, Any]] = {
    "kernel-modules": {
        "load": ["vfio-pci"],
        "blacklist": ["nouveau"],
        "options": {"vfio-pci": "ids=10de:2330"},
    },
    "sysctl": {"values": {"vm.max_map_count": "262144", "net.ipv4.ip_forward": "1"}},
    "hugepages": {"size": "1G", "count": 64},
    "nvidia-driver": {"version": "550.54.15"},
    "fabric-manager": {},
    "mig-layout": {"layout": "all-1g.10gb", "gpus": [0, 1]},
    "gpu-sharing": {"strategy": "time-slicing", "replicas": 4},
    "container-toolkit": {"runtime": "containerd"},
    "k8s-join": {
        "apiServer": "https://10.0.0.1:6443",
        "tokenRef": "sec_01J0000000000000000000000A",
        "caCertHash": "sha256:" + "ab" * 32,
        "labels": {"node-role.kubernetes.io/gpu": "", "topology.kubernetes.io/zone": "eu-1a"},
        "taints": ["nvidia.com/gpu=present:NoSchedule", "dedicated:NoExecute"],
    },
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_each_built_in_takes_real_settings_and_fills_defaults(name: str) -> None:
    section = resolve_host_section([HostUnit(name=name, settings=GOOD[name], when=None)], LABELS)
    assert [u["name"] for u in section] == [name]
    settings = section[0]["settings"]
    assert {k: v for k, v in settings.items() if k in GOOD[name]} == GOOD[name]
    if name == "fabric-manager":
        assert settings == {"enabled": True}
    if name == "container-toolkit":
        assert settings["setAsDefault"] is True


BAD = [
    ("sysctl", {"values": {"vm.max_map_count\nkernel.panic": "1"}}, "values.vm.max_map_count\nkernel.panic"),
    ("sysctl", {"values": {"vm.swappiness": "1\nkernel.panic = 1"}}, "values.vm.swappiness"),
    ("sysctl", {}, "values"),
    ("kernel-modules", {"load": ["vfio pci"]}, "load[0]"),
    ("kernel-modules", {"options": {"../x": "a"}}, "options.../x"),
    ("hugepages", {"size": "4M", "count": 1}, "size"),
    ("hugepages", {"count": -1}, "count"),
    ("nvidia-driver", {"version": "latest"}, "version"),
    ("nvidia-driver", {"version": "550", "kernelModule": "nouveau"}, "kernelModule"),
    ("fabric-manager", {"enabled": "yes"}, "enabled"),
    ("mig-layout", {"layout": "All 1g"}, "layout"),
    ("gpu-sharing", {"strategy": "mps", "replicas": 1}, "replicas"),
    ("container-toolkit", {"runtime": "podman"}, "runtime"),
    ("k8s-join", {**GOOD["k8s-join"], "apiServer": "http://10.0.0.1:6443"}, "apiServer"),
    ("k8s-join", {**GOOD["k8s-join"], "tokenRef": "hunter2"}, "tokenRef"),
    ("k8s-join", {**GOOD["k8s-join"], "taints": ["gpu:Sometimes"]}, "taints[0]"),
    ("k8s-join", {**GOOD["k8s-join"], "labels": {"zone": "a b"}}, "labels.zone"),
    ("k8s-join", {**GOOD["k8s-join"], "extra": 1}, "extra"),
]


@pytest.mark.parametrize(("name", "settings", "where"), BAD)
def test_invalid_settings_are_invalid_input_at_their_path(name: str, settings: Any, where: str) -> None:
    units = [
        HostUnit(name="sysctl", settings=GOOD["sysctl"], when=None),
        HostUnit(name=name, settings=settings, when=None),
    ]
    err = refusal(lambda: resolve_host_section(units, LABELS))
    assert err.code is ErrorCode.INVALID_INPUT
    assert err.path == f"hostConfig.units[1].settings.{where}"
    assert "hunter2" not in err.message


# -- resolve_host_section ------------------------------------------------------------


def gpu_profile() -> Any:
    return define_profile(
        id="gpu-host",
        version=1,
        target="metal",
        role="host",
        steps=[],
        host_config={
            "units": [
                {"name": "sysctl", "settings": GOOD["sysctl"]},
                {"name": "nvidia-driver", "settings": {"version": "550.54.15"}, "when": "gpu=nvidia"},
                {"name": "hugepages", "settings": {"count": 8}, "when": "rack in (r1, r2)"},
                {"name": "hugepages", "settings": {"count": 64}, "when": "rack notin (r1, r2)"},
                {"name": "mig-layout", "settings": {"layout": "all-1g.10gb"}, "when": "!gpu"},
            ]
        },
    )


def test_when_turns_units_on_per_node() -> None:
    profile = gpu_profile()
    gpu_node = resolve_host_section(profile.host_config, LABELS)
    assert [(u["name"], u["settings"].get("count")) for u in gpu_node] == [
        ("sysctl", None), ("nvidia-driver", None), ("hugepages", 64),
    ]  # fmt: skip
    cpu_node = resolve_host_section(profile.host_config, {"rack": "r1"})
    assert [(u["name"], u["settings"].get("count")) for u in cpu_node] == [
        ("sysctl", None), ("hugepages", 8), ("mig-layout", None),
    ]  # fmt: skip
    assert resolve_host_section(None, LABELS) == []


def test_a_unit_turned_on_twice_for_one_node_is_refused() -> None:
    units = [
        HostUnit(name="hugepages", settings={"count": 1}, when="gpu exists"),
        HostUnit(name="hugepages", settings={"count": 2}, when="rack=r12"),
    ]
    err = refusal(lambda: resolve_host_section(units, LABELS))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "hostConfig.units[1].name")
    assert len(resolve_host_section(units, {"rack": "r12"})) == 1


def test_settings_are_checked_whatever_the_labels() -> None:
    units = [HostUnit(name="hugepages", settings={"count": "many"}, when="never-set exists")]
    err = refusal(lambda: resolve_host_section(units, LABELS))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "hostConfig.units[0].settings.count")


def test_an_unknown_unit_is_invalid_input_at_its_name() -> None:
    units = [
        HostUnit(name="sysctl", settings=GOOD["sysctl"], when=None),
        HostUnit(name="acme-nic", settings={}, when=None),
    ]
    err = refusal(lambda: resolve_host_section(units, LABELS))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "hostConfig.units[1].name")


def test_a_unit_of_yours_is_known_and_one_with_a_built_ins_name_replaces_it() -> None:
    nic = ConfigUnit(
        name="acme-nic-firmware",
        description="Pins the NIC firmware branch",
        settings=manifest({"branch": field.string(pattern=r"^[0-9]+\.[0-9]+$")}),
        when="nic=cx7",
    )
    sysctl = ConfigUnit(
        name="sysctl", description="ours", settings=manifest({"profile": field.enum(["hpc"])})
    )
    module = provision_module(config_units=[nic, sysctl])
    units = [
        HostUnit(name="acme-nic-firmware", settings={"branch": "28.39"}, when=None),
        HostUnit(name="sysctl", settings={"profile": "hpc"}, when=None),
    ]
    section = resolve_host_section(units, {"nic": "cx7"}, units=module.config_units)
    assert section == [
        {"name": "acme-nic-firmware", "settings": {"branch": "28.39"}},
        {"name": "sysctl", "settings": {"profile": "hpc"}},
    ]
    # the unit's default when: applies when the entry gives none
    assert [u["name"] for u in resolve_host_section(units, {}, units=module.config_units)] == ["sysctl"]
    err = refusal(
        lambda: resolve_host_section(
            [HostUnit(name="sysctl", settings=GOOD["sysctl"], when=None)], {}, units=module.config_units
        )
    )
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "hostConfig.units[0].settings.values")
