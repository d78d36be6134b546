"""bcd's host converger against a temporary root: every built-in unit applied twice (in the
shapes the engine's manifests accept), unsupported units, failed units, ``observedGeneration``.
GPU hardware is simulated by ``tests/support/bcd_gpu_host.py``; GPU specifics: test_bcd_gpu_units.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from msgspec import to_builtins

from bcd.converger import SUPPORTED_UNITS, Converger
from bcd.daemon import node_handlers
from bcd.system import Machine
from bcd_gpu_host import PROFILE_UNITS, REF, TOKEN, changing, fetch, gpu_machine, units_of
from better_compute.agent import Command
from better_compute.core.errors import BcError
from better_compute.provision.config_units import BUILTIN_CONFIG_UNITS, resolve_host_section
from better_compute.testing.machines import RecordingRunner, RunAnswer, prepare_machine

pytestmark = pytest.mark.unit


async def test_each_built_in_unit_applies_then_reports_unchanged_the_second_time(tmp_path: Path) -> None:
    section = resolve_host_section(PROFILE_UNITS, {"gpu": "nvidia"})
    assert [u["name"] for u in section] == [u.name for u in PROFILE_UNITS]
    assert {u["name"] for u in section} == set(BUILTIN_CONFIG_UNITS) == SUPPORTED_UNITS
    m, host, runner = gpu_machine(tmp_path)
    conv = Converger(m, fetch_secret=fetch)
    first = await conv.converge(generation=3, units=units_of(section))
    first = to_builtins(first)
    assert {u["name"]: u["status"] for u in first["units"]} == {u["name"]: "changed" for u in section}
    assert first["observedGeneration"] == 3 == conv.observed_generation()
    assert "net.ipv4.ip_forward = 1\n" in (m.root / "etc/sysctl.d/90-bc.conf").read_text()
    assert runner.commands("sysctl") == [["sysctl", "-p", str(m.root / "etc/sysctl.d/90-bc.conf")]]
    assert "blacklist nouveau\n" in (m.root / "etc/modprobe.d/bc.conf").read_text()
    assert runner.commands("modprobe") == [["modprobe", "br_netfilter"]]
    assert (m.root / "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages").read_text().strip() == "512"
    assert ["nvidia-ctk", "runtime", "configure", "--runtime=containerd", "--set-as-default"] in runner.ran
    (join,) = runner.commands("kubeadm")
    assert join[:3] == ["kubeadm", "join", "k8s.example.test:6443"]
    assert TOKEN not in str(first)  # the token never reaches the report
    assert "--node-labels=zone=a" in (m.root / "etc/default/kubelet").read_text()
    assert ["apt-get", "install", "-y", "nvidia-driver-550-open"] in runner.ran
    driver = next(u for u in first["units"] if u["name"] == "nvidia-driver")
    assert "loads at the next boot (loaded now: 535.161.08)" in driver["detail"]
    assert (
        "nvidia-fabricmanager.service" in host.enabled,
        "nvidia-fabricmanager.service" in host.active,
    ) == (True, True)
    assert host.mig_mode == {"0": "Enabled", "1": "Enabled"}
    assert host.layout == "all-1g.10gb"
    assert '"replicas": 4' in (m.root / "etc/nvidia-device-plugin/sharing.yaml").read_text()

    runner.ran.clear()
    second = await conv.converge(generation=4, units=units_of(section))
    second = to_builtins(second)
    assert {u["name"]: u["status"] for u in second["units"]} == {u["name"]: "unchanged" for u in section}
    assert changing(runner) == []
    assert not any("ran" in u for u in second["units"])
    assert second["observedGeneration"] == 4


# Every unit alone, in the shapes its manifest accepts: applied, then unchanged.
SHAPES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("sysctl", {"values": {"kernel.pid_max": "4194304"}}, {}),
    ("kernel-modules", {"load": ["vfio_pci"]}, {}),
    ("kernel-modules", {"blacklist": ["floppy"], "options": {"vfio_pci": "ids=10de:2330"}}, {}),
    ("hugepages", {"size": "2M", "count": 8}, {}),
    ("container-toolkit", {"runtime": "docker", "setAsDefault": False}, {}),
    (
        "k8s-join",
        {
            "apiServer": "https://10.0.0.1:6443",
            "tokenRef": REF,
            "caCertHash": "sha256:" + "b" * 64,
            "role": "control-plane",
        },
        {},
    ),
    ("nvidia-driver", {"version": "550", "kernelModule": "proprietary"}, {}),
    ("fabric-manager", {"enabled": True}, {}),
    ("fabric-manager", {"enabled": False}, {"enabled": {"nvidia-fabricmanager.service"}}),
    ("mig-layout", {"layout": "all-3g.40gb", "gpus": [1]}, {}),
    ("gpu-sharing", {"strategy": "mps", "replicas": 8}, {}),
    ("gpu-sharing", {"strategy": "time-slicing", "replicas": 2}, {"compute": {"0": "Exclusive_Process"}}),
]


@pytest.mark.parametrize(
    ("name", "settings", "state"), SHAPES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(SHAPES)]
)
async def test_a_unit_in_each_shape_applies_once(
    name: str, settings: dict[str, Any], state: dict[str, Any], tmp_path: Path
) -> None:
    BUILTIN_CONFIG_UNITS[name].settings.validate(settings, path="settings")  # what the engine accepts
    m, host, runner = gpu_machine(tmp_path)
    for attr, value in state.items():
        setattr(host, attr, value)
    conv = Converger(m, fetch_secret=fetch)
    first = await conv.converge(generation=1, units=units_of([{"name": name, "settings": settings}]))
    first = to_builtins(first)
    assert first["units"][0]["status"] == "changed", first
    runner.ran.clear()
    second = await conv.converge(generation=2, units=units_of([{"name": name, "settings": settings}]))
    second = to_builtins(second)
    assert second["units"][0]["status"] == "unchanged", second
    assert changing(runner) == []
    assert conv.observed_generation() == 2


async def test_mig_on_one_gpu_and_mps_change_only_what_they_name(tmp_path: Path) -> None:
    m, host, runner = gpu_machine(tmp_path)
    conv = Converger(m)
    await conv.converge(
        generation=1,
        units=units_of(
            [
                {"name": "mig-layout", "settings": {"layout": "x", "gpus": [1]}},
                {"name": "gpu-sharing", "settings": {"strategy": "mps", "replicas": 2}},
            ]
        ),
    )
    assert host.mig_mode == {"1": "Enabled"}
    assert host.compute == {"0": "Exclusive_Process", "1": "Exclusive_Process"}
    assert ["nvidia-smi", "-i", "1", "-mig", "1"] in runner.ran


# -- what fails the host section ---------------------------------------------------------------


async def test_an_unsupported_unit_fails_the_host_section_after_the_known_units(tmp_path: Path) -> None:
    m, _host, _runner = gpu_machine(tmp_path)
    conv = Converger(m)
    await conv.converge(generation=1, units=units_of([]))
    sysctl = {"name": "sysctl", "settings": {"values": {"vm.swappiness": "10"}}}
    with pytest.raises(BcError) as info:
        await conv.converge(
            generation=2,
            units=units_of([{"name": "acme-nic-firmware", "settings": {"branch": "1.2"}}, sysctl]),
        )
    assert "unit acme-nic-firmware is not supported by this daemon" in info.value.message
    assert "(units: acme-nic-firmware unsupported, sysctl changed)" in info.value.message
    assert info.value.reason == "host-section-failed"
    assert (m.root / "etc/sysctl.d/90-bc.conf").exists()  # the known unit still had its turn
    assert conv.observed_generation() == 1  # not advanced
    assert info.value.details["observedGeneration"] == 1


async def test_settings_a_unit_does_not_understand_fail_it_with_their_path(tmp_path: Path) -> None:
    m, _host, runner = gpu_machine(tmp_path)
    conv = Converger(m)
    sysctl = {"name": "sysctl", "settings": {"values": {"vm.swappiness": "10"}}}
    with pytest.raises(BcError) as info:
        await conv.converge(
            generation=1,
            units=units_of([sysctl, {"name": "hugepages", "settings": {"size": "3M", "count": 1}}]),
        )
    assert "units[1].settings.size" in info.value.message
    assert runner.commands("sysctl")  # the good unit still applied
    assert not (m.root / "etc/systemd/system/bc-hugepages.service").exists()


async def test_a_failing_command_fails_its_unit_with_what_it_said(tmp_path: Path) -> None:
    runner = RecordingRunner(
        programs={"sysctl"},
        answers={"sysctl": lambda argv: RunAnswer(returncode=255, stderr="sysctl: permission denied")},
    )
    conv = Converger(Machine(root=prepare_machine(tmp_path / "root"), runner=runner))  # type: ignore[arg-type]
    with pytest.raises(
        BcError, match=r"unit sysctl failed: sysctl -p .* exited 255: sysctl: permission denied"
    ):
        await conv.converge(
            generation=1, units=units_of([{"name": "sysctl", "settings": {"values": {"a.b": "1"}}}])
        )


async def test_the_installed_os_converges_through_its_command_handler(tmp_path: Path) -> None:
    m, _host, _runner = gpu_machine(tmp_path)
    handler = node_handlers(m, "installed", converger=Converger(m))["node.converge"]
    cmd = Command(
        id="cmd_1",
        kind="node.converge",
        payload={"generation": 7, "units": [{"name": "fabric-manager"}]},
        node_id="node_1",
        site_id="s",
        key="k",
        destructive=False,
        not_after=0.0,
        batch_id=None,
        workflow_id=None,
        step=None,
        _agent=None,
    )  # type: ignore[arg-type]
    got = await handler(cmd)
    got = to_builtins(got)
    assert (got["observedGeneration"], got["units"][0]["status"]) == (7, "changed")
