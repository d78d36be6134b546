"""Process settings: ``bc.toml``, then ``BC_*`` environment variables, then flags.

One loader for every service. A setting's TOML key is its dotted path (``[cmdq] heartbeat``) and
its environment variable is that path in capitals behind ``BC_`` (``BC_CMDQ_HEARTBEAT``). Durations
use the manifest grammar of :func:`better_compute.core.manifest.parse_duration` (``"500ms"``,
``"30s"``, ``"5m"``, ``"2h"``, ``"7d"``). Anything wrong is ``INVALID_CONFIG`` with ``details.path``
(``cmdq.sweep``). docs/settings.md lists every setting.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, get_origin

import msgspec

from .core.errors import BcError, ErrorCode
from .core.manifest import parse_duration
from .wire.codec import validation_path

__all__ = [
    "DEFAULT_APP",
    "DEFAULT_RAMDISK_DIR",
    "ApproverSetting",
    "CmdqSettings",
    "Duration",
    "EngineSettings",
    "EventsSettings",
    "ImageSignerSetting",
    "ImagesSettings",
    "PkiSettings",
    "QuorumSettings",
    "RamdiskSettings",
    "SecretsSettings",
    "Settings",
    "SettingsSource",
    "UserDataSettings",
    "env_var",
    "load_settings",
    "parse_settings",
    "setting_paths",
    "settings_changes",
]

DEFAULT_APP = "better_compute.app.default:app"
DEFAULT_RAMDISK_DIR: Final = ".state/ramdisk"
ENV_PREFIX: Final = "BC_"


class Duration:
    """A length of time, written ``"30s"`` in ``bc.toml`` and in the environment."""

    __slots__ = ("ms",)

    ms: int

    def __init__(self, ms: int) -> None:
        object.__setattr__(self, "ms", ms)

    @classmethod
    def parse(cls, text: object) -> Duration:
        """``"5m"`` (any unit of the manifest grammar) as a Duration; ValueError otherwise."""
        try:
            return cls(parse_duration(text))
        except BcError as exc:
            raise ValueError(exc.message) from None

    @property
    def seconds(self) -> float:
        return self.ms / 1000

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Duration is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Duration) and other.ms == self.ms

    def __hash__(self) -> int:
        return hash(self.ms)

    def __repr__(self) -> str:
        return f"Duration({self.ms}ms)"

    def __str__(self) -> str:
        for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
            if self.ms and self.ms % size == 0:
                return f"{self.ms // size}{unit}"
        return f"{self.ms}ms"


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings are written by people: an unknown key is a typo, refused with its path."""


class ApproverSetting(_Section, frozen=True, kw_only=True, rename={"public_key": "publicKey"}):
    """One quorum approver: ``{id, publicKey}`` (base64 of the raw 32-byte Ed25519 public key)."""

    id: str
    public_key: str


class QuorumSettings(_Section, frozen=True, kw_only=True):
    """M-of-N approvers of destructive batches, inline or in ``file`` (same keys, TOML or JSON).

    No approvers and no file: no quorum.
    """

    file: str | None = None
    threshold: int = 0
    approvers: list[ApproverSetting] = msgspec.field(default_factory=list)


class CmdqSettings(_Section, frozen=True, kw_only=True):
    """``[cmdq]``: the command queue's timings, streams and quorum."""

    heartbeat: Duration = Duration(5_000)
    idle_heartbeat: Duration = Duration(30_000)
    """A machine's agent (``bcd``) with nothing to do heartbeats this often, and every
    ``heartbeat`` from the moment it has work; its silence is counted from the gap it announced
    (docs/command-queue.md "Presence and boot leases"). Site agents keep ``heartbeat``. At most
    ``heartbeat`` turns it off."""
    silent_after: Duration = Duration(15_000)
    lost_after: Duration = Duration(120_000)
    redeliver_after: Duration = Duration(60_000)
    sweep: Duration = Duration(1_000)
    ack_wait: Duration = Duration(30_000)
    cert_cache: Duration = Duration(30_000)
    stream_replicas: int = 1
    stream_max_age: Duration = Duration(7 * 86_400_000)
    stream_max_consumers: int = 100_000
    """Consumers a site's stream holds: one per agent of the site (each machine's ``bcd``, its
    site agents). At least 1; nats-server 2.15 reads none (or -1) as 1000."""
    consumer_inactive: Duration = Duration(86_400_000)
    """An agent's consumer nobody pulled from for this long is deleted by nats-server (a retired
    node's, a replaced identity's); the agent's commands stay in the stream, and its next hello
    makes the consumer again, which delivers them. ``0s`` keeps consumers for ever; else at
    least ``1s``."""
    agent_event_wait: Duration = Duration(4_000)
    """An agent event (not a heartbeat nor a progress) that has not reached the store this long
    after it arrived is answered busy and not applied: its agent has stopped waiting (its request
    timeout is 5 s) and asks again. ``0s``: never shed for waiting."""
    agent_events_max: int = 2_048
    """Agent events in hand past which a new one (not a heartbeat nor a progress) is answered
    busy at once, before its signature is checked. ``0``: no bound."""
    site_domain: str = ""
    """Where each site's streams live. ``""``: in the services' own JetStream (the hub's; one
    nats-server is enough). A template naming the JetStream domain of the site's leaf node,
    ``"{site}"`` for a domain named after the site (deploy/nats): the site's command stream and
    a stream of its results live on its leaf, reached as ``$JS.<domain>.API``, so a site cut
    off from the hub keeps its commands and its results (docs/command-queue.md)."""
    retention: Duration = Duration(30 * 86_400_000)
    quorum: QuorumSettings = msgspec.field(default_factory=QuorumSettings)
    engine_key_file: str | None = None
    """A stack without NATS accounts: the key file (``bck1`` lines) with which the engine proves
    to the command queue that a command naming a workflow is its own; both read it, the first
    to start creates it. ``bcx dev up`` sets it. Unset, only nats-server's word counts (a
    request through an import is not the engine's)."""


class PkiSettings(_Section, frozen=True, kw_only=True):
    """``[pki]``: the CA's key file and certificate lifetime."""

    key_file: str | None = None
    cert_ttl: Duration = Duration(30 * 86_400_000)


class SecretsSettings(_Section, frozen=True, kw_only=True):
    """``[secrets]``: the key file that seals stored secrets."""

    key_file: str | None = None


class UserDataSettings(_Section, frozen=True, kw_only=True):
    """``[userdata]``: what ``userdata.render`` puts in a node's user data (the engine reads it).

    A value set here (or in ``BC_USERDATA_*``) wins over the app's ``UserData(...)``; templates
    stay in Python.
    """

    control_plane_url: str | None = None
    bcd_url: str | None = None
    bcd_sha256: str | None = None


class ImageSignerSetting(_Section, frozen=True, kw_only=True, rename={"public_key": "publicKey"}):
    """One allowlisted image signer: ``{id, publicKey}`` (Ed25519 or ECDSA P-256; PEM, base64
    of the DER key, or base64 of the raw 32-byte Ed25519 key). The engine checks the key."""

    id: str
    public_key: str


class ImagesSettings(_Section, frozen=True, kw_only=True):
    """``[images]``: the signers whose signatures the image catalog accepts (the engine reads it).

    Every engine writes this list to the catalog at start, so give them all the same one; a
    signer removed here stops its images from resolving. An app's ``image_verifier`` replaces it.
    """

    signers: list[ImageSignerSetting] = msgspec.field(default_factory=list)


class RamdiskSettings(_Section, frozen=True, kw_only=True):
    """``[ramdisk]``: the bcd ramdisk the shipped lifecycle profiles network-boot
    (``metal.ensureRamdisk``), and where ``bcx ramdisk build`` writes it (docs/real-machines.md).

    ``kernel`` (with ``initrd``) or ``script`` set here is what ``metal()`` gives its profiles
    when the app names no ``Ramdisk(...)``; with the sha256s the site agent serves them from its
    cache. ``bcx dev up`` fills them from the ramdisk built in ``dir`` when none is set.
    """

    dir: str = DEFAULT_RAMDISK_DIR
    kernel: str | None = None
    initrd: str | None = None
    kernel_sha256: str | None = None
    initrd_sha256: str | None = None
    cmdline: str | None = None
    script: str | None = None


class EngineSettings(_Section, frozen=True, kw_only=True):
    """``[engine]``: bc-engine's own settings.

    ``site_admission``: how many workflows on the nodes of one site run their steps at once; the
    rest wait, in the order they were started, with no step started (so no step's deadline runs
    while they wait: a bulk verb over 10,000 machines does not time out the ones whose commands
    would queue behind the site's other machines). ``0``: no limit. docs/engine.md, "Admission".
    """

    site_admission: int = 100


class EventsSettings(_Section, frozen=True, kw_only=True):
    """``[events]``: the durable event feed, JetStream stream ``BC_EVENTS`` on ``bc.events.>``
    (docs/events.md); bc-command-queue creates it and applies these bounds at start."""

    max_age: Duration = Duration(7 * 86_400_000)
    max_bytes: int = 1 << 30
    replicas: int = 1


class Settings(_Section, frozen=True, kw_only=True):
    """Where a process finds the bus, the store and the app, and each service's own section.

    ``nats_url`` / ``database_url`` unset means: the embedded servers recorded in
    ``state_dir`` (``bcx dev up`` writes them there).
    """

    nats_url: str | None = None
    nats_creds: str | None = None
    nats_ca: str | None = None
    """The CA file (PEM) to verify NATS servers with, over TLS (deploy/nats: ``bcx bus ca``)."""
    database_url: str | None = None
    subject_root: str = "bc"
    app: str = DEFAULT_APP
    state_dir: str = ".state/dev"
    log_level: str = "info"
    health_port: int = 0
    instance: str | None = None
    cmdq: CmdqSettings = msgspec.field(default_factory=CmdqSettings)
    pki: PkiSettings = msgspec.field(default_factory=PkiSettings)
    secrets: SecretsSettings = msgspec.field(default_factory=SecretsSettings)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    userdata: UserDataSettings = msgspec.field(default_factory=UserDataSettings)
    images: ImagesSettings = msgspec.field(default_factory=ImagesSettings)
    events: EventsSettings = msgspec.field(default_factory=EventsSettings)
    ramdisk: RamdiskSettings = msgspec.field(default_factory=RamdiskSettings)


# Lower bounds, checked after decoding; a value below one is INVALID_CONFIG at its path.
_MINIMUM_MS: Final = {
    "cmdq.heartbeat": 100,
    "cmdq.idle_heartbeat": 100,
    "cmdq.silent_after": 300,
    "cmdq.lost_after": 300,
    "cmdq.redeliver_after": 100,
    "cmdq.sweep": 50,
    "cmdq.ack_wait": 1_000,
    "cmdq.stream_max_age": 1_000,
    "pki.cert_ttl": 1_000,
    "events.max_age": 1_000,
}


# Durations where 0s means "never" and anything else has a floor.
_ZERO_OR_AT_LEAST_MS: Final = {
    "cmdq.agent_event_wait": (100, "never shed"),
    "cmdq.consumer_inactive": (1_000, "never"),
}


_MAX_CONSUMERS: Final = 2**31 - 1
"""The most ``cmdq.stream_max_consumers`` may say (nats-server keeps it in a Go int)."""


# Settings the services keep in coarser units: a value must be a whole number of them.
_UNIT_MS: Final = {
    "cmdq.cert_cache": 1_000,
    "cmdq.stream_max_age": 1_000,
    "cmdq.retention": 86_400_000,
    "pki.cert_ttl": 1_000,
    "events.max_age": 1_000,
}


# Shapes checked after decoding (the same ones ``UserData(...)`` checks), at their path.
_PATTERNS: Final = {
    "userdata.control_plane_url": (
        re.compile(r"(https?|nats|tls)://[^\s{}]+"),
        "an http(s), nats:// or tls:// URL",
    ),
    "userdata.bcd_url": (re.compile(r"https?://[^\s{}]+"), "an http(s) URL"),
    "userdata.bcd_sha256": (re.compile(r"[0-9a-f]{64}"), "64 lowercase hex digits"),
    "ramdisk.kernel": (re.compile(r"https?://[^\s{}]+"), "an http(s) URL"),
    "ramdisk.initrd": (re.compile(r"https?://[^\s{}]+"), "an http(s) URL"),
    "ramdisk.kernel_sha256": (re.compile(r"[0-9a-f]{64}"), "64 lowercase hex digits"),
    "ramdisk.initrd_sha256": (re.compile(r"[0-9a-f]{64}"), "64 lowercase hex digits"),
}


def env_var(path: str) -> str:
    """The environment variable of a setting: ``cmdq.sweep`` is ``BC_CMDQ_SWEEP``."""
    return ENV_PREFIX + path.replace(".", "_").upper()


def _scalar_fields(typ: type[msgspec.Struct], prefix: str = "") -> Iterator[str]:
    for f in msgspec.structs.fields(typ):
        path = f"{prefix}{f.name}"
        if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
            yield from _scalar_fields(f.type, f"{path}.")
        elif get_origin(f.type) is not list:  # a list has no variable: bc.toml or a quorum file
            yield path


def setting_paths() -> list[str]:
    """Every setting an environment variable can set, as a dotted path (``cmdq.sweep``)."""
    return list(_scalar_fields(Settings))


def _dec_hook(typ: type, value: object) -> object:
    if typ is Duration:
        return Duration.parse(value)
    raise NotImplementedError


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise _bad(str(path), f"cannot read config file: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise _bad(str(path), f"config file is not TOML: {exc}") from exc


def _set(data: dict[str, Any], path: str, value: str) -> None:
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[leaf] = value


def _get(settings: Settings, path: str) -> Any:
    value: Any = settings
    for key in path.split("."):
        value = getattr(value, key)
    return value


def _check_bounds(settings: Settings) -> None:
    for path, minimum in _MINIMUM_MS.items():
        if (value := _get(settings, path)).ms < minimum:
            raise _bad(path, f"{path} must be at least {Duration(minimum)}, got {value}")
    for path, unit in _UNIT_MS.items():
        if (value := _get(settings, path)).ms % unit:
            raise _bad(path, f"{path} must be a whole number of {Duration(unit)}, got {value}")
    for path, (pattern, what) in _PATTERNS.items():
        value = _get(settings, path)
        if value is not None and (len(value) > 4096 or pattern.fullmatch(value) is None):
            raise _bad(path, f"{path} must be {what}")
    if settings.cmdq.stream_replicas < 1:
        raise _bad("cmdq.stream_replicas", "cmdq.stream_replicas must be at least 1")
    if settings.engine.site_admission < 0:
        raise _bad("engine.site_admission", "engine.site_admission must be 0 (no limit) or more")
    if not 1 <= settings.cmdq.stream_max_consumers <= _MAX_CONSUMERS:
        raise _bad(
            "cmdq.stream_max_consumers",
            f"cmdq.stream_max_consumers must be between 1 and {_MAX_CONSUMERS}"
            f" (nats-server reads none, or -1, as 1000), got {settings.cmdq.stream_max_consumers}",
        )
    if settings.cmdq.agent_events_max < 0:
        raise _bad("cmdq.agent_events_max", "cmdq.agent_events_max must be 0 (no bound) or more")
    for path, (minimum, zero) in _ZERO_OR_AT_LEAST_MS.items():
        if 0 < (value := _get(settings, path)).ms < minimum:
            raise _bad(path, f"{path} must be 0s ({zero}) or at least {Duration(minimum)}, got {value}")
    if settings.events.replicas < 1:
        raise _bad("events.replicas", "events.replicas must be at least 1")
    if settings.events.max_bytes < 1 << 20:
        raise _bad("events.max_bytes", "events.max_bytes must be at least 1048576 (1 MiB)")


def parse_settings(data: dict[str, Any]) -> Settings:
    """Settings from a ``bc.toml``-shaped mapping (values may be strings, as from the environment).

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` (``cmdq.sweep``) for a bad value or key.
    """
    try:
        settings = msgspec.convert(data, Settings, strict=False, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise _bad(validation_path(exc), f"bad setting: {exc}") from exc
    _check_bounds(settings)
    return settings


def load_settings(
    config_file: str | Path | None = None, *, defaults: dict[str, Any] | None = None, **overrides: Any
) -> Settings:
    """Settings from ``defaults`` (top-level settings under everything else: bcx's current
    context), ``config_file`` (or ``$BC_CONFIG``, or ``./bc.toml`` when present), the environment,
    and ``overrides`` (top-level settings); ``None`` values are ignored."""
    return SettingsSource(config_file, defaults=defaults, **overrides).read()


class SettingsSource:
    """Where a process's settings come from (``load_settings``' arguments), so that they can be
    read again: ``file`` is the config file in use (None without one), ``changed()`` whether it
    changed since the last ``read()`` (its inode, size or modification time)."""

    def __init__(
        self,
        config_file: str | Path | None = None,
        *,
        defaults: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        path = config_file or os.environ.get("BC_CONFIG")
        if path is None and Path("bc.toml").is_file():
            path = "bc.toml"
        self.file = Path(path) if path is not None else None
        self._defaults = {k: v for k, v in (defaults or {}).items() if v is not None}
        self._overrides = {k: v for k, v in overrides.items() if v is not None}
        self._seen: tuple[int, ...] | None = None

    def _stat(self) -> tuple[int, ...] | None:
        if self.file is None:
            return None
        try:
            st = os.stat(self.file)
        except OSError:
            return (-1,)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def changed(self) -> bool:
        """Whether the file changed (or went) since the last ``read()``."""
        return self.file is not None and (self._seen is None or self._stat() != self._seen)

    def forget(self) -> None:
        """Count the file as changed, so that the next look reads it again (what was read could
        not be applied)."""
        self._seen = None

    def read(self) -> Settings:
        """The settings now: the file, the environment, the overrides.

        Raises:
            BcError: ``INVALID_CONFIG`` with ``details.path`` (``cmdq.sweep``; the file's path when
                it cannot be read or is not TOML).
        """
        self._seen = self._stat()  # before the read: a change while reading is seen next time
        data = dict(self._defaults)
        if self.file is not None:
            data.update(_read_toml(self.file))
        for setting in setting_paths():
            value = os.environ.get(env_var(setting))
            if value:
                _set(data, setting, value)
        data.update(self._overrides)
        return parse_settings(data)


def settings_changes(old: msgspec.Struct, new: msgspec.Struct, prefix: str = "") -> list[str]:
    """The dotted paths of the settings that differ between ``old`` and ``new`` (a list, such as
    ``cmdq.quorum.approvers``, is one setting)."""
    changes: list[str] = []
    for f in msgspec.structs.fields(type(old)):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if isinstance(before, msgspec.Struct) and isinstance(after, msgspec.Struct):
            changes += settings_changes(before, after, f"{prefix}{f.name}.")
        elif before != after:
            changes.append(f"{prefix}{f.name}")
    return changes
