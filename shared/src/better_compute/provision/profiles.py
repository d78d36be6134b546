"""Profiles: versioned documents listing the steps of a workflow.

The engine stores profiles as camelCase JSON documents and re-checks them on ``profiles.create``
with ``profile_from_document``; code defines them with ``define_profile``. Both return the same
deeply frozen ``Profile``, and ``Profile.to_document()`` gives the document back.

Document fields::

    id           "ubuntu-24.04-autoinstall"   required
    version      1, 2, …                      required, positive int
    target       "metal" | "instance"         required, see TARGET_FIELDS
    role         "host"                       required
    description  str
    adopt        bool                         take over a running machine: no image,
                                              userData or steps
    writesDisk   bool                         what its workflow boots writes a disk (an
                                              installer, a wipe, an image write): its boot
                                              commands then run inside its destructive batch
    image        "name@version"               catalog reference
    userData     {kind, template?, tokenTtlSeconds?}
    hostConfig   {units: [{name, settings?, when?}]}
    steps        [{use, on?, with?, timeout?, retry?, fallback?: {use, on?, with?, timeout?}}]

``timeout`` on a profile step overrides the step's own deadline, and gives one to a driver
operation (``use: bmc.reset, on: site``), which has no step definition to take it from.
``retry`` (``{attempts, backoff, maxBackoff?, on?}``, ``provision.retry``) replaces the step's
own default retry policy.
Every refusal is ``INVALID_CONFIG`` with ``details.path`` (``steps[2].with``, ``userData.kind``)
and, in ``details.problems``, every problem of the document found in the same pass.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Final, Literal, TypeVar

from better_compute.core._json import freeze_json, thaw_json
from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.core.manifest import parse_duration
from better_compute.core.plugins import is_dotted_name

from ._names import (
    IMAGE_REF_PATTERN,
    PROFILE_ID_PATTERN,
    ROLE_PATTERN,
    TEMPLATE_NAME_PATTERN,
    UNIT_NAME_PATTERN,
    USER_DATA_KIND_PATTERN,
    matches,
)
from .labels import parse_label_expression
from .retry import RetryPolicy, parse_retry
from .steps import PLACES, Place

__all__ = [
    "MAX_PROFILE_STEPS",
    "TARGETS",
    "TARGET_FIELDS",
    "HostConfig",
    "HostUnit",
    "Profile",
    "ProfileStep",
    "ProfileUserData",
    "Target",
    "define_profile",
    "profile_from_document",
]

Target = Literal["metal", "instance"]

# Which optional sections each target may have. hostConfig is applied by bcd's host converger,
# which runs on machines Better Compute installed, so it is metal-only.
TARGET_FIELDS: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {
        "metal": frozenset({"image", "userData", "hostConfig"}),
        "instance": frozenset({"image", "userData"}),
    }
)
TARGETS: Final = tuple(TARGET_FIELDS)

MAX_PROFILE_STEPS: Final = 512
MAX_TOKEN_TTL_SECONDS: Final = 7 * 24 * 3600
_MAX_DESCRIPTION: Final = 1024
_MAX_VERSION: Final = 2**31 - 1
"""Versions are stored as a PostgreSQL ``int``."""

_FIELDS: Final = (
    "id", "version", "target", "role", "description", "adopt", "writesDisk",
    "image", "userData", "hostConfig", "steps",
)  # fmt: skip
_STEP_FIELDS: Final = ("use", "on", "with", "timeout", "retry", "fallback")
_FALLBACK_FIELDS: Final = ("use", "on", "with", "timeout")
_USER_DATA_FIELDS: Final = ("kind", "template", "tokenTtlSeconds")
_UNIT_FIELDS: Final = ("name", "settings", "when")
_SNAKE_HINTS: Final = {"user_data": "userData", "host_config": "hostConfig", "writes_disk": "writesDisk"}


_T = TypeVar("_T")


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


@dataclass(frozen=True, kw_only=True)
class ProfileStep:
    """One ``{use, on?, with?, timeout?, retry?, fallback?}`` entry of a profile, frozen."""

    use: str
    on: Place | None
    with_: Mapping[str, Any]
    timeout: str | None
    fallback: ProfileStep | None
    retry: RetryPolicy | None = None

    @property
    def timeout_ms(self) -> int | None:
        """The ``timeout`` override in milliseconds, if any."""
        return None if self.timeout is None else parse_duration(self.timeout)

    def to_document(self) -> dict[str, Any]:
        """The step as a camelCase JSON document."""
        doc: dict[str, Any] = {"use": self.use}
        if self.on is not None:
            doc["on"] = self.on
        if self.with_:
            doc["with"] = thaw_json(self.with_)
        if self.timeout is not None:
            doc["timeout"] = self.timeout
        if self.retry is not None:
            doc["retry"] = self.retry.to_document()
        if self.fallback is not None:
            doc["fallback"] = self.fallback.to_document()
        return doc


@dataclass(frozen=True, kw_only=True)
class ProfileUserData:
    """``userData``: which kind of document to render, from which template."""

    kind: str
    template: str | None
    token_ttl_seconds: int | None

    def to_document(self) -> dict[str, Any]:
        """The section as a camelCase JSON document."""
        doc: dict[str, Any] = {"kind": self.kind}
        if self.template is not None:
            doc["template"] = self.template
        if self.token_ttl_seconds is not None:
            doc["tokenTtlSeconds"] = self.token_ttl_seconds
        return doc


@dataclass(frozen=True, kw_only=True)
class HostUnit:
    """One config unit of ``hostConfig``; settings are checked when the host section resolves."""

    name: str
    settings: Mapping[str, Any]
    when: str | None

    def to_document(self) -> dict[str, Any]:
        """The unit as a camelCase JSON document."""
        doc: dict[str, Any] = {"name": self.name}
        if self.settings:
            doc["settings"] = thaw_json(self.settings)
        if self.when is not None:
            doc["when"] = self.when
        return doc


@dataclass(frozen=True, kw_only=True)
class HostConfig:
    """``hostConfig``: units that become the node's host section when the workflow succeeds."""

    units: tuple[HostUnit, ...]

    def to_document(self) -> dict[str, Any]:
        """The section as a camelCase JSON document."""
        return {"units": [unit.to_document() for unit in self.units]}


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A profile, deeply frozen. Made by ``define_profile`` or ``profile_from_document``."""

    extension: ClassVar[Literal["profile"]] = "profile"

    id: str
    version: int
    target: Target
    role: str
    description: str
    adopt: bool
    image: str | None
    user_data: ProfileUserData | None
    host_config: HostConfig | None
    steps: tuple[ProfileStep, ...]
    writes_disk: bool | None = None
    """Whether what its workflows boot writes a disk: ``True`` puts every boot command of them
    (power, boot device, media, boot entries) in the workflow's destructive batch, with the
    wipes and image writes; ``False`` says what it boots writes nothing (a diagnostics medium);
    ``None``: not said, which the engine refuses for a profile whose own steps insert a medium
    or set a boot entry (it may boot an installer)."""

    @property
    def key(self) -> tuple[str, int]:
        """``(id, version)``, unique among shipped profiles."""
        return (self.id, self.version)

    def to_document(self) -> dict[str, Any]:
        """The profile as a fresh camelCase JSON document; ``profile_from_document`` reads it."""
        doc: dict[str, Any] = {
            "id": self.id,
            "version": self.version,
            "target": self.target,
            "role": self.role,
        }
        if self.description:
            doc["description"] = self.description
        if self.adopt:
            doc["adopt"] = True
        if self.writes_disk is not None:
            doc["writesDisk"] = self.writes_disk
        if self.image is not None:
            doc["image"] = self.image
        if self.user_data is not None:
            doc["userData"] = self.user_data.to_document()
        if self.host_config is not None:
            doc["hostConfig"] = self.host_config.to_document()
        doc["steps"] = [step.to_document() for step in self.steps]
        return doc


def define_profile(
    *,
    id: str,
    version: int,
    target: Target,
    role: str,
    steps: Sequence[Mapping[str, Any] | ProfileStep] = (),
    user_data: Mapping[str, Any] | None = None,
    host_config: Mapping[str, Any] | None = None,
    image: str | None = None,
    adopt: bool = False,
    description: str = "",
    writes_disk: bool | None = None,
) -> Profile:
    """Check a profile and return it deeply frozen.

    Sections (``steps`` entries, ``user_data``, ``host_config``) are written as their camelCase
    documents: ``{"use": "media.insert", "on": "site", "with": {"fromStep": "…"}}``,
    ``{"kind": "cloud-init", "tokenTtlSeconds": 3600}``. Error paths use document names.

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` (``steps[2].with``, ``userData.kind``).
    """
    doc: dict[str, Any] = {
        "id": id,
        "version": version,
        "target": target,
        "role": role,
        "description": description,
        "adopt": adopt,
        "writesDisk": writes_disk,
        "image": image,
        "userData": user_data,
        "hostConfig": host_config,
    }
    if isinstance(steps, (list, tuple)):
        doc["steps"] = [s.to_document() if isinstance(s, ProfileStep) else s for s in steps]
    else:
        doc["steps"] = steps
    return profile_from_document(doc)


def profile_from_document(document: Mapping[str, Any]) -> Profile:
    """Read a camelCase profile document (as stored by ``profiles.create``).

    A key whose value is ``null`` counts as absent. Every problem is found in one pass: an
    unknown key names the close ones (``wiht``: did you mean with?).

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` naming the first bad field and
            ``details.problems`` every one (``{path, code, message}``, in document order).
    """
    problems: list[BcError] = []
    doc = _object(document, "", _FIELDS, problems) or {}
    profile_id: Any = doc.get("id")
    if not matches(PROFILE_ID_PATTERN, profile_id):
        problems.append(
            _bad("id", f"profile ids are lowercase like ubuntu-24.04-autoinstall, got {profile_id!r}")
        )
    version: Any = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= _MAX_VERSION:
        problems.append(
            _bad("version", f"version must be an integer from 1 to {_MAX_VERSION}, got {version!r}")
        )
    target: Any = doc.get("target")
    # A list is unhashable: look it up only when it is a string.
    if target not in (TARGETS if isinstance(target, str) else ()):
        problems.append(_bad("target", f"target must be one of {', '.join(TARGETS)}, got {target!r}"))
        target = None
    role: Any = doc.get("role")
    if not matches(ROLE_PATTERN, role):
        problems.append(_bad("role", f"role must be a lowercase word like host, got {role!r}"))
    description = doc.get("description", "")
    if not isinstance(description, str) or len(description) > _MAX_DESCRIPTION:
        problems.append(_bad("description", f"description must be a string of at most {_MAX_DESCRIPTION}"))
    adopt = doc.get("adopt", False)
    if not isinstance(adopt, bool):
        problems.append(_bad("adopt", "adopt must be a boolean"))
    writes_disk = doc.get("writesDisk")
    if writes_disk is not None and not isinstance(writes_disk, bool):
        problems.append(_bad("writesDisk", "writesDisk must be a boolean"))

    for name in ("image", "userData", "hostConfig"):
        if target is not None and name in doc and name not in TARGET_FIELDS[target]:
            problems.append(_bad(name, f"{name} is not a field of {target} profiles"))
    for name, what in (("image", "an image"), ("userData", "user data")):
        if adopt is True and name in doc:
            problems.append(_bad(name, f"an adopt profile takes over a running machine and has no {what}"))

    image = doc.get("image")
    if image is not None and not matches(IMAGE_REF_PATTERN, image):
        problems.append(_bad("image", f"image must be a catalog reference name@version, got {image!r}"))
    user_data = _user_data(doc["userData"], problems) if "userData" in doc else None
    host_config = _host_config(doc["hostConfig"], problems) if "hostConfig" in doc else None

    raw_steps = _list(doc.get("steps", []), "steps", problems)
    if adopt is True and raw_steps:
        problems.append(_bad("steps", "an adopt profile takes over a running machine and has no steps"))
    steps: list[ProfileStep | None] = []
    if len(raw_steps) > MAX_PROFILE_STEPS:
        problems.append(_bad("steps", f"a profile holds at most {MAX_PROFILE_STEPS} steps"))
    else:
        steps = [_step(raw, f"steps[{i}]", _STEP_FIELDS, problems) for i, raw in enumerate(raw_steps)]

    if problems:
        first = problems[0]
        raise BcError(
            first.code, first.message, {**first.details, "problems": [_problem(p) for p in problems]}
        )
    return Profile(
        id=profile_id,
        version=version,
        target=target,
        role=role,
        description=description,
        adopt=adopt,
        image=image,
        user_data=user_data,
        host_config=host_config,
        steps=tuple(s for s in steps if s is not None),
        writes_disk=writes_disk,
    )


def _problem(err: BcError) -> dict[str, Any]:
    """One entry of ``details.problems``."""
    return {"path": err.path or "", "code": err.code.value, "message": err.message}


def as_list(value: object, path: str) -> list[Any]:
    """``value`` as a list when it is a JSON array, else ``INVALID_CONFIG`` at ``path``."""
    if not isinstance(value, (list, tuple)):
        raise _bad(path, f"expected a list, got {type(value).__name__}")
    return list(value)


def _list(value: object, path: str, problems: list[BcError]) -> list[Any]:
    """``as_list``, its problem noted: an empty list then."""
    try:
        return as_list(value, path)
    except BcError as err:
        problems.append(err)
        return []


def _unknown_key(key: str, allowed: tuple[str, ...]) -> str:
    """``unknown field`` and the names it may have meant (``wiht``: with; ``user_data``: userData)."""
    if key in _SNAKE_HINTS:
        return f"unknown field; did you mean {_SNAKE_HINTS[key]}?"
    close = difflib.get_close_matches(key, allowed, n=2, cutoff=0.6)
    if close:
        return "unknown field; did you mean " + " or ".join(close) + "?"
    return f"unknown field; the fields here are {', '.join(allowed)}"


def _object(
    value: object, path: str, allowed: tuple[str, ...], problems: list[BcError]
) -> dict[str, Any] | None:
    """The non-null entries of a JSON object whose keys are in ``allowed`` (each other key is
    a problem noted, and left out); None when ``value`` is no object."""
    if not isinstance(value, Mapping):
        problems.append(_bad(path, f"expected an object, got {type(value).__name__}"))
        return None
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            problems.append(_bad(path, f"object keys must be strings, got {type(key).__name__}"))
        elif key not in allowed:
            problems.append(_bad(join_path(path, key), _unknown_key(key, allowed)))
        elif item is not None:
            out[key] = item
    return out


def _noted(problems: list[BcError], check: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
    """``check(*args, **kwargs)``, or None with its ``BcError`` noted."""
    try:
        return check(*args, **kwargs)
    except BcError as err:
        problems.append(err)
        return None


def _step(value: object, path: str, allowed: tuple[str, ...], problems: list[BcError]) -> ProfileStep | None:
    """The step at ``path``; None when it has problems (each one noted)."""
    before = len(problems)
    raw = _object(value, path, allowed, problems)
    if raw is None:
        return None
    use: Any = raw.get("use")
    if not is_dotted_name(use):
        problems.append(_bad(join_path(path, "use"), f"use names a step or driver operation, got {use!r}"))
    on = raw.get("on")
    if on is not None and on not in PLACES:
        problems.append(_bad(join_path(path, "on"), f"on must be one of {', '.join(PLACES)}, got {on!r}"))
    with_path = join_path(path, "with")
    with_ = raw.get("with", {})
    frozen_with: Any = None
    if not isinstance(with_, Mapping):
        problems.append(_bad(with_path, f"with must be an object, got {type(with_).__name__}"))
    else:
        frozen_with = _noted(problems, freeze_json, with_, path=with_path, code=ErrorCode.INVALID_CONFIG)
    timeout = raw.get("timeout")
    if timeout is not None:
        timeout_path = join_path(path, "timeout")
        ms = _noted(problems, parse_duration, timeout, path=timeout_path, code=ErrorCode.INVALID_CONFIG)
        if ms is not None and ms <= 0:
            problems.append(_bad(timeout_path, "timeout must be longer than zero"))
    retry = None
    if "retry" in raw:
        retry = _noted(problems, parse_retry, raw["retry"], join_path(path, "retry"))
    fallback = None
    if "fallback" in raw:
        fallback = _step(raw["fallback"], join_path(path, "fallback"), _FALLBACK_FIELDS, problems)
    if len(problems) > before:
        return None
    return ProfileStep(use=use, on=on, with_=frozen_with, timeout=timeout, fallback=fallback, retry=retry)


def _user_data(value: object, problems: list[BcError]) -> ProfileUserData | None:
    before = len(problems)
    raw = _object(value, "userData", _USER_DATA_FIELDS, problems)
    if raw is None:
        return None
    kind: Any = raw.get("kind")
    if not matches(USER_DATA_KIND_PATTERN, kind):
        problems.append(_bad("userData.kind", f"kind is a lowercase name like cloud-init, got {kind!r}"))
    template = raw.get("template")
    if template is not None and not matches(TEMPLATE_NAME_PATTERN, template):
        problems.append(
            _bad("userData.template", f"template names a template like acme.yaml, got {template!r}")
        )
    ttl = raw.get("tokenTtlSeconds")
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 < ttl <= MAX_TOKEN_TTL_SECONDS
    ):
        problems.append(
            _bad(
                "userData.tokenTtlSeconds",
                f"tokenTtlSeconds must be a whole number from 1 to {MAX_TOKEN_TTL_SECONDS}",
            )
        )
    if len(problems) > before:
        return None
    return ProfileUserData(kind=kind, template=template, token_ttl_seconds=ttl)


def _host_config(value: object, problems: list[BcError]) -> HostConfig | None:
    before = len(problems)
    raw = _object(value, "hostConfig", ("units",), problems)
    if raw is None:
        return None
    units: list[HostUnit] = []
    for i, item in enumerate(_list(raw.get("units", []), "hostConfig.units", problems)):
        path = f"hostConfig.units[{i}]"
        unit = _object(item, path, _UNIT_FIELDS, problems)
        if unit is None:
            continue
        name: Any = unit.get("name")
        if not matches(UNIT_NAME_PATTERN, name):
            problems.append(
                _bad(join_path(path, "name"), f"unit names are kebab-case like sysctl, got {name!r}")
            )
        settings = unit.get("settings", {})
        frozen: Any = None
        if not isinstance(settings, Mapping):
            problems.append(_bad(join_path(path, "settings"), "settings must be an object"))
        else:
            frozen = _noted(
                problems,
                freeze_json,
                settings,
                path=join_path(path, "settings"),
                code=ErrorCode.INVALID_CONFIG,
            )
        when = unit.get("when")
        if when is not None:
            _noted(
                problems,
                parse_label_expression,
                when,
                path=join_path(path, "when"),
                code=ErrorCode.INVALID_CONFIG,
            )
        units.append(HostUnit(name=name, settings=frozen, when=when))
    if len(problems) > before:
        return None
    return HostConfig(units=tuple(units))
