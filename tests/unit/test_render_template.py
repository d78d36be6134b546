"""render_template, template variables and UserData settings."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from better_compute.core import BcError, ErrorCode
from better_compute.provision import (
    TEMPLATE_VARIABLES,
    UserData,
    render_template,
    template_variables,
)
from better_compute.provision.userdata import BUILTIN_TEMPLATES

pytestmark = pytest.mark.unit

INVALID_CONFIG = ErrorCode.INVALID_CONFIG
INVALID_INPUT = ErrorCode.INVALID_INPUT
SHA = "ab" * 32

VARIABLES = {
    "nodeId": "node_01J0000000000000000000000A",
    "hostname": "node-01J0000000000000000000000A",
    "joinToken": "tok-secret",
    "controlPlaneUrl": "https://gw.eu-1.example.com",
    "bcdUrl": "https://downloads.example.com/bcd",
    "bcdSha256": SHA,
}


def refusal(fn: Callable[[], object]) -> tuple[ErrorCode, str | None]:
    with pytest.raises(BcError) as info:
        fn()
    return info.value.code, info.value.path


def test_the_variables_are_the_pages() -> None:
    assert TEMPLATE_VARIABLES == (
        "nodeId",
        "hostname",
        "joinToken",
        "controlPlaneUrl",
        "bcdUrl",
        "bcdSha256",
    )


def test_placeholders_with_and_without_spaces_are_filled() -> None:
    template = "hostname: {{hostname}}\ntoken: {{ joinToken }}\nagain: {{  hostname  }}\n"
    assert render_template(template, VARIABLES) == (
        "hostname: node-01J0000000000000000000000A\ntoken: tok-secret\n"
        "again: node-01J0000000000000000000000A\n"
    )


def test_jinja_expressions_that_are_not_placeholders_pass_through() -> None:
    template = "host: {{ v1.local_hostname }} node: {{nodeId}}"
    assert render_template(template, VARIABLES) == (
        "host: {{ v1.local_hostname }} node: node_01J0000000000000000000000A"
    )


@pytest.mark.parametrize("bad", ["a\nb", "a\r", "a\r\nb", "\u2028", "\u2029", "a\x85", "\v", "\f"])
def test_a_value_with_a_line_break_is_invalid_input(bad: str) -> None:
    variables = {**VARIABLES, "joinToken": bad}
    assert refusal(lambda: render_template("t: {{joinToken}}", variables)) == (
        INVALID_INPUT,
        "variables.joinToken",
    )


def test_a_value_with_double_braces_is_invalid_input() -> None:
    variables = {**VARIABLES, "hostname": "x{{joinToken}}"}
    assert refusal(lambda: render_template("h: {{hostname}}", variables)) == (
        INVALID_INPUT,
        "variables.hostname",
    )


def test_a_bad_value_is_refused_even_when_no_placeholder_uses_it() -> None:
    variables = {**VARIABLES, "bcdUrl": "https://x\n"}
    assert refusal(lambda: render_template("static", variables)) == (
        INVALID_INPUT,
        "variables.bcdUrl",
    )


def test_a_value_that_is_not_a_string_is_invalid_input() -> None:
    assert refusal(lambda: render_template("{{port}}", {"port": 22})) == (  # type: ignore[dict-item]
        INVALID_INPUT,
        "variables.port",
    )


def test_a_placeholder_with_no_value_is_invalid_config() -> None:
    assert refusal(lambda: render_template("url: {{ controlPlaneUrl }}", {"nodeId": "n"})) == (
        INVALID_CONFIG,
        "template.controlPlaneUrl",
    )


def test_a_none_value_counts_as_no_value() -> None:
    variables = {**VARIABLES, "bcdUrl": None}
    assert render_template("{{nodeId}}", variables) == VARIABLES["nodeId"]
    assert refusal(lambda: render_template("{{bcdUrl}}", variables)) == (
        INVALID_CONFIG,
        "template.bcdUrl",
    )


def test_a_function_template_gets_read_only_variables() -> None:
    def ignition(variables: Mapping[str, str]) -> str:
        with pytest.raises(TypeError):
            variables["hostname"] = "x"  # type: ignore[index]
        return '{"hostname": "' + variables["hostname"] + '"}'

    assert render_template(ignition, VARIABLES) == '{"hostname": "node-01J0000000000000000000000A"}'


def test_a_function_template_reading_a_missing_value_is_invalid_config() -> None:
    assert refusal(lambda: render_template(lambda v: v["bcdSha256"], {"nodeId": "n"})) == (
        INVALID_CONFIG,
        "template.bcdSha256",
    )


def test_a_function_template_still_gets_only_checked_values() -> None:
    variables = {**VARIABLES, "joinToken": "a\nb"}
    assert refusal(lambda: render_template(lambda v: "x", variables)) == (
        INVALID_INPUT,
        "variables.joinToken",
    )


@pytest.mark.parametrize("template", [lambda v: None, lambda v: b"bytes", 42])
def test_a_template_that_gives_no_string_is_invalid_config(template: Any) -> None:
    assert refusal(lambda: render_template(template, VARIABLES)) == (INVALID_CONFIG, "template")


@pytest.mark.parametrize(
    "url", ["https://gw.example.com", "nats://10.0.2.2:4222", "tls://gw.example.com:4222"]
)
def test_the_control_plane_may_be_nats_itself(url: str) -> None:
    # bcd takes nats:// and tls:// as they are (a VM reaches a test's NATS as nats://10.0.2.2:<port>)
    variables = template_variables(
        node_id="node_x", join_token="t", user_data=UserData(control_plane_url=url)
    )
    assert variables["controlPlaneUrl"] == url


def test_template_variables_derive_the_hostname_from_the_node_id() -> None:
    settings = UserData(control_plane_url="https://gw.example.com", bcd_sha256=SHA)
    variables = template_variables(
        node_id="node_01J0000000000000000000000A", join_token="t", user_data=settings
    )
    assert variables["hostname"] == "node-01J0000000000000000000000A"
    assert variables["controlPlaneUrl"] == "https://gw.example.com"
    assert variables["bcdUrl"] is None
    assert set(variables) == set(TEMPLATE_VARIABLES)


@pytest.mark.parametrize(
    ("settings", "path"),
    [
        ({"control_plane_url": "gw.example.com"}, "control_plane_url"),
        ({"control_plane_url": "ftp://gw.example.com"}, "control_plane_url"),
        ({"bcd_url": "nats://10.0.2.2:4222"}, "bcd_url"),
        ({"bcd_url": "https://x/\nevil"}, "bcd_url"),
        ({"bcd_sha256": "AB" * 32}, "bcd_sha256"),
        ({"bcd_sha256": "ab"}, "bcd_sha256"),
        ({"templates": {"../etc/passwd": "x"}}, "templates.../etc/passwd"),
        ({"templates": {"acme.yaml": 42}}, "templates.acme.yaml"),
        ({"templates": ["acme.yaml"]}, "templates"),
    ],
)
def test_user_data_settings_are_checked(settings: dict[str, Any], path: str) -> None:
    assert refusal(lambda: UserData(**settings)) == (INVALID_CONFIG, path)


def test_user_data_templates_are_frozen() -> None:
    templates = {"acme-talos.yaml": "machine: {{hostname}}"}
    settings = UserData(templates=templates)
    templates["other.yaml"] = "x"
    assert list(settings.templates) == ["acme-talos.yaml"]
    with pytest.raises(TypeError):
        settings.templates["x"] = "y"  # type: ignore[index]


def test_the_ignition_install_unit_runs_only_while_a_join_token_waits() -> None:
    # bcd join removes the token file: on every later boot the oneshot unit must be skipped,
    # not fail (it would rerun `bcd join` with no token).
    doc = json.loads(BUILTIN_TEMPLATES["ignition"](VARIABLES))
    [unit] = [u for u in doc["systemd"]["units"] if u["name"] == "bcd-install.service"]
    lines = unit["contents"].splitlines()
    assert "ConditionPathExists=/etc/bcd/join-token" in lines
    assert "Wants=network-online.target" in lines


class _Rows:
    """A fake ``Sql`` answering one query with fixed rows."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.asked: list[tuple[Any, ...]] = []

    async def query(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        self.asked.append(args)
        return self.rows


async def test_provisioned_target_resolver_maps_a_token_to_its_node_or_none() -> None:
    from better_compute.provision import ProvisionedTarget, provisioned_target_resolver

    resolve = provisioned_target_resolver()
    found = _Rows([{"node_id": "node_1", "workflow_id": "wf_1", "tenant_id": "acme"}])
    assert await resolve(found, "tok_1") == ProvisionedTarget(
        node_id="node_1", workflow_id="wf_1", tenant_id="acme"
    )  # type: ignore[arg-type]
    assert found.asked == [("tok_1",)]
    assert await resolve(_Rows([]), "tok_2") is None  # type: ignore[arg-type]
    nodeless = _Rows([{"node_id": None, "workflow_id": "wf_2", "tenant_id": "acme"}])
    assert await resolve(nodeless, "tok_3") is None  # type: ignore[arg-type]
