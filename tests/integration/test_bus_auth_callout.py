"""Per-agent NATS identities from the project's PKI (issue 23 item 1, the building block).

One nats-server with TLS ``verify`` and an auth callout, answered by
``better_compute.service.bus_auth.CalloutResponder``: an agent connects with the certificate
bc-pki issued it and becomes a user of its own, with its own subjects and inbox only. An agent
of another site, a revoked certificate, and a certificate of another CA get no connection.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nkeys
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives import serialization
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from bc_pki.ca import CertificateAuthority, parse_csr
from better_compute.agent import Enrollment
from better_compute.agent.bus import agent_options
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import issue_bus_certificate, make_csr, new_agent_key, new_bus_ca
from better_compute.runtime.embedded import free_port, nats_server_binary, wait_port
from better_compute.service.bus_auth import AgentCertificate, CalloutResponder
from better_compute.service.client import LazyTls, connect
from better_compute.testing import until
from better_compute.wire import Subjects

SUBJECTS = Subjects()


@dataclass
class Callout:
    folder: Path
    port: int
    ca: CertificateAuthority
    revoked: set[str] = field(default_factory=set)  # agent ids
    errors: dict[str, list[str]] = field(default_factory=dict)

    def agent(
        self, agent_id: str, site_id: str = "eu1", ca: CertificateAuthority | None = None
    ) -> ssl.SSLContext:
        """A TLS context presenting the certificate ``ca`` (bc-pki's) issues ``agent_id``."""
        key = new_agent_key()
        cert = (ca or self.ca).issue(
            parse_csr(make_csr(key)), agent_id=agent_id, tenant_id="root", site_id=site_id, role="node",
            lifetime=dt.timedelta(hours=1),
        )  # fmt: skip
        (self.folder / f"{agent_id}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (self.folder / f"{agent_id}-key.pem").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        tls = ssl.create_default_context(cafile=str(self.folder / "bus-ca.pem"))
        tls.load_cert_chain(self.folder / f"{agent_id}.pem", self.folder / f"{agent_id}-key.pem")
        return tls

    async def connect(self, agent_id: str, tls: ssl.SSLContext | LazyTls, **kwargs: object) -> Nats:
        seen = self.errors.setdefault(agent_id, [])

        async def on_error(err: Exception) -> None:
            seen.append(str(err).lower())

        return await connect(
            f"tls://127.0.0.1:{self.port}", name=agent_id, tls=tls, error_cb=on_error,
            allow_reconnect=False, **kwargs,
        )  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def callout(tmp_path: Path) -> AsyncIterator[Callout]:
    ca = CertificateAuthority.create(name="test bc-pki CA")
    (tmp_path / "pki-ca.pem").write_text(ca.certificate_pem)
    bus_ca, bus_key = new_bus_ca("test bus CA")
    (tmp_path / "bus-ca.pem").write_bytes(bus_ca)
    cert, key = issue_bus_certificate(bus_ca, bus_key, name="bc-leaf-eu1", dns=[], ips=["127.0.0.1"])
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server-key.pem").write_bytes(key)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    issuer = nkeys.from_seed(seed).public_key.decode()
    port = free_port()
    (tmp_path / "leaf.conf").write_text(
        f"""
listen: 127.0.0.1:{port}
# clients show a certificate of bc-pki's CA; the server shows one of the bus CA
tls {{ cert_file: "{tmp_path}/server.pem", key_file: "{tmp_path}/server-key.pem",
       ca_file: "{tmp_path}/pki-ca.pem", verify: true }}
accounts {{
  AUTH: {{ users: [ {{ user: callout, password: callout-pw }} ] }}
  SITE: {{ users: [ {{ user: control, password: control-pw }} ] }}
}}
authorization {{
  auth_callout {{ issuer: {issuer}, auth_users: [ callout, control ], account: AUTH }}
}}
"""
    )
    proc = _start(tmp_path / "leaf.conf", tmp_path / "leaf.log")
    made = Callout(tmp_path, port, ca)
    try:
        wait_port(port, timeout=15, pid=proc.pid)

        async def revoked(agent: AgentCertificate) -> bool:
            return agent.agent_id in made.revoked

        responder = CalloutResponder(
            ca_pem=ca.certificate_pem.encode(),
            issuer_seed=seed,
            site_id="eu1",
            account="SITE",
            revoked=revoked,
        )
        svc = await made.connect("callout", made.agent("callout"), user="callout", password="callout-pw")
        await responder.start(svc)
        yield made
        await svc.close()
    finally:
        proc.kill()
        proc.wait(timeout=15)


def _start(conf: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(nats_server_binary()), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT
        )


async def _refused(made: Callout, who: str, subject: str) -> bool | None:
    return (
        True if any(subject.lower() in e and "permissions violation" in e for e in made.errors[who]) else None
    )


async def test_an_agent_connects_as_itself_with_only_its_own_subjects(callout: Callout) -> None:
    control = await callout.connect(
        "control", callout.agent("control"), user="control", password="control-pw"
    )

    async def welcome(msg: Msg) -> None:
        await msg.respond(b"welcome")

    await control.subscribe("bc.agent.eu1.*.hello", cb=welcome)
    await control.flush()
    a1 = await callout.connect("agent_a1", callout.agent("agent_a1"), inbox_prefix="_INBOX.agent_a1")
    reply = await a1.request(SUBJECTS.agent_event("eu1", "agent_a1", "hello"), b"hi", timeout=5)
    assert reply.data == b"welcome"
    stream = SUBJECTS.site_stream("eu1")
    for subject in [
        SUBJECTS.agent_event("eu1", "agent_a2", "heartbeat"),  # another agent of its site
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.agent_a2",  # another agent's commands
        "bc.api.secrets.secrets.get",
    ]:
        await a1.publish(subject, b"x")
    await a1.subscribe("_INBOX.>")  # every reply of the site
    await a1.subscribe("_INBOX.agent_a2.>")
    await a1.flush()
    for subject in [
        "bc.agent.eu1.agent_a2.heartbeat", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.agent_a2",
        "bc.api.secrets.secrets.get", "_INBOX.>", "_INBOX.agent_a2.>",
    ]:  # fmt: skip
        await until(functools.partial(_refused, callout, "agent_a1", subject), timeout=5, what=subject)


@pytest.mark.parametrize("case", ["other-site", "revoked", "other-ca"])
async def test_no_connection_without_a_good_certificate_of_this_site(callout: Callout, case: str) -> None:
    if case == "other-site":
        tls = callout.agent("agent_u1", site_id="us1")
    elif case == "revoked":
        tls = callout.agent("agent_r1")
        callout.revoked.add("agent_r1")
    else:
        tls = callout.agent("agent_x1", ca=CertificateAuthority.create(name="someone else's CA"))
    with pytest.raises(BcError) as err:
        await callout.connect("agent", tls)
    # another CA fails the TLS handshake, the rest the callout's answer
    assert err.value.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.UNAVAILABLE)
    if case != "other-ca":
        assert err.value.code is ErrorCode.UNAUTHENTICATED


async def test_an_agents_tls_context_is_made_only_when_its_server_asks_for_tls(
    callout: Callout, bc_settings: Settings
) -> None:
    """Issue 25 item 3: an agent's TLS context (its certificate, the CA it trusts: about a MiB
    with the system's CAs) is made when a server asks for TLS, never for a plain server (the
    metal simulator's lean host runs thousands of agents in one process); a CA that cannot be
    loaded is the connection's ``INVALID_CONFIG`` then."""
    key = new_agent_key()
    cert = callout.ca.issue(
        parse_csr(make_csr(key)), agent_id="agent_l1", tenant_id="root", site_id="eu1", role="node",
        lifetime=dt.timedelta(hours=1),
    )  # fmt: skip
    enrollment = Enrollment(
        agent_id="agent_l1", cert_id="cert_l1", site_id="eu1", tenant_id="root", role="node",
        certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(), private_key=key,
    )  # fmt: skip
    plain = agent_options(enrollment, ca=str(callout.folder / "no-such-ca.pem"))
    assert bc_settings.nats_url is not None
    nc = await connect(bc_settings.nats_url, name="agent_l1", **plain)
    try:
        await nc.flush()
        assert not plain["tls"].made
    finally:
        await nc.close()
    with pytest.raises(BcError) as refused:
        plain["tls"].context()
    assert (refused.value.code, refused.value.details["path"]) == (ErrorCode.INVALID_CONFIG, "nats_ca")
    # the same options with the bus CA, against the leaf that asks for TLS and reads the certificate
    options = agent_options(enrollment, ca=str(callout.folder / "bus-ca.pem"))
    tls = options.pop("tls")
    a1 = await callout.connect("agent_l1", tls, **options)
    try:
        await a1.flush()
        assert a1.is_connected
        assert tls.made
    finally:
        await a1.close()
