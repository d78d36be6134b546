"""Enrollment rules without servers: the facts a node shows, numeric selectors, BMC templates."""

from __future__ import annotations

import re

import msgspec
import pytest

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.names import NODE_NAME_PATTERN
from better_compute.metal.enrollment import (
    check_name_template,
    check_rule_bmc,
    host_name,
    inventory_facts,
    node_facts,
    render_node_name,
    render_rule_bmc,
)
from better_compute.provision.labels import parse_label_expression
from better_compute.wire.codec import convert
from better_compute.wire.metal import EnrollmentRuleBmc, NodeBmc

# bcd's node.inventory, trimmed (services/node-agent/src/bcd/hardware.py)
INVENTORY = {
    "productUuid": "4c4c4544-0042-3510-8052-b4c04f4e3432",
    "serial": "7XK2Q63",
    "cpus": {"model": "Intel(R) Xeon(R) Gold 6338", "sockets": 2, "cores": 64, "threads": 128},
    "memory": {"totalBytes": 540_950_000_000},  # 503.8 GiB: what a 512 GB machine shows
    "disks": [{"name": "nvme0n1"}, {"name": "nvme1n1"}],
    "nics": [{"name": "eno1"}],
    "gpus": [],
    "firmware": {"vendor": "Dell Inc.", "product": "PowerEdge R650", "bootMode": "uefi"},
    "bmc": {"address": "10.20.3.4"},
}


def test_the_inventory_facts_a_rule_can_match() -> None:
    assert inventory_facts(INVENTORY) == {
        "inventory.vendor": "Dell Inc.",
        "inventory.product": "PowerEdge R650",
        "inventory.serial": "7XK2Q63",
        "inventory.cpu_model": "Intel(R) Xeon(R) Gold 6338",
        "inventory.cpu_cores": "64",
        "inventory.memory_gib": "504",
        "inventory.gpus": "0",
        "inventory.disks": "2",
        "inventory.nics": "1",
        "inventory.boot_mode": "uefi",
        "inventory.bmc_address": "10.20.3.4",
    }
    assert inventory_facts(None) == {}
    assert inventory_facts({"cpus": "odd", "memory": {"totalBytes": True}}) == {}
    # a label cannot pretend to be the inventory
    facts = node_facts({"inventory.vendor": "Acme", "rack": "r1"}, "lab1", INVENTORY)
    assert (facts["inventory.vendor"], facts["rack"], facts["site"]) == ("Dell Inc.", "r1", "lab1")


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ('inventory.vendor="Dell Inc." and inventory.memory_gib>=500', True),
        ("inventory.memory_gib>504", False),
        ("inventory.memory_gib<=504, inventory.cpu_cores<65", True),
        ("inventory.cpu_cores>=64.5", False),
        ("inventory.gpus>0", False),
        ('site=lab1 and inventory.product in (PowerEdge-R650, "PowerEdge R650")', True),
        ("inventory.vendor>1", False),  # not a number: no match, no error
        ("missing>=0", False),
    ],
)
def test_numeric_comparisons_in_selectors(selector: str, matches: bool) -> None:
    expr = parse_label_expression(selector, path="selector")
    assert expr.matches(node_facts({}, "lab1", INVENTORY)) is matches


def test_a_comparison_needs_a_number() -> None:
    with pytest.raises(BcError) as caught:
        parse_label_expression("inventory.memory_gib>=lots", path="selector")
    assert (caught.value.code, caught.value.details["path"]) == (ErrorCode.INVALID_INPUT, "selector")
    assert "expected a number after >=" in caught.value.message
    assert str(parse_label_expression("a>=1 and b<2.5")) == "a>=1 and b<2.5"


def test_a_bmc_address_from_facts_must_be_an_ip_inside_the_rules_networks() -> None:
    template = {
        "driver": "redfish",
        "address": "https://{inventory.bmc_address}",
        "addressCidrs": ["10.20.0.0/16"],
        "credentialsRef": "sec_01JB0000000000000000000000",
    }
    check_rule_bmc(template)
    facts = node_facts({}, "lab1", INVENTORY)
    assert render_rule_bmc(template, facts, rule="rule_1") == {
        "driver": "redfish",
        "address": "https://10.20.3.4",
        "credentialsRef": "sec_01JB0000000000000000000000",
    }
    for reported, why in [
        ("192.0.2.66", "outside the rule's addressCidrs"),
        ("bmc.evil.example", "is not an IP address"),
        ("10.20.3.4@evil", "is not a host name or IP address"),
        ("10.20.3.4/x", "is not a host name or IP address"),
    ]:
        with pytest.raises(BcError) as caught:
            render_rule_bmc(template, {**facts, "inventory.bmc_address": reported}, rule="rule_1")
        assert caught.value.code is ErrorCode.INVALID_STATE
        assert caught.value.details["reason"] == "bmc-address-unresolved"
        assert why in caught.value.message, caught.value.message
    with pytest.raises(BcError) as caught:
        render_rule_bmc(template, node_facts({}, "lab1", {}), rule="rule_1")
    assert "has no inventory.bmc_address" in caught.value.message
    # a fixed address needs no networks and is taken as it is
    fixed = {"driver": "ipmi", "address": "10.1.2.3:623"}
    check_rule_bmc(fixed)
    assert render_rule_bmc(fixed, facts, rule="rule_1") == fixed


@pytest.mark.parametrize(
    ("template", "path"),
    [
        ({"driver": "ipmi", "address": "{inventory.bmc_address}"}, "bmc.addressCidrs"),
        ({"driver": "ipmi", "address": "{inventory.colour}", "addressCidrs": ["10.0.0.0/8"]}, "bmc.address"),
        (
            {"driver": "ipmi", "address": "{inventory.bmc_address", "addressCidrs": ["10.0.0.0/8"]},
            "bmc.address",
        ),
        ({"driver": "ipmi", "address": "{site}", "addressCidrs": ["10.0.0.0/8", "x"]}, "bmc.addressCidrs[1]"),
    ],
)
def test_bad_bmc_templates_name_their_path(template: dict[str, object], path: str) -> None:
    with pytest.raises(BcError) as caught:
        check_rule_bmc(template)
    assert (caught.value.code, caught.value.details["path"]) == (ErrorCode.INVALID_INPUT, path)


@pytest.mark.parametrize(
    ("reported", "name"),
    [
        ("r12-n3.lab1.example.com", "r12-n3"),
        ("GPU_Node-07", "gpu-node-07"),
        ("-x-", "x"),
        ("localhost", None),
        ("localhost.localdomain", None),
        ("ubuntu", None),
        ("", None),
        (None, None),
        ("a" * 80, "a" * 63),
    ],
)
def test_a_discovered_machine_is_named_by_its_reported_host_name(
    reported: str | None, name: str | None
) -> None:
    assert host_name(reported) == name
    assert name is None or re.match(NODE_NAME_PATTERN, name)


def test_a_rules_name_template_names_the_node_from_its_facts() -> None:
    facts = {**node_facts({}, "lab1", INVENTORY), "hostname": "r12-n3"}
    assert render_node_name("{site}-{inventory.serial}", facts, rule="rule_x") == "lab1-7xk2q63"
    assert render_node_name("{hostname}", facts, rule="rule_x") == "r12-n3"
    assert render_node_name("dell-{inventory.product}", facts, rule="rule_x") == "dell-poweredge-r650"
    with pytest.raises(BcError) as caught:
        render_node_name("{hostname}", node_facts({}, "lab1", INVENTORY), rule="rule_x")
    assert (caught.value.code, caught.value.details["reason"]) == (ErrorCode.INVALID_STATE, "name-unresolved")


@pytest.mark.parametrize("template", ["{inventory.colour}", "r7 {hostname}", "r7-{hostname", "", "--"])
def test_bad_name_templates_are_refused_at_their_path(template: str) -> None:
    with pytest.raises(BcError) as caught:
        check_name_template(template)
    assert (caught.value.code, caught.value.details["path"]) == (ErrorCode.INVALID_INPUT, "nameTemplate")


def test_a_rules_bmc_is_a_node_bmc_and_its_ca_bundle_reaches_the_node() -> None:
    # one BMC shape: a rule's template has every NodeBmc field (it had no caBundle, and msgspec
    # dropped one given without a word) and the node enrolled by it gets them
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    template = convert(
        {"driver": "redfish", "address": "https://{inventory.bmc_address}", "caBundle": pem,
         "addressCidrs": ["10.20.0.0/16"]},
        EnrollmentRuleBmc,
    )  # fmt: skip
    assert isinstance(template, NodeBmc)
    node_fields = {f.encode_name for f in msgspec.structs.fields(NodeBmc)}
    assert node_fields <= {f.encode_name for f in msgspec.structs.fields(EnrollmentRuleBmc)}
    stored = {k: v for k, v in msgspec.to_builtins(template).items() if v is not None}
    bmc = render_rule_bmc(stored, inventory_facts(INVENTORY), rule="rule_x")
    assert convert(bmc, NodeBmc) == NodeBmc(driver="redfish", address="https://10.20.3.4", ca_bundle=pem)
