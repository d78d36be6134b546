"""userdata.render with the engine, PKI and secrets each their own process."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from bc_engine.steps.context import EngineSql
from better_compute.clients import EngineClient, SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import ProvisionedTarget, provisioned_target_resolver
from better_compute.service import ApiClient, Database
from better_compute.testing import ServiceProcesses
from better_compute.testing.workflows import wait_workflow
from better_compute.wire.engine import WorkflowView


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


async def validate(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run a format's own validator (Debian's cloud-init and ignition packages)."""
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=120)


async def render(api: ApiClient, node: str, user_data: dict[str, object], pid: str) -> WorkflowView:
    engine_api = EngineClient(api)
    doc = {"id": pid, "version": 1, "target": "metal", "role": "host", "userData": user_data,
           "steps": [{"use": "userdata.render"}]}  # fmt: skip
    await engine_api.create_profile(document=doc)
    wf = await engine_api.start_workflow(profile_id=pid, node_id=node)
    return await wait_workflow(api, wf.id, timeout=30)


async def test_renders_with_a_fresh_token_and_returns_only_references(
    stack: ServiceProcesses, bc_api: ApiClient, tmp_path: Path
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
    # the document as stored passes cloud-init's own validator
    (tmp_path / "user-data").write_text(document)
    checked = await validate("cloud-init", "schema", "--config-file", str(tmp_path / "user-data"))
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # the token maps back to this node through the step result (provisioned_target_resolver)
    db = Database(stack.settings.database_url or "", "engine")
    await db.open()
    try:
        resolve = provisioned_target_resolver()
        target = await resolve(EngineSql(db.pool), result["joinTokenId"])
        assert target == ProvisionedTarget(node_id=node.id, workflow_id=done.id, tenant_id="root")
        assert await resolve(EngineSql(db.pool), "tok_01J0000000000000000000000A") is None
    finally:
        await db.close()

    # nothing that was rendered leaked into the workflow or any service's log
    view = msgspec.json.encode(await engine_api.get_workflow(id=done.id)).decode()
    assert token not in view
    for proc in stack.procs:
        out = proc.output()
        assert token not in out
        assert base64.b64encode(token.encode()).decode() not in out


async def test_named_templates_ignition_and_refusals(
    stack: ServiceProcesses, bc_api: ApiClient, tmp_path: Path
) -> None:
    engine_api = EngineClient(bc_api)
    node = await engine_api.create_node(site_id="lab1")
    done = await render(bc_api, node.id, {"kind": "plain", "template": "plain.txt"}, "plain")
    doc = (await SecretsClient(bc_api).get(ref=done.steps[0].result["userDataRef"])).decode()
    assert doc.startswith(f"node={node.id} host={node.id.replace('_', '-')} token=")

    node2 = await engine_api.create_node(site_id="lab1")
    done = await render(bc_api, node2.id, {"kind": "ignition"}, "ign")
    doc = (await SecretsClient(bc_api).get(ref=done.steps[0].result["userDataRef"])).decode()
    assert json.loads(doc)["ignition"]["version"] == "3.3.0"
    (tmp_path / "config.ign").write_text(doc)
    checked = await validate("ignition-validate", str(tmp_path / "config.ign"))
    assert checked.returncode == 0, checked.stdout + checked.stderr

    node3 = await engine_api.create_node(site_id="lab1")
    done = await render(bc_api, node3.id, {"kind": "talos"}, "talos")
    doc = (await SecretsClient(bc_api).get(ref=done.steps[0].result["userDataRef"])).decode()
    assert '"kind": "ExtensionServiceConfig"' in doc  # the built-in Talos documents

    # a kind nothing ships, with no template named: refused when the profile is stored (issue
    # 26), not by the step on the machine's way
    butane = {"id": "butane", "version": 1, "target": "metal", "role": "host", "userData": {"kind": "butane"},
              "steps": [{"use": "userdata.render"}]}  # fmt: skip
    with pytest.raises(BcError) as e:
        await engine_api.create_profile(document=butane)
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_CONFIG, "document.userData.template")

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


async def test_the_rendered_token_binds_the_nodes_hardware_in_the_wires_spelling(
    stack: ServiceProcesses, bc_api: ApiClient
) -> None:
    """The installed OS's token is bound to the node's enrolled MAC and to the product UUID and
    serial its (node-signed) inventory showed, and bc-pki enforces them: a join with another
    product UUID is refused without spending the token. Regression: the claims went out in
    snake_case (``product_uuid``), which bc-pki's decoder ignores, and no MAC was bound."""
    from better_compute.clients import PkiClient
    from better_compute.crypto import make_csr, new_agent_key
    from better_compute.wire.pki import JoinClaims

    engine_api, pki = EngineClient(bc_api), PkiClient(bc_api)
    uuid, serial, mac = "4c4c4544-0042-3510-8052-b4c04f4d3232", "SRV-0042", "52:54:00:ab:cd:42"
    gpu = "GPU-8f5a3b1e-52b4-4c4f-9d32-0042abcdef01"
    node = await engine_api.create_node(site_id="lab1", macs=[mac.upper()], labels={"gpuUuid": gpu})
    db = Database(stack.settings.database_url or "", "engine")
    await db.open()
    try:  # what inspect.collect keeps from the node's signed node.inventory
        inventory = {"productUuid": uuid, "serial": serial, "kind": "node.inventory"}
        await db.pool.execute("UPDATE nodes SET inventory = $2 WHERE id = $1", node.id, json.dumps(inventory))
    finally:
        await db.close()
    done = await render(bc_api, node.id, {"kind": "cloud-init"}, "ci-claims")
    assert done.state == "succeeded", done
    info = await bc_api.call("pki", "tokens.get", {"joinTokenId": done.steps[0].result["joinTokenId"]})
    expect = {k: v for k, v in info["expect"].items() if v is not None}
    assert expect == {"mac": mac, "productUuid": uuid, "serial": serial, "gpuUuid": gpu.lower()}
    document = (await SecretsClient(bc_api).get(ref=done.steps[0].result["userDataRef"])).decode()
    token = json.loads(document.split("\n", 1)[1])["write_files"][0]["content"]

    key = new_agent_key()
    other = JoinClaims(
        macs=[mac], product_uuid="00000000-0000-4000-8000-000000000001", serial=serial, gpu_uuids=[gpu]
    )
    with pytest.raises(BcError) as refused:
        await pki.join(token=token, csr=make_csr(key), claims=other)
    assert refused.value.code is ErrorCode.PERMISSION_DENIED, refused.value
    # the machine itself joins with the same token: the refusal spent nothing
    joined = await pki.join(
        token=token,
        csr=make_csr(key),
        claims=JoinClaims(macs=[mac], product_uuid=uuid, serial=serial, gpu_uuids=[gpu]),
    )
    assert joined.role == "provisioned"
