"""One schema per command kind (issue 24): the payload is a Struct of ``wire.commands``, the
manifest the command queue checks with is derived from it, and what the manifest lets through
the agent decodes into the Struct and back to the same JSON. One ``NodeBmc``, with ``caBundle``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal.commands import BMC, COMMAND_KINDS, DRIVER_OPERATIONS
from better_compute.wire.commands import (
    PAYLOADS,
    BmcInventoryResult,
    DiskWiped,
    PowerResult,
    SetPower,
    WipeResult,
    decode_payload,
    decode_result,
    payload_document,
)
from better_compute.wire.metal import NodeBmc
from better_compute.wire.schema import manifest_of

pytestmark = pytest.mark.unit

REF = "sec_01J0000000000000000000000A"
PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
BMC_DOC = {"driver": "redfish", "address": "https://10.0.0.1", "credentialsRef": REF, "caBundle": PEM}
SHA = "a" * 64

# fmt: off
EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "power.setPower": [{"action": "cycle"}, {"action": "on", "bmc": BMC_DOC}],
    "management.setBootDevice": [{"device": "pxe"}, {"device": "disk", "persistent": True, "mode": "uefi"}],
    "media.insert": [{"url": "http://x/a.iso"}, {"url": "https://x/a.iso", "device": "usb", "sha256": SHA}],
    "media.eject": [{}, {"device": "usb", "bmc": {"driver": "ipmi", "address": "10.0.0.2"}}],
    "management.inventory": [{"bmc": BMC_DOC}],
    "management.validate": [{"bmc": {"driver": "sim", "address": "sim-1", "systemId": "s"}}],
    "netboot.setEntry": [
        {"mac": "52:54:00:00:00:01", "kernel": "http://x/k", "initrd": "http://x/i", "cmdline": "a=b"},
        {
            "mac": "52-54-00-00-00-01",
            "script": "#!ipxe",
            "oneTime": False,
            "joinTokenRef": {"secretRef": REF},
        },
    ],
    "netboot.clearEntry": [{"mac": "52:54:00:00:00:01"}],
    "driver.invoke": [{"operation": "power.setPower", "input": {"action": "on"}}],
    "site.httpProxy": [
        {
            "url": "https://10.0.0.5:50000/v1",
            "method": "POST",
            "headers": {"a": "b"},
            "body": "{}",
            "nodeAddresses": ["10.0.0.5"],
            "insecure": True,
        },
    ],
    "node.inventory": [{}],
    "node.wipe": [{}, {"mode": "secure", "disks": ["/dev/sda"]}],
    "node.imageWrite": [{"url": "https://x/i.raw", "sha256": SHA, "format": "qcow2", "userDataRef": REF}],
    "node.converge": [
        {"generation": 3, "units": [{"name": "sysctl", "settings": {"a": 1}}, {"name": "ntp"}]}
    ],
}


def test_every_shipped_kind_checks_with_the_manifest_of_its_struct() -> None:
    assert set(PAYLOADS) == set(COMMAND_KINDS) == set(EXAMPLES)
    for name, kind in COMMAND_KINDS.items():
        assert kind.payload == manifest_of(PAYLOADS[name]), name
    for name, op in DRIVER_OPERATIONS.items():
        assert op.input == manifest_of(PAYLOADS[name]), name


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_what_the_queue_lets_through_the_agent_decodes_to_the_same_json(kind: str) -> None:
    for example in EXAMPLES[kind]:
        checked = COMMAND_KINDS[kind].payload.validate(example)  # the command queue
        decoded = decode_payload(checked, PAYLOADS[kind])  # the agent, once
        # and a Struct built anywhere (a step, bcx) passes the queue as that same payload
        assert COMMAND_KINDS[kind].payload.validate(msgspec.to_builtins(decoded)) == checked
        assert decode_payload(msgspec.to_builtins(decoded), PAYLOADS[kind]) == decoded
        # as a step sends it: absent fields left out, the rest as the queue keeps it
        sent = payload_document(decoded)
        assert None not in sent.values()
        assert COMMAND_KINDS[kind].payload.validate(sent) == checked


def test_the_manifest_refuses_what_the_struct_refuses_at_the_same_path() -> None:
    for kind, bad, path in (
        ("power.setPower", {"action": "of"}, "action"),
        ("power.setPower", {"action": "on", "bmc": {"driver": "redfish"}}, "bmc.address"),
        ("media.insert", {"url": "ftp://x"}, "url"),
        ("node.converge", {"generation": -1}, "generation"),
        ("netboot.setEntry", {"mac": "52:54:00:00:00:01", "cmdline": "a ${x}"}, "cmdline"),
    ):
        with pytest.raises(BcError) as queue:
            COMMAND_KINDS[kind].payload.validate(bad)
        with pytest.raises(BcError) as agent:
            decode_payload(bad, PAYLOADS[kind], path="input")
        assert queue.value.code is agent.value.code is ErrorCode.INVALID_INPUT
        assert (queue.value.path, agent.value.path) == (path, f"input.{path}"), kind


def test_one_bmc_shape_with_its_ca_bundle_from_the_node_record_to_the_command() -> None:
    bmc = msgspec.convert(BMC_DOC, NodeBmc)
    assert bmc.ca_bundle == PEM
    assert bmc.to_document() == {**BMC_DOC, "insecure": False}
    assert BMC.validate(bmc.to_document()) == bmc.to_document()  # the command's bmc field takes it
    command = SetPower(action="on", bmc=bmc)
    assert (
        decode_payload(
            COMMAND_KINDS["power.setPower"].payload.validate(msgspec.to_builtins(command)), SetPower
        )
        == command
    )


def test_a_result_decodes_once_or_says_nothing() -> None:
    got = decode_result("power.setPower", {"driver": "redfish", "powerState": "On", "changed": True})
    assert got == PowerResult(driver="redfish", power_state="On", changed=True)
    assert decode_result("power.setPower", {"powerState": 3}) is None  # an agent's odd answer
    assert decode_result("driver.invoke", {"any": "thing"}) is None  # what the driver said, as it said it
    assert decode_result("node.wipe", {"disks": [{"disk": "/dev/sda", "skipped": "x"}]}) == WipeResult(
        disks=[DiskWiped(disk="/dev/sda", skipped="x")]
    )
    # another agent's answer says less: what it says is read, the rest takes its default
    partial = decode_result("management.inventory", {"system": {"powerState": "On"}})
    assert isinstance(partial, BmcInventoryResult)
    assert (partial.system.power_state, partial.processors) == ("On", [])
