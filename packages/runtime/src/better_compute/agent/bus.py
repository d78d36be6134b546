"""How an agent shows itself to NATS: its bc-pki certificate as the TLS client certificate, and
its own inbox prefix (issue 23; docs/security.md, "The bus").

On a site's leaf node of deploy/nats the auth callout makes every agent a NATS user of its own
from that certificate, which may read replies only under ``_INBOX.<agent id>``. A machine that
has no certificate yet joins with the site's joining certificate, under a connection name and
inbox of its own (``joining_options``). Against a NATS server without TLS (the embedded dev
stack) none of this is asked for and the certificates are never sent.
"""

from __future__ import annotations

import os
import secrets
import ssl
import tempfile
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from ..core.errors import BcError, ErrorCode
from ..service.client import LazyTls
from ..wire.subjects import agent_inbox_prefix, join_connection_name, join_inbox_prefix
from .identity import Enrollment

__all__ = ["agent_options", "joining_options"]


def _context(ca: str | None, path: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    except (OSError, ssl.SSLError) as exc:
        raise BcError(
            ErrorCode.INVALID_CONFIG, f"cannot load the NATS CA file {ca}: {exc}", {"path": path}
        ) from exc


def agent_options(enrollment: Enrollment, *, ca: str | None, ca_path: str = "nats_ca") -> dict[str, Any]:
    """``connect()`` options for agent ``enrollment``: a TLS context that trusts ``ca`` (the bus
    CA's file; the system's CAs without one) and shows the agent's certificate, made when the
    server asks for TLS (``LazyTls``), and its inbox prefix. The connection raises
    ``INVALID_CONFIG`` at ``ca_path`` when the CA file cannot be loaded."""

    def make() -> ssl.SSLContext:
        tls = _context(ca, ca_path)
        key_pem = enrollment.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        # ssl loads a certificate chain from files only: a private folder, gone once loaded
        with tempfile.TemporaryDirectory(prefix="bc-agent-") as folder:
            os.chmod(folder, 0o700)
            cert_file, key_file = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            key_file.touch(mode=0o600)
            key_file.write_bytes(key_pem)
            cert_file.write_text(enrollment.certificate_pem)
            tls.load_cert_chain(cert_file, key_file)
        return tls

    return {"tls": LazyTls(make), "inbox_prefix": agent_inbox_prefix(enrollment.agent_id)}


def joining_options(
    *, cert_file: str | None, key_file: str | None, ca: str | None, path: str = "join_cert_file"
) -> dict[str, Any]:
    """``connect()`` options for a machine without a certificate: the site's joining certificate
    (``cert_file``/``key_file``, when it has them), and a connection name and inbox prefix under
    a fresh nonce, the only inbox the leaf lets it read. ``INVALID_CONFIG`` at ``path`` when the
    files cannot be loaded (when the connection meets TLS: ``LazyTls``)."""

    def make() -> ssl.SSLContext:
        tls = _context(ca, "nats_ca")
        if cert_file or key_file:
            try:
                tls.load_cert_chain(cert_file or "", key_file or "")
            except (OSError, ssl.SSLError) as exc:
                raise BcError(
                    ErrorCode.INVALID_CONFIG,
                    f"cannot load the joining certificate {cert_file} with its key {key_file}: {exc}",
                    {"path": path},
                ) from exc
        return tls

    nonce = secrets.token_hex(12)
    name, inbox = join_connection_name(nonce), join_inbox_prefix(nonce)
    return {"tls": LazyTls(make), "name": name, "inbox_prefix": inbox}
