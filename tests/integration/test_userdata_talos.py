"""The built-in ``talos`` user data: each YAML document of it passes Talos' published machine
configuration schema (vendored from siderolabs/talos, tests/support/schemas/SOURCES.md;
``talosctl validate`` is in neither Debian nor PyPI), and says what we meant when read as YAML."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from better_compute.provision import UserData, render_template, template_variables
from better_compute.provision.userdata import BUILTIN_TEMPLATES

SCHEMA = Path(__file__).resolve().parents[1] / "support" / "schemas" / "talos-config.schema.json"
SETTINGS = UserData(
    control_plane_url="https://gw.eu-1.example.com",
    bcd_url="https://downloads.example.com/bcd/0.2.0/bcd-linux-amd64",
    bcd_sha256="ab" * 32,
)
TOKENS = [
    "bcjt_2b7e151628aed2a6abf7158809cf4f3c",
    'it\'s: a #token ---\n"quoted" $(reboot) {x} [y]'.replace("\n", " "),
]


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)  # type: ignore[no-any-return]


@pytest.mark.parametrize("token", TOKENS)
def test_the_talos_template_passes_talos_config_schema(
    validator: jsonschema.protocols.Validator, token: str
) -> None:
    assert "talos" in BUILTIN_TEMPLATES  # regression: kind talos shipped no template
    variables = template_variables(
        node_id="node_01J0000000000000000000000A", join_token=token, user_data=SETTINGS
    )
    text = render_template(BUILTIN_TEMPLATES["talos"], variables)
    documents = [d for d in yaml.safe_load_all(text) if d is not None]
    assert documents
    for doc in documents:
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
        assert errors == [], (doc.get("kind"), errors)
    by_kind = {d["kind"]: d for d in documents}
    assert by_kind["HostnameConfig"]["hostname"] == "node-01J0000000000000000000000A"
    service = by_kind["ExtensionServiceConfig"]
    assert service["name"] == "bcd"
    assert service["configFiles"] == [{"content": token, "mountPath": "/etc/bcd/join-token"}]
    assert "BCD_CONTROL_PLANE=https://gw.eu-1.example.com" in service["environment"]


def test_the_schema_does_refuse_a_broken_document(validator: jsonschema.protocols.Validator) -> None:
    bad = {"apiVersion": "v1alpha1", "kind": "ExtensionServiceConfig", "configFiles": [{"path": "/x"}]}
    assert list(validator.iter_errors(bad))  # no name, and configFiles entries have no "path"
