"""Who a process is on the bus: the inbox prefixes services and bcx connect with (issue 23).

deploy/nats lets each service user read replies only under ``_INBOX.<service>.>`` and each
operator only under ``_INBOX_OPS.<user>.>``; these are the prefixes the code picks for that
(tests/integration/test_deploy_nats.py runs them against the committed configs)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
from pathlib import Path

import bcrypt
import nkeys
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from bc_pki.ca import CertificateAuthority, parse_csr
from better_compute.cli.common import operator_inbox
from better_compute.cli.hints import HintContext, hint_for
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import make_csr, new_agent_key
from better_compute.service.bus_auth import agent_certificate, agent_permissions, joining_certificate
from better_compute.testing.bcx import run_bcx
from better_compute.wire import Subjects
from better_compute.wire.subjects import (
    SERVICE_NAMES,
    agent_inbox_prefix,
    join_connection_name,
    join_inbox_prefix,
    join_nonce,
    operator_inbox_prefix,
    service_inbox_prefix,
)


def _creds(tmp_path: Path, claims: dict[str, object]) -> str:
    def part(value: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    jwt = f"{part({'typ': 'JWT', 'alg': 'ed25519-nkey'})}.{part(claims)}.c2ln"
    path = tmp_path / "user.creds"
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\nSUAEXAMPLE\n------END USER NKEY SEED------\n"
    )
    return str(path)


def test_each_service_has_its_own_inbox_prefix() -> None:
    prefixes = {service_inbox_prefix(api) for api in SERVICE_NAMES}
    assert prefixes == {"_INBOX.engine", "_INBOX.command-queue", "_INBOX.pki", "_INBOX.secrets"}
    with pytest.raises(ValueError, match="not a subject token"):
        service_inbox_prefix("pki.>")


def test_bcx_takes_its_inbox_from_the_nats_user_of_its_url_or_credentials(tmp_path: Path) -> None:
    assert operator_inbox("nats://alice:p4ss@nats-1:4222,nats://alice:p4ss@nats-2:4222", None) == (
        "_INBOX_OPS.alice"
    )
    assert operator_inbox("tls://nats-1:4222", _creds(tmp_path, {"name": "bob", "sub": "UABC"})) == (
        "_INBOX_OPS.bob"
    )
    # the dev stack's NATS has no users: any token will do, the same for every bcx
    assert (
        operator_inbox("nats://127.0.0.1:4222", None) == operator_inbox_prefix(None) == "_INBOX_OPS.anonymous"
    )
    assert (
        operator_inbox("nats://127.0.0.1:4222", _creds(tmp_path, {"sub": "UABC"})) == "_INBOX_OPS.anonymous"
    )


def test_a_user_that_cannot_name_an_inbox_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(BcError) as err:
        operator_inbox("nats://alice.smith:p@nats-1:4222", None)
    assert (err.value.code, err.value.details["path"]) == (ErrorCode.INVALID_CONFIG, "nats_url")
    assert "p@" not in str(err.value)
    with pytest.raises(BcError) as err:
        operator_inbox("nats://nats-1:4222", _creds(tmp_path, {"name": "ops team"}))
    assert err.value.details["path"] == "nats_creds"


def test_bcx_bus_makes_the_ca_the_servers_certificates_and_password_hashes(tmp_path: Path) -> None:
    """deploy/nats's artefacts, as an operator makes them before the bus exists (the deploy test
    runs nats-server on certificates and hashes from the same functions)."""
    tls = tmp_path / "tls"
    run = run_bcx(None, "bus", "ca", "--dir", str(tls), isolated=True)
    assert run.returncode == 0, run.stderr
    assert (tls / "ca-key.pem").stat().st_mode & 0o077 == 0  # the CA's key: its owner's only
    again = run_bcx(None, "bus", "ca", "--dir", str(tls), "--json", isolated=True)
    assert again.returncode != 0
    assert "CONFLICT" in again.stdout  # never over an existing CA
    run = run_bcx(
        None, "bus", "cert", "--dir", str(tls), "--name", "bc-nats-1",
        "--dns", "nats-1.example.internal", "--ip", "10.0.0.1", isolated=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    ca = x509.load_pem_x509_certificate((tls / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((tls / "bc-nats-1.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["nats-1.example.internal"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.1"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert (tls / "bc-nats-1-key.pem").stat().st_mode & 0o077 == 0
    bad = run_bcx(
        None, "bus", "cert", "--dir", str(tls), "--name", "x", "--ip", "10.0.0", "--json", isolated=True
    )
    assert bad.returncode != 0
    assert '"ip"' in bad.stdout

    run = run_bcx(None, "bus", "password", "--user", "command-queue", isolated=True, input="p0ssw0rd\n")
    assert run.returncode == 0, run.stderr
    var, _, value = run.stdout.strip().partition("=")
    assert var == "BC_NATS_COMMAND_QUEUE_PASSWORD"
    assert value.startswith("'\"$2b$")  # as nats.env.example shows
    assert value.endswith("\"'")
    assert bcrypt.checkpw(b"p0ssw0rd", value.strip("'\"").encode())
    assert "p0ssw0rd" not in run.stdout


def test_an_untrusted_bus_certificate_hints_at_the_ca_setting() -> None:
    err = BcError(
        ErrorCode.INVALID_CONFIG,
        "the TLS certificate of NATS at tls://n:4222 is not trusted",
        {"path": "nats_ca"},
    )
    assert "BC_NATS_CA" in (hint_for(err, HintContext(command=("status",))) or "")


def test_only_an_agent_certificate_of_the_ca_in_date_names_an_agent() -> None:
    ca = CertificateAuthority.create(name="test CA")
    cert = ca.issue(
        parse_csr(make_csr(new_agent_key())), agent_id="agent_a1", tenant_id="root", site_id="eu1",
        role="node", lifetime=dt.timedelta(hours=1),
    )  # fmt: skip
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    agent = agent_certificate(pem, ca.certificate_pem.encode())
    assert (agent.agent_id, agent.site_id, agent.serial) == (
        "agent_a1",
        "eu1",
        format(cert.serial_number, "x"),
    )
    other = CertificateAuthority.create(name="another CA")
    later = time.time() + 2 * 3600
    for bad_pem, ca_pem, now in [
        (pem, other.certificate_pem.encode(), None),  # another CA's
        (pem, ca.certificate_pem.encode(), later),  # expired
        (ca.certificate_pem, ca.certificate_pem.encode(), None),  # the CA itself: no agent names
        ("not a certificate", ca.certificate_pem.encode(), None),
    ]:
        with pytest.raises(BcError) as err:
            agent_certificate(bad_pem, ca_pem, now=now)
        assert err.value.code is ErrorCode.UNAUTHENTICATED
    perms = agent_permissions(Subjects(), "eu1", "agent_a1", js_api="$JS.hub.API")
    assert "$JS.hub.API.CONSUMER.MSG.NEXT.BC_SITE_EU1.agent_a1" in perms["pub"]["allow"]
    assert perms["sub"]["allow"] == ["_INBOX.agent_a1.>"]


def test_bcx_bus_callout_makes_what_a_leaf_and_its_responder_need(tmp_path: Path) -> None:
    """Issue 23 item 2: the auth callout's artefacts, offline. The issuer's seed, the callout
    password and the keys are their owner's only and never printed; the leaf gets the issuer's
    public key, a bcrypt hash and a client CA of bc-pki's CA and the bus CA."""
    tls = tmp_path / "tls"
    assert run_bcx(None, "bus", "ca", "--dir", str(tls), isolated=True).returncode == 0
    pki = CertificateAuthority.create(name="bc-pki CA")
    (tmp_path / "pki-ca.pem").write_text(pki.certificate_pem)
    args = ("bus", "callout", "--dir", str(tls), "--site", "eu1", "--pki-ca", str(tmp_path / "pki-ca.pem"))
    run = run_bcx(None, *args, isolated=True)
    assert run.returncode == 0, run.stderr
    env = dict(line.split("=", 1) for line in run.stdout.splitlines() if line and not line.startswith("#"))
    assert set(env) == {"BC_NATS_CALLOUT_ISSUER", "BC_NATS_CALLOUT_PASSWORD", "BC_NATS_CLIENT_CA"}
    seed = (tls / "callout-eu1-issuer.nk").read_bytes().strip()
    assert nkeys.from_seed(seed).public_key.decode() == env["BC_NATS_CALLOUT_ISSUER"]
    assert env["BC_NATS_CALLOUT_ISSUER"].startswith("A")  # an account key
    password = (tls / "callout-eu1-password").read_text().strip()
    assert bcrypt.checkpw(password.encode(), env["BC_NATS_CALLOUT_PASSWORD"].strip("'\"").encode())
    for secret in (seed.decode(), password):
        assert secret not in run.stdout + run.stderr
    for name in (
        "callout-eu1-issuer.nk",
        "callout-eu1-password",
        "bc-callout-eu1-key.pem",
        "bc-join-eu1-key.pem",
    ):
        assert (tls / name).stat().st_mode & 0o077 == 0, name
    bus_ca = (tls / "ca.pem").read_bytes()
    assert Path(env["BC_NATS_CLIENT_CA"]).read_bytes() == bus_ca + pki.certificate_pem.encode()
    # the site's joining identity: a client certificate of the bus CA for eu1 alone
    assert joining_certificate((tls / "bc-join-eu1.pem").read_text(), bus_ca) == "eu1"
    with pytest.raises(BcError) as err:  # not an agent of bc-pki's CA
        agent_certificate((tls / "bc-join-eu1.pem").read_text(), pki.certificate_pem.encode())
    assert err.value.code is ErrorCode.UNAUTHENTICATED
    with pytest.raises(BcError):  # and the responder's own certificate is no joining one
        joining_certificate((tls / "bc-callout-eu1.pem").read_text(), bus_ca)

    again = run_bcx(None, *args, "--json", isolated=True)
    assert again.returncode != 0
    assert "CONFLICT" in again.stdout  # never over the responder's files
    bad = run_bcx(None, *args[:5], "eu.1", *args[6:], "--json", isolated=True)
    assert bad.returncode != 0
    assert '"site"' in bad.stdout


def test_a_joining_connection_names_its_inbox_and_an_agent_reads_only_its_own() -> None:
    """The leaf's callout lets a joining machine read only the inbox its connection names; a
    name without a long enough nonce names none (it can ask, but hears nothing)."""
    nonce = "a1b2c3d4e5f6a7b8c9d0e1f2"
    assert join_nonce(join_connection_name(nonce)) == nonce
    assert join_inbox_prefix(nonce) == f"_INBOX.join.{nonce}"
    for name in ("bc-join:short", "bc-join:" + "x" * 15, "bc-join:a.b.c.d.e.f.g.h.i", "bcd-join", ""):
        assert join_nonce(name) is None, name
    assert agent_permissions(Subjects(), "eu1", "node_1")["sub"]["allow"] == ["_INBOX.node_1.>"]
    assert agent_inbox_prefix("node_1") == "_INBOX.node_1"
    with pytest.raises(ValueError, match="not a subject token"):
        agent_inbox_prefix("node.>")
    site = agent_permissions(Subjects(), "eu1", "agent_1", role="site")["pub"]["allow"]
    assert {"bc.api.pki.tokens.burn", "bc.api.pki.tokens.confirm"} <= set(site)
    node = agent_permissions(Subjects(), "eu1", "node_1")["pub"]["allow"]
    assert not {"bc.api.pki.tokens.burn", "bc.api.pki.tokens.confirm"} & set(node)
