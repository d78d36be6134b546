"""bcd's GPU units where the hardware is and where it is not: no GPU (skipped, said clearly),
no NVSwitch, a driver not loaded yet, GPUs without MIG, and settings naming some GPUs only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec import to_builtins

from bcd.converger import Converger
from bcd.hardware import claims, inventory
from bcd_gpu_host import PROFILE_UNITS, changing, gpu_machine, units_of
from better_compute.core.errors import BcError
from better_compute.provision.config_units import resolve_host_section

pytestmark = pytest.mark.unit


# -- no GPU, and GPUs the units cannot use -----------------------------------------------------

GPU_SECTION = [{"name": u.name, "settings": u.settings} for u in PROFILE_UNITS if u.when == "gpu=nvidia"]


@pytest.mark.parametrize("smi", [False, True], ids=["no-nvidia-smi", "nvidia-smi-finds-none"])
async def test_gpu_units_are_skipped_clearly_where_there_is_no_gpu(tmp_path: Path, smi: bool) -> None:
    m, _host, runner = gpu_machine(tmp_path, gpus=0, nvswitch=False, smi=smi)
    got = await Converger(m).converge(
        generation=5,
        units=units_of(resolve_host_section(PROFILE_UNITS[3:4] + PROFILE_UNITS[5:], {"gpu": "nvidia"})),
    )
    got = to_builtins(got)
    assert got["units"] == [
        {"name": u["name"], "status": "skipped", "detail": "no NVIDIA GPU on this machine"}
        for u in GPU_SECTION
    ]
    assert got["observedGeneration"] == 5  # nothing to do is not a failure
    assert changing(runner) == []
    assert len(runner.commands("nvidia-smi")) == int(smi)  # looked once per converge


async def test_fabric_manager_is_skipped_without_an_nvswitch(tmp_path: Path) -> None:
    m, host, _runner = gpu_machine(tmp_path, nvswitch=False)
    got = await Converger(m).converge(
        generation=1, units=units_of([{"name": "fabric-manager", "settings": {}}])
    )
    got = to_builtins(got)
    assert got["units"][0]["status"] == "skipped"
    assert "no NVSwitch on this machine" in got["units"][0]["detail"]
    assert host.enabled == set()


async def test_a_gpu_whose_driver_is_not_loaded_fails_the_units_that_need_it(tmp_path: Path) -> None:
    m, host, runner = gpu_machine(tmp_path, driver=None)
    conv = Converger(m)
    units = [
        {"name": "nvidia-driver", "settings": {"version": "550.54.15"}},
        {"name": "mig-layout", "settings": {"layout": "all-1g.10gb"}},
    ]
    with pytest.raises(BcError) as info:
        await conv.converge(generation=1, units=units_of(units))
    assert info.value.reason == "host-section-failed"
    assert (
        "unit mig-layout failed: mig-layout needs the NVIDIA driver: nvidia-smi could not list the GPUs:"
        " NVIDIA-SMI has failed" in info.value.message
    )
    assert "nvidia-driver changed" in info.value.message  # the driver unit still had its turn
    assert ["apt-get", "install", "-y", "nvidia-driver-550-open"] in runner.ran
    # after the reboot the driver is loaded: the same section applies, the driver unchanged
    host.driver = "550.54.15"
    runner.ran.clear()
    got = await conv.converge(generation=1, units=units_of(units))
    got = to_builtins(got)
    assert [(u["name"], u["status"]) for u in got["units"]] == [
        ("nvidia-driver", "unchanged"),
        ("mig-layout", "changed"),
    ]
    assert "detail" not in got["units"][0]


async def test_mig_on_gpus_without_mig_or_a_gpu_not_there_fails_with_why(tmp_path: Path) -> None:
    m, _host, _runner = gpu_machine(tmp_path, mig=False)
    with pytest.raises(BcError, match="no GPU on this machine supports MIG"):
        await Converger(m).converge(
            generation=1, units=units_of([{"name": "mig-layout", "settings": {"layout": "a"}}])
        )
    m, _host, _runner = gpu_machine(tmp_path / "b")
    with pytest.raises(BcError, match=r"no GPU 7 on this machine \(nvidia-smi lists 0, 1\)"):
        await Converger(m).converge(
            generation=1, units=units_of([{"name": "mig-layout", "settings": {"layout": "a", "gpus": [7]}}])
        )


def test_inventory_and_claims_see_the_gpus_nvidia_smi_lists(tmp_path: Path) -> None:
    m, _host, _runner = gpu_machine(tmp_path)
    gpus = to_builtins(inventory(m))["gpus"]
    assert [(g["pciAddress"], g["uuid"], g["driverVersion"]) for g in gpus] == [
        ("0000:17:00.0", "GPU-00000000-0000-0000-0000-000000000000", "535.161.08"),
        ("0000:18:00.0", "GPU-10000000-0000-0000-0000-000000000000", "535.161.08"),
    ]
    assert claims(m).gpu_uuids == [g["uuid"] for g in gpus]
    m, _host, _runner = gpu_machine(tmp_path / "b", driver=None)  # on PCI, no driver loaded yet
    assert [(g["pciAddress"], g.get("uuid")) for g in to_builtins(inventory(m))["gpus"]] == [
        ("0000:17:00.0", None),
        ("0000:18:00.0", None),
    ]
