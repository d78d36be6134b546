"""The command queue's own settings: timings, and the destructive-batch quorum.

Read from the environment (the service's settings file is shared by every service):

* ``BC_CMDQ_APPROVERS``: a TOML or JSON file with ``threshold`` (M) and ``approvers``, a list of
  ``{id, publicKey}`` (base64 of the raw 32-byte Ed25519 public key). Unset: no quorum.
* ``BC_CMDQ_HEARTBEAT_MS`` (5000), ``BC_CMDQ_SILENT_AFTER_MS`` (15000),
  ``BC_CMDQ_LOST_AFTER_MS`` (120000), ``BC_CMDQ_REDELIVER_AFTER_MS`` (60000),
  ``BC_CMDQ_SWEEP_MS`` (1000), ``BC_CMDQ_CERT_CACHE_SECONDS`` (30),
  ``BC_CMDQ_STREAM_REPLICAS`` (1), ``BC_CMDQ_STREAM_MAX_AGE_SECONDS`` (7 days).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["APPROVERS_ENV", "Approver", "CmdqConfig", "Quorum", "load_quorum"]

APPROVERS_ENV: Final = "BC_CMDQ_APPROVERS"


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


@dataclass(frozen=True)
class Approver:
    id: str
    public_key: ed25519.Ed25519PublicKey = field(repr=False)
    public_key_b64: str

    def verifies(self, signature: bytes, data: bytes) -> bool:
        try:
            self.public_key.verify(signature, data)
        except Exception:  # cryptography raises InvalidSignature; a bad length, ValueError
            return False
        return True


@dataclass(frozen=True)
class Quorum:
    """M-of-N approvers. ``enabled`` is False when no approver is configured."""

    threshold: int = 0
    approvers: Mapping[str, Approver] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.approvers)


def load_quorum(path: str | Path) -> Quorum:
    """Read the approvers file (TOML, or JSON when it ends in ``.json``).

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` for anything wrong in it.
    """
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise _bad(APPROVERS_ENV, f"cannot read approvers file {where}: {exc.strerror}") from exc
    try:
        doc: Any = json.loads(raw) if where.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(APPROVERS_ENV, f"approvers file {where} does not parse: {exc}") from exc
    if not isinstance(doc, dict):
        raise _bad("approvers", "the approvers file holds an object")
    entries = doc.get("approvers")
    if not isinstance(entries, list) or not entries:
        raise _bad("approvers", "list at least one approver")
    approvers: dict[str, Approver] = {}
    keys: set[str] = set()
    for index, entry in enumerate(entries):
        at = f"approvers[{index}]"
        if not isinstance(entry, dict):
            raise _bad(at, "an approver is {id, publicKey}")
        ident = entry.get("id")
        if not isinstance(ident, str) or not 1 <= len(ident) <= 64:
            raise _bad(f"{at}.id", "an approver id is 1 to 64 characters")
        if ident in approvers:
            raise _bad(f"{at}.id", f"approver {ident!r} is listed twice")
        b64 = entry.get("publicKey")
        try:
            if not isinstance(b64, str):
                raise ValueError
            raw_key = base64.b64decode(b64, validate=True)
            public = ed25519.Ed25519PublicKey.from_public_bytes(raw_key)
        except (ValueError, binascii.Error) as exc:
            raise _bad(f"{at}.publicKey", "expected base64 of a raw 32-byte Ed25519 public key") from exc
        if b64 in keys:
            raise _bad(f"{at}.publicKey", "two approvers share one key")
        keys.add(b64)
        approvers[ident] = Approver(id=ident, public_key=public, public_key_b64=b64)
    threshold = doc.get("threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, int):
        raise _bad("threshold", "threshold (M) is a whole number")
    if not 1 <= threshold <= len(approvers):
        raise _bad("threshold", f"threshold must be between 1 and {len(approvers)}")
    return Quorum(threshold=threshold, approvers=approvers)


def _env_int(name: str, default: int, *, minimum: int = 1) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise _bad(name, f"{name} must be a whole number of at least {minimum}")
    return value


@dataclass(frozen=True, kw_only=True)
class CmdqConfig:
    """Timings and the quorum. ``from_env()`` is what the service process uses."""

    quorum: Quorum = field(default_factory=Quorum)
    heartbeat_ms: int = 5_000
    """How often agents send a heartbeat (told to them in the hello reply)."""
    silent_after_ms: int = 15_000
    """An agent not heard from for this long is shown disconnected and loses its boot lease;
    its unclaimed, non-destructive site commands go back to pending for another agent."""
    lost_after_ms: int = 120_000
    """An agent silent this long is lost: the commands it claimed and did not finish fail
    (``agent-lost``); those it never claimed wait for it until their ``not_after``."""
    redeliver_after_ms: int = 60_000
    """A dispatched command its (connected) agent has not claimed is published again."""
    sweep_ms: int = 1_000
    cert_cache_seconds: int = 30
    """Certificates used to check agent events are cached this long at most; a revocation
    event from bc-pki evicts one at once."""
    ack_wait_ms: int = 30_000
    """A delivery its agent neither acknowledged nor kept in progress this long is delivered
    again (the agent died with it, or lost it)."""
    stream_replicas: int = 1
    stream_max_age_seconds: int = 7 * 24 * 3600
    retention_days: int = 30
    """Finished commands (succeeded, failed, rejected, expired, cancelled) untouched this many
    days are deleted; 0 keeps them for ever. Batches and approvals are kept as the audit trail."""

    @classmethod
    def from_env(cls) -> CmdqConfig:
        path = os.environ.get(APPROVERS_ENV)
        return cls(
            quorum=load_quorum(path) if path else Quorum(),
            heartbeat_ms=_env_int("BC_CMDQ_HEARTBEAT_MS", 5_000, minimum=100),
            silent_after_ms=_env_int("BC_CMDQ_SILENT_AFTER_MS", 15_000, minimum=300),
            lost_after_ms=_env_int("BC_CMDQ_LOST_AFTER_MS", 120_000, minimum=300),
            redeliver_after_ms=_env_int("BC_CMDQ_REDELIVER_AFTER_MS", 60_000, minimum=100),
            sweep_ms=_env_int("BC_CMDQ_SWEEP_MS", 1_000, minimum=50),
            cert_cache_seconds=_env_int("BC_CMDQ_CERT_CACHE_SECONDS", 30, minimum=0),
            ack_wait_ms=_env_int("BC_CMDQ_ACK_WAIT_MS", 30_000, minimum=1_000),
            stream_replicas=_env_int("BC_CMDQ_STREAM_REPLICAS", 1),
            stream_max_age_seconds=_env_int("BC_CMDQ_STREAM_MAX_AGE_SECONDS", 7 * 24 * 3600),
            retention_days=_env_int("BC_CMDQ_RETENTION_DAYS", 30, minimum=0),
        )

    def with_quorum(self, quorum: Quorum) -> CmdqConfig:
        return replace(self, quorum=quorum)
