"""Who a process is on the bus: the inbox prefixes services and bcx connect with (issue 23).

deploy/nats lets each service user read replies only under ``_INBOX.<service>.>`` and each
operator only under ``_INBOX_OPS.<user>.>``; these are the prefixes the code picks for that
(tests/integration/test_deploy_nats.py runs them against the committed configs)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from better_compute.cli.common import operator_inbox
from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.subjects import SERVICE_NAMES, operator_inbox_prefix, service_inbox_prefix


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
