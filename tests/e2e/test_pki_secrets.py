"""bc-pki and bc-secrets as their own processes: two instances each, restarts, and bcx."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from cryptography import x509
from nats.aio.client import Client as Nats

from better_compute.agent.sim import join_agent
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.crypto import AgentIdentity, make_csr, new_agent_key
from better_compute.service import ApiClient, discover
from better_compute.testing import ServiceProcesses, run_bcx
from better_compute.wire.pki import JoinClaims
from secrets_test_app import APP, enqueue_ref


@pytest.fixture
def bc_settings(bc_settings: Settings) -> Settings:
    """Every process here loads the app with ``test.useSecret``, a kind carrying a ref."""
    return msgspec.structs.replace(bc_settings, app=APP)


async def new_agent(pki: PkiClient, token: str) -> AgentIdentity:
    key = new_agent_key()
    return AgentIdentity.from_join(await pki.join(token=token, csr=make_csr(key)), key)


def served(found: list[dict[str, Any]], name: str) -> list[int]:
    """Requests each instance of ``name`` answered, health checks aside."""
    return [
        sum(int(e.get("num_requests", 0)) for e in d.get("endpoints") or [] if e.get("name") != "health-get")
        for d in found
        if d.get("name") == name
    ]


async def test_two_instances_of_each_service_serve_at_once_over_one_ca(
    bc_processes: ServiceProcesses, bc_settings: Settings, bc_api: ApiClient, bc_nats: Nats
) -> None:
    # all four start together on an empty database: exactly one CA comes out of it
    procs = [bc_processes.start(s) for s in ("bc-pki", "bc-pki", "bc-secrets", "bc-secrets")]
    procs.append(bc_processes.start("bc-command-queue"))
    await bc_processes.wait_ready()
    pki, secrets, cq = PkiClient(bc_api), SecretsClient(bc_api), CommandQueueClient(bc_api)
    wf = new_id("wf")
    nodes = [new_id("node") for _ in range(12)]
    # twelve nodes' bcds join at once, each with its own token
    agents = await asyncio.gather(
        *(join_agent(bc_api, site_id="site-a", role="node", node_id=node) for node in nodes)
    )
    values = [f"value-{i}-{new_id('sec')}".encode() for i in range(12)]
    infos = await asyncio.gather(
        *(secrets.put(value=v, tenant_id="root", workflow_id=wf, step=i) for i, v in enumerate(values))
    )
    await asyncio.gather(
        *(
            enqueue_ref(cq, node_id=node, site_id="site-a", key=f"wf:{wf}:{i}#1", payload={"ref": info.ref},
                        workflow_id=wf, step=i)
            for i, (node, info) in enumerate(zip(nodes, infos, strict=True))
        )
    )  # fmt: skip
    fetched = await asyncio.gather(
        *(secrets.fetch(ref=info.ref, identity=a.identity) for a, info in zip(agents, infos, strict=True))
    )
    fingerprints = {(await pki.ca()).fingerprint_sha256 for _ in range(8)}
    certs = await pki.list_certificates(site_id="site-a")
    ca_pem = (await pki.ca()).certificate_pem

    assert fetched == values
    assert len(fingerprints) == 1
    assert [a.agent_id for a in agents] == nodes
    assert sorted(c.cert_id for c in certs) == sorted(a.cert_id for a in agents)
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    for cert in certs:
        x509.load_pem_x509_certificate(cert.certificate_pem.encode()).verify_directly_issued_by(ca)
    # both instances of each service answered some of those requests
    found = await discover(bc_nats, root=bc_settings.subject_root)
    assert all(n > 0 for n in served(found, "bc-pki")), served(found, "bc-pki")
    assert all(n > 0 for n in served(found, "bc-secrets")), served(found, "bc-secrets")
    assert len(served(found, "bc-pki")) == len(served(found, "bc-secrets")) == 2
    conn = await asyncpg.connect(bc_settings.database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pki.ca") == 1
    finally:
        await conn.close()
    for p in procs:
        assert p.alive()


async def test_a_restart_of_either_service_loses_nothing(
    bc_processes: ServiceProcesses, bc_api: ApiClient
) -> None:
    pki_proc, secrets_proc = bc_processes.start("bc-pki"), bc_processes.start("bc-secrets")
    cmdq_proc = bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    pki, secrets, cq = PkiClient(bc_api), SecretsClient(bc_api), CommandQueueClient(bc_api)
    wf, node = new_id("wf"), new_id("node")
    value = b"survives-restarts-" + new_id("sec").encode()
    fingerprint = (await pki.ca()).fingerprint_sha256
    # the node's join token, as a step mints it: found again under its idempotency key and
    # its attempt's mint secret
    mint_secret = os.urandom(32)
    token = await pki.issue_join_token(
        tenant_id="root", role="node", site_id="site-a", ttl_seconds=300, max_uses=2,
        idempotency_key=f"wf:{wf}:0#1", node_id=node, mint_secret=mint_secret,
    )  # fmt: skip
    agent = await new_agent(pki, token.token)
    ref = (await secrets.put(value=value, tenant_id="root", workflow_id=wf, step=1)).ref
    command = await enqueue_ref(
        cq, node_id=node, site_id="site-a", key=f"wf:{wf}:1#1:media", payload={"ref": ref},
        workflow_id=wf, step=1,
    )  # fmt: skip
    assert await secrets.fetch(ref=ref, identity=agent) == value

    # SIGKILL both: nothing gets to clean up
    for proc in (pki_proc, secrets_proc):
        proc.kill()
        bc_processes.procs.remove(proc)  # wait_ready would take the kill for a crash
        proc.close()
    bc_processes.start("bc-pki")
    bc_processes.start("bc-secrets")
    await bc_processes.wait_ready()

    assert (await pki.ca()).fingerprint_sha256 == fingerprint
    again = await pki.issue_join_token(
        tenant_id="root", role="node", site_id="site-a", ttl_seconds=300, max_uses=2,
        idempotency_key=f"wf:{wf}:0#1", node_id=node, mint_secret=mint_secret,
    )  # fmt: skip
    assert (again.id, again.token) == (token.id, token.token)
    second = await new_agent(pki, token.token)  # the token's second use: the node enrolls again
    data, signature = agent.sign("agent.event", {"kind": "heartbeat"})
    verified = await pki.verify(signer_id=agent.agent_id, data=data, signature=signature)
    assert verified.cert_id == agent.cert_id
    assert await secrets.fetch(ref=ref, identity=agent) == value
    assert await secrets.get(ref=ref) == value
    tokens = await pki.list_join_tokens()
    audit = await secrets.list_fetches(ref=ref)
    assert [(t.join_token_id, t.uses, t.state) for t in tokens] == [(token.id, 2, "used")]
    assert (second.agent_id, agent.agent_id) == (node, node)
    assert second.cert_id != agent.cert_id
    assert [(a.outcome, a.command_id) for a in audit] == [("granted", command.id)] * 2
    assert cmdq_proc.alive()


async def test_bcx_manages_tokens_certs_and_secrets_and_shows_values_only_when_asked(
    bc_processes: ServiceProcesses, bc_settings: Settings, bc_api: ApiClient, tmp_path: Path
) -> None:
    procs = [bc_processes.start("bc-pki"), bc_processes.start("bc-secrets")]
    await bc_processes.wait_ready()
    s = bc_settings

    refused = run_bcx(s, "tokens", "issue", "--role", "node", "--site", "site-a", "--json")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["error"]["code"] == "INVALID_INPUT"
    assert "--show-token" in json.loads(refused.stdout)["error"]["message"]

    out = run_bcx(s, "tokens", "issue", "--role", "node", "--site", "site-a", "--ttl", "10m",
              "--expect-mac", "aa:bb:cc:dd:ee:01", "--show-token", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    issued = json.loads(out.stdout)
    token, token_id = issued["token"], issued["joinTokenId"]
    assert token.startswith("bcjt_")

    token_file = tmp_path / "token"
    out = run_bcx(s, "tokens", "issue", "--role", "site", "--site", "site-a", "--token-file",
              str(token_file))  # fmt: skip
    assert out.returncode == 0, out.stderr
    file_token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert file_token.startswith("bcjt_")
    assert file_token not in out.stdout
    assert "written to" in out.stdout

    listed = run_bcx(s, "tokens", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split()[:4] == ["ID", "TENANT", "ROLE", "SITE"]
    assert token_id in listed.stdout
    listed_json = run_bcx(s, "tokens", "list", "--json")
    assert {t["joinTokenId"] for t in json.loads(listed_json.stdout)["tokens"]} >= {token_id}
    for output in (listed.stdout, listed_json.stdout):
        assert token not in output
        assert file_token not in output

    pki = PkiClient(bc_api)
    key = new_agent_key()
    joined = await pki.join(token=token, csr=make_csr(key), claims=JoinClaims(macs=["aa:bb:cc:dd:ee:01"]))
    certs = json.loads(run_bcx(s, "certs", "list", "--json").stdout)["certificates"]
    assert [c["certId"] for c in certs] == [joined.cert_id]
    out = run_bcx(s, "certs", "revoke", joined.cert_id, "--reason", "lost laptop")
    assert out.returncode == 0, out.stderr
    assert "revoked" in out.stdout
    assert run_bcx(s, "certs", "list").stdout.strip() == "no certificates"
    everything = run_bcx(s, "certs", "list", "--include-revoked")
    assert joined.cert_id in everything.stdout
    assert "revoked" in everything.stdout
    out = run_bcx(s, "tokens", "revoke", token_id, "--json")
    assert json.loads(out.stdout)["state"] == "revoked"
    missing = run_bcx(s, "certs", "revoke", new_id("cert"), "--json")
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["error"]["code"] == "NOT_FOUND"

    value = b"bcx-must-not-print-" + new_id("sec").encode()
    wf = new_id("wf")
    ref = (await SecretsClient(bc_api).put(value=value, tenant_id="acme", workflow_id=wf, step=4)).ref
    table = run_bcx(s, "secrets", "list")
    as_json = run_bcx(s, "secrets", "list", "--workflow", wf, "--json")
    shown = run_bcx(s, "secrets", "show", ref)
    assert table.returncode == as_json.returncode == shown.returncode == 0
    assert ref in table.stdout
    assert [x["ref"] for x in json.loads(as_json.stdout)["secrets"]] == [ref]
    assert ref in shown.stdout
    for output in (table.stdout, as_json.stdout, shown.stdout, table.stderr):
        assert value.decode() not in output
        assert base64.b64encode(value).decode() not in output
    revealed = run_bcx(s, "secrets", "show", ref, "--reveal")
    assert revealed.stdout.encode() == value
    revealed_json = json.loads(run_bcx(s, "secrets", "show", ref, "--reveal", "--json").stdout)
    assert base64.b64decode(revealed_json["value"]) == value

    for p in procs:
        log = p.output()
        assert "service_started" in log
        for secret in (token, file_token, value.decode(), base64.b64encode(value).decode()):
            assert secret not in log


async def test_bcx_refuses_an_existing_token_file_before_minting_anything(
    bc_processes: ServiceProcesses, bc_settings: Settings, bc_api: ApiClient, tmp_path: Path
) -> None:
    """Issue 10 item 6: a CONFLICT on --token-file leaves no active token behind."""
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    taken = tmp_path / "join-token"
    taken.write_text("someone else's\n")

    out = run_bcx(bc_settings, "tokens", "issue", "--role", "site", "--site", "site-a",
              "--token-file", str(taken), "--json")  # fmt: skip
    # a mint the service refuses leaves no (empty) token file behind either
    bad = tmp_path / "bad-token"
    wrong = run_bcx(bc_settings, "tokens", "issue", "--role", "site", "--site", "site-a",
                "--node", new_id("node"), "--token-file", str(bad), "--json")  # fmt: skip

    assert out.returncode == 1
    error = json.loads(out.stdout)["error"]
    assert (error["code"], error["details"]["path"]) == ("CONFLICT", "--token-file")
    assert taken.read_text() == "someone else's\n"
    assert await PkiClient(bc_api).list_join_tokens() == []
    assert wrong.returncode == 1
    assert json.loads(wrong.stdout)["error"]["code"] == "INVALID_INPUT"
    assert not bad.exists()
