"""The command queue's own settings, resolved: timings in milliseconds and the quorum's keys.

They come from the ``[cmdq]`` section of the process settings (``better_compute.config``;
docs/settings.md lists them): ``CmdqConfig.from_settings(settings.cmdq)``.
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

import msgspec
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.config import ApproverSetting, CmdqSettings, QuorumSettings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.keyring import Keyring
from better_compute.wire.codec import validation_path

from .delivery import INACTIVE_SECONDS, MAX_CONSUMERS

__all__ = [
    "Approver",
    "CmdqConfig",
    "Quorum",
    "QuorumSource",
    "check_site_domain",
    "load_quorum",
    "quorum_from_settings",
]

_AT: Final = "cmdq.quorum"


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


_DOMAIN_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def check_site_domain(template: str) -> str:
    """``cmdq.site_domain``: ``""``, or a JetStream domain name in which ``{site}`` stands for
    the site id (letters, digits, ``-`` and ``_`` otherwise); ``INVALID_CONFIG`` else."""
    if not template:
        return ""
    rest = template.replace("{site}", "")
    if "{site}" not in template or not set(rest) <= _DOMAIN_CHARS:
        raise _bad(
            "cmdq.site_domain",
            "a JetStream domain template: '{site}' (the site's id), with letters, digits, - and _"
            " around it, or empty for the services' own JetStream",
        )
    return template


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


class QuorumSource:
    """The quorum in force, and the approvers file it came from (``[cmdq.quorum] file``,
    ``BC_CMDQ_QUORUM_FILE``), read again when the file changes: ``reload`` (the sweeper's duty,
    every ``sweep_ms``) compares the file's inode, size and modification time with the last
    read. An inline ``[cmdq.quorum]`` has no file and never changes."""

    def __init__(self, quorum: Quorum, path: str | Path | None = None) -> None:
        self.quorum = quorum
        self.path = Path(path) if path is not None else None
        self._seen: tuple[int, ...] | None = self._stat()

    def _stat(self) -> tuple[int, ...] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return (-1,)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def reload(self) -> bool:
        """Read the file again when it changed since the last read; True when the quorum did.

        Raises:
            BcError: ``INVALID_CONFIG`` (with ``details.path``) once per change of the file when
                it cannot be read or is wrong; the quorum in force stays.
        """
        seen = self._stat()
        if self.path is None or seen == self._seen:
            return False
        self._seen = seen
        quorum = load_quorum(self.path)
        if _shape(quorum) == _shape(self.quorum):
            return False
        self.quorum = quorum
        return True

    def adopt(self, other: QuorumSource) -> bool:
        """Take ``other``'s quorum and file (``[cmdq.quorum]`` changed in the config file); True
        when the quorum changed."""
        changed = _shape(other.quorum) != _shape(self.quorum)
        self.quorum, self.path, self._seen = other.quorum, other.path, other._seen
        return changed


def _shape(quorum: Quorum) -> tuple[int, dict[str, str]]:
    return quorum.threshold, {a.id: a.public_key_b64 for a in quorum.approvers.values()}


def quorum_from_settings(settings: QuorumSettings) -> QuorumSource:
    """The quorum of ``[cmdq.quorum]``: its inline approvers, or those of its ``file``.

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` (``cmdq.quorum.threshold``) for anything
            wrong in it.
    """
    if settings.file is not None:
        if settings.approvers or settings.threshold:
            raise _bad(f"{_AT}.file", "give the approvers inline or in a file, not both")
        return QuorumSource(load_quorum(settings.file), settings.file)
    if not settings.approvers and not settings.threshold:
        return QuorumSource(Quorum())
    return QuorumSource(_quorum(settings.threshold, settings.approvers))


def load_quorum(path: str | Path) -> Quorum:
    """Read an approvers file (TOML, or JSON when it ends in ``.json``): ``threshold`` and
    ``approvers``, as in ``[cmdq.quorum]``.

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` for anything wrong in it.
    """
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise _bad(f"{_AT}.file", f"cannot read approvers file {where}: {exc.strerror}") from exc
    try:
        doc: Any = json.loads(raw) if where.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"{_AT}.file", f"approvers file {where} does not parse: {exc}") from exc
    if not isinstance(doc, dict):
        raise _bad(_AT, "the approvers file holds an object")
    try:
        parsed = msgspec.convert(
            {"threshold": doc.get("threshold", 0), "approvers": doc.get("approvers", [])}, QuorumSettings
        )
    except msgspec.ValidationError as exc:
        raise _bad(f"{_AT}.{validation_path(exc)}", f"approvers file {where}: {exc}") from exc
    return _quorum(parsed.threshold, parsed.approvers)


def _quorum(threshold: int, entries: list[ApproverSetting]) -> Quorum:
    if not entries:
        raise _bad(f"{_AT}.approvers", "list at least one approver")
    approvers: dict[str, Approver] = {}
    keys: set[str] = set()
    for index, entry in enumerate(entries):
        at = f"{_AT}.approvers[{index}]"
        ident = entry.id
        if not 1 <= len(ident) <= 64:
            raise _bad(f"{at}.id", "an approver id is 1 to 64 characters")
        if ident in approvers:
            raise _bad(f"{at}.id", f"approver {ident!r} is listed twice")
        b64 = entry.public_key
        try:
            raw_key = base64.b64decode(b64, validate=True)
            public = ed25519.Ed25519PublicKey.from_public_bytes(raw_key)
        except (ValueError, binascii.Error) as exc:
            raise _bad(f"{at}.publicKey", "expected base64 of a raw 32-byte Ed25519 public key") from exc
        if b64 in keys:
            raise _bad(f"{at}.publicKey", "two approvers share one key")
        keys.add(b64)
        approvers[ident] = Approver(id=ident, public_key=public, public_key_b64=b64)
    if not 1 <= threshold <= len(approvers):
        raise _bad(f"{_AT}.threshold", f"threshold must be between 1 and {len(approvers)}")
    return Quorum(threshold=threshold, approvers=approvers)


@dataclass(frozen=True, kw_only=True)
class CmdqConfig:
    """Timings and the quorum. ``from_settings()`` is what the service process uses."""

    quorum_source: QuorumSource = field(default_factory=lambda: QuorumSource(Quorum()))
    """The quorum in force (``quorum``), read again when its approvers file changes."""
    heartbeat_ms: int = 5_000
    """How often agents send a heartbeat (told to them in the hello reply)."""
    idle_heartbeat_ms: int = 30_000
    """How often a machine's agent with nothing to do sends one (told in the hello reply; a
    site agent keeps ``heartbeat_ms``). Each heartbeat says the gap until the next, and an
    agent's silence counts from that gap (``silence_gap_ms``)."""
    silent_after_ms: int = 15_000
    """An agent not heard from for this long is shown disconnected and loses its boot lease;
    its unclaimed, non-destructive site commands go back to pending for another agent."""
    lost_after_ms: int = 120_000
    """An agent silent this long is lost: the commands it claimed and did not finish fail
    (``agent-lost``); those it never claimed wait for it until their ``not_after``."""
    presence_write_ms: int = 1_000
    """Node agents' heartbeats are answered from memory and written together this often
    (``presence.py``); far below ``silent_after_ms``."""
    agent_event_slots: int = 6
    """Agent events (hello's statements, ack, progress, result, check) working on the store at
    once; the others wait their turn in memory, so a storm of them (a thousand machines saying
    hello after an outage) never takes every connection of the pool (10) from the API's
    requests. Heartbeats take none: a machine's is answered from memory, a site agent's must
    never wait behind a storm (late by ``silent_after``, its site's commands would go back)."""
    agent_event_wait_ms: int = 4_000
    """An agent event (not a heartbeat nor a progress) that has not reached the store this long
    after it arrived is answered ``UNAVAILABLE`` (``busy``) and not applied: its agent stops
    waiting for the answer after its request timeout (5 s) and asks again, so the store's time
    goes to events someone still waits for (``agents.py``). A second short of that timeout: the
    statement and the answer's way back fit in it. 0: never shed for waiting
    (``cmdq.agent_event_wait``)."""
    agent_events_max: int = 2_048
    """Agent events in hand (received, not answered) past which a new one (not a heartbeat nor a
    progress) is answered busy at once, before its signature is checked. 0: no bound
    (``cmdq.agent_events_max``)."""
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
    stream_max_consumers: int = MAX_CONSUMERS
    """Consumers a site's stream holds (``cmdq.stream_max_consumers``): one per agent."""
    consumer_inactive_ms: int = int(INACTIVE_SECONDS * 1000)
    """An agent's consumer nobody pulled from this long is deleted by nats-server
    (``cmdq.consumer_inactive``; 0: never). Its commands stay in the stream; its next hello
    makes it again."""
    site_domain: str = ""
    """``cmdq.site_domain``: ``""`` keeps every site's stream in the services' JetStream;
    a template with ``{site}`` names the JetStream domain of each site's leaf node, which then
    holds the site's command stream and its results stream (``site_domain_of``)."""
    retention_days: int = 30
    """Finished commands (succeeded, failed, rejected, expired, cancelled) untouched this many
    days are deleted; 0 keeps them for ever. Batches and approvals are kept as the audit trail."""
    engine_key: Keyring | None = None
    """``cmdq.engine_key_file``'s keys: a command naming a workflow must carry the engine's
    proof made with one (a stack without NATS accounts). None: nats-server's word only."""

    @classmethod
    def from_settings(cls, settings: CmdqSettings) -> CmdqConfig:
        """The ``[cmdq]`` section of the process settings, with its quorum loaded."""
        return cls(
            quorum_source=quorum_from_settings(settings.quorum),
            heartbeat_ms=settings.heartbeat.ms,
            idle_heartbeat_ms=settings.idle_heartbeat.ms,
            silent_after_ms=settings.silent_after.ms,
            lost_after_ms=settings.lost_after.ms,
            redeliver_after_ms=settings.redeliver_after.ms,
            sweep_ms=settings.sweep.ms,
            cert_cache_seconds=settings.cert_cache.ms // 1000,
            ack_wait_ms=settings.ack_wait.ms,
            stream_replicas=settings.stream_replicas,
            stream_max_age_seconds=settings.stream_max_age.ms // 1000,
            stream_max_consumers=settings.stream_max_consumers,
            consumer_inactive_ms=settings.consumer_inactive.ms,
            agent_event_wait_ms=settings.agent_event_wait.ms,
            agent_events_max=settings.agent_events_max,
            site_domain=check_site_domain(settings.site_domain),
            retention_days=settings.retention.ms // 86_400_000,
            engine_key=(
                Keyring.load_or_create(Path(settings.engine_key_file))[0]
                if settings.engine_key_file
                else None
            ),
        )

    def silence_gap_ms(self, announced: int, *, role: str) -> int:
        """What the silence rules keep of the gap an agent announced until its next heartbeat
        (``agents.beat_gap_ms``): 0 for the usual cadence or less, for an agent that did not say
        (an older one) and for a site agent (it holds its site's boot lease and takes its
        commands: it keeps ``heartbeat_ms``); else the gap, at most ``idle_heartbeat_ms``."""
        if role == "site" or announced <= self.heartbeat_ms:
            return 0
        return min(announced, max(self.idle_heartbeat_ms, self.heartbeat_ms))

    @property
    def quorum(self) -> Quorum:
        """The quorum in force now (an approvers file's latest valid content)."""
        return self.quorum_source.quorum

    def with_quorum(self, quorum: Quorum) -> CmdqConfig:
        return replace(self, quorum_source=QuorumSource(quorum))
