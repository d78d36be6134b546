"""userdata.render with the engine, PKI and secrets each their own process."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest

from better_compute.clients import EngineClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses
from better_compute.testing.workflows import wait_workflow


@pytest.fixture
async def stack(bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path) -> ServiceProcesses:
    bc_processes.settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    bc_processes.extra_env = {
        "BC_PKI_KEY_FILE": str(tmp_path / "pki.key"),
        "BC_SECRETS_KEY_FILE": str(tmp_path / "secrets.key"),
    }
    for name in ("bc-engine", "bc-pki", "bc-secrets"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    return bc_processes


async def render(api: ApiClient, node: str, user_data: dict[str, object], pid: str) -> dict[str, object]:
    engine_api = EngineClient(api)
    doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "userData": user_data,
           "steps": [{"use": "userdata.render"}]}  # fmt: skip
    await engine_api.create_profile(document=doc)
    wf = await engine_api.start_workflow(profile_id=pid, node_id=node)
    return await wait_workflow(api, wf.id, timeout=30)


async def test_renders_with_a_fresh_token_and_returns_only_references(
    stack: ServiceProcesses, bc_api: ApiClient
) -> None:
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="lab1", labels={"mac": "52:54:00:12:34:56"})
    done = await render(bc_api, node.id, {"kind": "cloud-init", "tokenTtlSeconds": 900}, "ci")
    assert done.state == "succeeded", done
    result = done.steps[0].result
    assert set(result) == {"userDataRef", "kind", "joinTokenId"}
    assert result["kind"] == "cloud-init"
    assert result["userDataRef"].startswith("sec_")
    assert result["joinTokenId"].startswith("tok_")

    # the control plane can read the document; the token in it is fresh, single-use, bound to the mac
    document = (await SecretsClient(bc_api).get(ref=result["userDataRef"])).decode()
    assert document.startswith("#cloud-config\n")
    cfg = json.loads(document.split("\n", 1)[1])
    assert cfg["hostname"] == node.id.replace("_", "-")
    token = cfg["write_files"][0]["content"]
    assert (
        "curl -fsSL -o /usr/local/bin/bcd 'https://downloads.test.example/bcd/0.1.0/bcd-linux-amd64'"
        in cfg["runcmd"]
    )
    info = await bc_api.call("pki", "tokens.get", {"joinTokenId": result["joinTokenId"]})
    assert (info["role"], info["maxUses"], info["siteId"]) == ("provisioned", 1, "lab1")
    assert info["expect"]["mac"] == "52:54:00:12:34:56"

    # nothing that was rendered leaked into the workflow or any service's log
    view = msgspec.json.encode(await engine_api.get_workflow(id=done.id)).decode()
    assert token not in view
    for proc in stack.procs:
        out = proc.output()
        assert token not in out
        assert base64.b64encode(token.encode()).decode() not in out


async def test_named_templates_ignition_and_refusals(stack: ServiceProcesses, bc_api: ApiClient) -> None:
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="lab1")
    done = await render(bc_api, node.id, {"kind": "plain", "template": "plain.txt"}, "plain")
    doc = (await SecretsClient(bc_api).get(ref=done.steps[0].result["userDataRef"])).decode()
    assert doc.startswith(f"node={node.id} host={node.id.replace('_', '-')} token=")

    node2 = await engine_api.create_node(site_id="lab1")
    done = await render(bc_api, node2.id, {"kind": "ignition"}, "ign")
    doc = (await SecretsClient(bc_api).get(ref=done.steps[0].result["userDataRef"])).decode()
    assert json.loads(doc)["ignition"]["version"] == "3.4.0"

    node3 = await engine_api.create_node(site_id="lab1")
    done = await render(bc_api, node3.id, {"kind": "talos"}, "talos")
    assert done.state == "failed"
    assert done.steps[0].error["code"] == "INVALID_CONFIG"
    assert done.steps[0].error["details"]["path"] == "userData.template"

    with pytest.raises(BcError) as e:
        await engine_api.start_workflow(profile_id="ci-none")
    assert e.value.code is ErrorCode.NOT_FOUND


async def test_user_data_settings_come_from_bc_toml(
    bc_settings: Settings, bc_processes: ServiceProcesses, bc_api: ApiClient, tmp_path: Path
) -> None:
    """Issue 10 item 10: bcdUrl and the other user-data settings were settable only in Python.
    A `[userdata]` section of bc.toml now sets them (over the app's UserData)."""
    sha = "ab" * 32
    config = tmp_path / "bc.toml"
    config.write_text(
        "[userdata]\n"
        'bcd_url = "https://mirror.site.example/bcd/bcd-linux-amd64"\n'
        f'bcd_sha256 = "{sha}"\n'
        'control_plane_url = "https://cp.site.example"\n'
    )
    bc_processes.settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    bc_processes.extra_env = {
        "BC_CONFIG": str(config),
        "BC_PKI_KEY_FILE": str(tmp_path / "pki.key"),
        "BC_SECRETS_KEY_FILE": str(tmp_path / "secrets.key"),
    }
    for name in ("bc-engine", "bc-pki", "bc-secrets"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    node = await EngineClient(bc_api).create_node(site_id="lab1")
    done = await render(bc_api, node.id, {"kind": "cloud-init"}, "from-toml")
    assert done.state == "succeeded", done
    document = (await SecretsClient(bc_api).get(ref=done.steps[0].result["userDataRef"])).decode()
    assert "https://mirror.site.example/bcd/bcd-linux-amd64" in document
    assert sha in document
    assert "downloads.test.example" not in document
