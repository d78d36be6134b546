"""Acme's plugin on the Better Compute test kit (``better_compute.testing``): the step as the engine
runs it, and the plugin composed into an app the way the services compose it."""

from __future__ import annotations

from typing import Any

import pytest
from acme_plugin import GIB, check_memory, memory_check, plugin

from better_compute.app import better_compute
from better_compute.core import ErrorCode
from better_compute.metal import metal
from better_compute.provision import provision_module
from better_compute.testing import refused
from better_compute.testing.steps import FakeNode, run_step

INVENTORY: dict[str, Any] = {
    "cpus": {"model": "Acme Xeon 9000", "cores": 32},
    "memory": {"totalBytes": 64 * GIB},
    "disks": [{"name": "sda", "sizeBytes": 960 * 10**9}],
}


async def test_the_step_returns_what_it_read_of_the_inventory() -> None:
    got = await run_step(check_memory, {"minMemoryGiB": 32}, node=FakeNode(inventory=INVENTORY))
    assert got == {
        "memoryBytes": 64 * GIB,
        "memoryGiB": 64.0,
        "minMemoryGiB": 32,
        "cpuModel": "Acme Xeon 9000",
    }


async def test_too_little_memory_fails_the_step_with_its_reason() -> None:
    err = await refused(run_step(check_memory, {"minMemoryGiB": 128}, node=FakeNode(inventory=INVENTORY)))
    assert (err.code, err.path, err.details["reason"]) == (
        ErrorCode.INVALID_STATE,
        "with.minMemoryGiB",
        "too-little-memory",
    )
    assert "64.0 GiB" in err.message


@pytest.mark.parametrize(
    ("inventory", "reason"),
    [(None, "no-inventory"), ({"cpus": {}}, "no-memory"), ({"memory": {"totalBytes": "lots"}}, "no-memory")],
)
async def test_a_node_without_a_memory_reading_is_refused(inventory: Any, reason: str) -> None:
    err = await refused(run_step(check_memory, node=FakeNode(inventory=inventory)))
    assert (err.code, err.details["reason"]) == (ErrorCode.INVALID_STATE, reason)


async def test_a_bad_with_is_refused_where_workflows_start_would() -> None:
    err = await refused(run_step(check_memory, {"minMemoryGiB": 0}, node=FakeNode(inventory=INVENTORY)))
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "with.minMemoryGiB")


def test_the_plugin_composes_and_its_profile_resolves() -> None:
    app = better_compute(modules=[metal(), provision_module(modules=[metal(), plugin])], plugins=[plugin])
    assert app.steps["acme.checkMemory"] is check_memory
    assert app.profile("acme-memory-check") is memory_check
    assert "inspect.collect" in app.steps  # the profile's first step is metal's
    assert app.provision is not None
    assert "acme-nic-firmware" in app.provision.config_units
