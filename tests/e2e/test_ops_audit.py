"""Issue 15: every operator action that changes state is in the audit of the service that made
the change, with who asked (bcx's ``$BC_ACTOR``, else login@host), when and what; ``bcx audit``
merges the four services' trails, filters by actor and time, and never shows a secret."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from nats.aio.client import Client as Nats

from better_compute.clients import EngineClient, SecretsClient
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx
from better_compute.testing.approvers import approver_keys, write_approvers
from better_compute.wire import Subjects, unwrap

SITE = "lab-audit"
SECRET = b"hunter2-never-in-the-audit"


@pytest_asyncio.fixture(loop_scope="session")
async def keys(
    bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[dict[str, ed25519.Ed25519PrivateKey]]:
    made = approver_keys(["carol"])
    write_approvers(tmp_path / "approvers.toml", made, threshold=1)
    bc_processes.extra_env.update(BC_CMDQ_QUORUM_FILE=str(tmp_path / "approvers.toml"))
    for name in ("bc-pki", "bc-secrets", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready(timeout=60)
    yield made


def _as(who: str) -> dict[str, str]:
    return {"BC_ACTOR": who}


@pytest.mark.timeout(150)
async def test_bcx_audit_shows_who_did_what_to_which_thing(
    keys: dict[str, ed25519.Ed25519PrivateKey],
    bc_settings: Settings,
    bc_nats: Nats,
    bc_subjects: Subjects,
    tmp_path: Path,
) -> None:
    alice = _as("alice@ops")
    # pki: a token issued and revoked with bcx
    code, out, err = await bcx(
        bc_settings, "tokens", "issue", "--role", "site", "--site", SITE, "--show-token", "--json", env=alice
    )
    assert code == 0, err
    token = json.loads(out)
    code, _, err = await bcx(
        bc_settings, "tokens", "revoke", token["joinTokenId"], "--reason", "lost", env=alice
    )
    assert code == 0, err

    # engine: a profile, then a workflow that waits (no agent at the site) and is aborted
    profile = tmp_path / "profile.json"
    bmc = {"driver": "sim", "address": "sim-audit"}
    profile.write_text(json.dumps({
        "id": "audit-lab", "version": 1, "target": "metal", "role": "host",
        "steps": [{"use": "power.setPower", "on": "site", "with": {"action": "on", "bmc": bmc}}],
    }))  # fmt: skip
    code, _, err = await bcx(bc_settings, "profiles", "create", str(profile), env=alice)
    assert code == 0, err
    bob_api = ApiClient(bc_nats, bc_subjects, actor="bob@lab")  # the SDK says who it is too
    engine = EngineClient(bob_api)
    node = await engine.create_node(site_id=SITE)
    wf = await engine.start_workflow(profile_id="audit-lab", node_id=node.id)
    code, _, err = await bcx(bc_settings, "workflows", "abort", wf.id, env=alice)
    assert code == 0, err

    # command-queue: a batch created by bob, approved by carol with her key
    batch = await CommandQueueClient(bob_api).create_batch(kinds=["power.setPower"], nodes=[node.id])
    key_file = tmp_path / "carol.pem"
    key_file.write_bytes(
        keys["carol"].private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    code, _, err = await bcx(
        bc_settings, "batches", "approve", batch.id, "--approver", "carol", "--key-file", str(key_file),
        env=_as("carol@sec"),
    )  # fmt: skip
    assert code == 0, err

    # secrets: a value stored by bob; and one request that says nobody
    stored = await SecretsClient(bob_api).put_for_node(SECRET, tenant_id="root", node_id=node.id)
    await EngineClient(ApiClient(bc_nats, bc_subjects)).label_node(id=node.id, set={"rack": "r1"})
    # a request as nats-server delivers it from the operators' account (deploy/nats: OPS imports
    # the API with share: true, and the server writes Nats-Request-Info, tests/integration/
    # test_deploy_nats.py): the user it names is who asked, whatever Bc-Actor claims
    stamped = {"Nats-Request-Info": '{"acc":"OPS","user":"dave","kind":"Client"}', "Bc-Actor": "mallory"}
    reply = await bc_nats.request(
        bc_subjects.api("engine", "nodes", "label"),
        json.dumps({"id": node.id, "set": {"rack": "r2"}}).encode(),
        headers=stamped,
        timeout=10,
    )
    unwrap(reply.data)  # answered, not refused

    code, out, err = await bcx(bc_settings, "audit", "--json", env=alice)
    assert code == 0, err
    assert SECRET.decode() not in out + err
    assert token["token"] not in out + err
    doc = json.loads(out)
    assert doc["missing"] == []
    got = [(e["actor"], e["service"], e["action"], e["target"]) for e in doc["entries"]]
    expected: list[tuple[Any, ...]] = [
        ("alice@ops", "bc-pki", "tokens.issue", token["joinTokenId"]),
        ("alice@ops", "bc-pki", "tokens.revoke", token["joinTokenId"]),
        ("alice@ops", "bc-engine", "profiles.create", "audit-lab"),
        ("bob@lab", "bc-engine", "nodes.create", node.id),
        ("bob@lab", "bc-engine", "workflows.start", wf.id),
        ("alice@ops", "bc-engine", "workflows.abort", wf.id),
        ("bob@lab", "bc-command-queue", "batches.create", batch.id),
        ("carol@sec", "bc-command-queue", "batches.approve", batch.id),
        ("bob@lab", "bc-secrets", "secrets.put", stored.ref),
        (None, "bc-engine", "nodes.label", node.id),
        ("dave", "bc-engine", "nodes.label", node.id),
    ]
    assert got == expected[::-1]  # newest first
    # only the server's word is proven; the claim it overrode is kept beside it
    assert [e["verified"] for e in doc["entries"]] == [True] + [False] * (len(expected) - 1)
    assert doc["entries"][0]["detail"]["claimedActor"] == "mallory"
    by_action = {e["action"]: e for e in doc["entries"]}
    assert by_action["batches.approve"]["detail"]["approverId"] == "carol"
    assert by_action["tokens.revoke"]["detail"]["reason"] == "lost"
    assert by_action["secrets.put"]["detail"] == {"tenantId": "root", "step": 0, "nodeId": node.id}
    assert by_action["workflows.start"]["detail"]["profileId"] == "audit-lab"
    assert all(e["at"].endswith("Z") for e in doc["entries"])
    # the service's own calls (the engine storing, cmdq asking pki) are not operator actions
    assert not [e for e in doc["entries"] if (e["actor"] or "").startswith("service:")]

    code, out, err = await bcx(bc_settings, "audit", "--who", "alice@ops", "--since", "1h")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["AT", "WHO", "PROVEN", "SERVICE", "ACTION", "TARGET", "DETAIL"]
    assert all(line.split()[2] == "no" for line in lines[1:])  # claims, on the dev stack's NATS
    assert len(lines) == 1 + 4
    assert all("alice@ops" in line for line in lines[1:])
    assert "workflows.abort" in lines[1]

    code, out, err = await bcx(bc_settings, "audit", "--who", "b*", "--json")
    assert code == 0, err
    assert {e["actor"] for e in json.loads(out)["entries"]} == {"bob@lab"}

    code, out, err = await bcx(bc_settings, "audit", "--limit", "0")
    assert code == 1
    assert "(at limit)" in err
