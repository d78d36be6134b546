"""Per-agent NATS identities as deployed (issue 23 items 1 and 2): the committed deploy/nats configs
with TLS on, bc-pki as its own process on the hub, and the eu1 leaf's auth callout answered by
``bc-pki callout`` as its own process, asking that bc-pki about every certificate.

A machine joins through the site's joining identity, connects with the certificate it got as
itself, and is cut off the moment an operator revokes the certificate.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography.hazmat.primitives import serialization
from nats.aio.msg import Msg

from better_compute.agent.identity import Enrollment, enroll
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service.client import ApiClient
from better_compute.testing.processes import ServiceProcesses
from deploy_stack import SUBJECTS, Stack, eventually, run_stack


@pytest_asyncio.fixture(loop_scope="session")
async def stack(tmp_path: Path, bc_database_url: str) -> AsyncIterator[Stack]:
    """The hub, bc-pki on it (user pki, TLS), then the leaf made with bc-pki's CA, and the
    leaf's responder."""
    async with run_stack(tmp_path, leaf=False) as st:
        settings = Settings(
            nats_url=f"tls://pki:{st.passwords['PKI']}@127.0.0.1:{st.hub[0].client_port}",
            database_url=bc_database_url,
            state_dir=str(tmp_path / "state"),
        )
        (tmp_path / "logs").mkdir()
        procs = ServiceProcesses(settings, tmp_path / "logs", env={"BC_NATS_CA": str(st.ca)})
        try:
            procs.start("bc-pki")
            alice = await st.connect("alice")
            ca = await eventually("bc-pki answers", lambda: PkiClient(ApiClient(alice)).ca())
            st.start_leaf(ca.certificate_pem.encode())
            await st.leaf_up()
            st.start_responder()
            await st.responder_ready()
            yield st
        finally:
            procs.close()
            for p in procs.procs:
                print(f"--- {p.service} ---", *p.output().splitlines()[-30:], sep="\n")


async def _join(st: Stack, role: str = "node") -> Enrollment:
    engine = await st.connect("engine")
    token = await PkiClient(ApiClient(engine)).issue_join_token(
        tenant_id="root",
        role=role,
        site_id="eu1",
        ttl_seconds=600,  # type: ignore[arg-type]
    )
    joining = await st.connect_joining()
    try:
        return await enroll(PkiClient(ApiClient(joining)), token=token.token, site_id="eu1")
    finally:
        await joining.close()


def _tls(st: Stack, who: Enrollment) -> ssl.SSLContext:
    key = who.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return st.client_tls(who.agent_id, who.certificate_pem.encode(), key)


async def test_a_revoked_agent_is_cut_off_at_once(stack: Stack) -> None:
    """Issue 23: a revoked agent kept its NATS connection (and a new one) for as long as its
    user lived. Now the responder hears the revocation and the leaf drops the connection; a new
    connection with that certificate is refused."""
    node = await _join(stack)
    gone = asyncio.Event()
    cut_at: list[float] = []

    async def disconnected() -> None:
        cut_at.append(time.monotonic())
        gone.set()

    agent = await stack.connect_agent(
        node.agent_id, _tls(stack, node), allow_reconnect=False, disconnected_cb=disconnected
    )
    cmdq = await stack.connect("command-queue")

    async def welcome(msg: Msg) -> None:
        await msg.respond(b"welcome")

    await cmdq.subscribe("bc.agent.eu1.*.hello", cb=welcome)
    await cmdq.flush()
    hello = SUBJECTS.agent_event("eu1", node.agent_id, "hello")
    assert (
        await eventually("hello answered", lambda: agent.request(hello, b"hi", timeout=1))
    ).data == b"welcome"

    alice = await stack.connect("alice")
    revoked_at = time.monotonic()
    await PkiClient(ApiClient(alice)).revoke_certificate(cert_id=node.cert_id, reason="test")
    await asyncio.wait_for(gone.wait(), timeout=10)
    print(f"cut off {cut_at[0] - revoked_at:.3f} s after the revoke call")  # measured: the report's
    assert agent.is_closed or not agent.is_connected
    with pytest.raises(BcError) as err:
        await stack.connect_agent(node.agent_id, _tls(stack, node), allow_reconnect=False)
    assert err.value.code is ErrorCode.UNAUTHENTICATED
