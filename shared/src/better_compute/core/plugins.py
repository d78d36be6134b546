"""Plugins, compute modules, command kinds, and the registry that refuses duplicates.

A *compute module* (``metal()``, ``provision_module()``, a plugin) contributes command kinds,
steps and profiles. The ``Registry`` takes each module's own contributions once: the same
object registered twice, two steps with one id, two command kinds with one name, two profiles
with one id and version, or two modules/plugins with one id is ``INVALID_CONFIG`` with
``details.path`` naming the second registration (``plugins[0].extensions[1].id``).

Core sits below ``provision``, so it names no step or profile class: a step is anything with
``extension == "step"`` and an ``id`` (``StepDefinition``), a profile anything with
``extension == "profile"``, an ``id`` and a ``version`` (``ProfileDefinition``). ``define_step``
and ``define_profile`` make them; the registry is generic over the concrete classes so
``provision`` and the app get their own types back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Generic, Literal, Protocol, TypeVar

from .errors import BcError, ErrorCode, join_path
from .manifest import Manifest

__all__ = [
    "DOTTED_NAME_PATTERN",
    "PLUGIN_ID_PATTERN",
    "CommandKind",
    "ComputeModule",
    "DriverOperation",
    "Plugin",
    "ProfileDefinition",
    "Registry",
    "StepDefinition",
    "define_plugin",
]

# Step ids, command kinds and driver operations: lowercase dotted segments, each segment may be
# camelCase as the shipped names are (`site.httpProxy`, `autoinstall.renderIso`).
DOTTED_NAME_PATTERN: Final = r"^[a-z][a-zA-Z0-9]*(\.[a-z][a-zA-Z0-9]*)+$"
_DOTTED_NAME_RE: Final = re.compile(DOTTED_NAME_PATTERN)
_MAX_NAME_LENGTH: Final = 128

# Plugin ids are kebab-case: `acme-autoinstall`.
PLUGIN_ID_PATTERN: Final = r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$"
_PLUGIN_ID_RE: Final = re.compile(PLUGIN_ID_PATTERN)


def _bad_config(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


def is_dotted_name(value: object) -> bool:
    """Whether ``value`` is a step id / command kind such as ``power.setPower``."""
    return (
        isinstance(value, str)
        and len(value) <= _MAX_NAME_LENGTH
        and _DOTTED_NAME_RE.fullmatch(value) is not None
    )


def as_tuple(value: object, path: str) -> tuple[Any, ...]:
    """``value`` as a tuple when it is a list or tuple, else ``INVALID_CONFIG`` at ``path``."""
    # A string is a sequence too; `relays="site"` must not become ("s", "i", "t", "e").
    if not isinstance(value, (list, tuple)):
        raise _bad_config(path, f"expected a list, got {type(value).__name__}")
    return tuple(value)


@dataclass(frozen=True, kw_only=True, eq=False)
class CommandKind:
    """A command an agent runs, as the command queue registers it.

    Args:
        name: dotted name such as ``power.setPower``.
        destructive: whether the command can destroy data or state that cannot be rebuilt;
            destructive commands need a signed batch when the quorum is on.
        payload: the manifest the command's JSON payload must fit.
        description: one line for people.
        boot: whether the command decides what a machine boots, and how: ``"medium"`` gives it
            something new to boot (a virtual medium, a network-boot entry: an installer is one),
            ``"control"`` starts or steers a boot (power, the boot device, ejecting a medium,
            removing a boot entry). Neither destroys anything on its own; in a workflow of a
            profile that writes disks (``writesDisk: true``) they lead to a disk being written,
            so they go inside that workflow's batch (docs/command-queue.md). A profile whose
            own steps send a ``"medium"`` kind must say whether it writes disks.
        idempotent: whether running the command twice leaves the machine as running it once
            (a boot-device PATCH, power on, an eject): ``True``, or a predicate over the
            validated payload (``power.setPower`` is for ``on``/``off``, not ``cycle``). An
            idempotent command whose agent died while running it runs again when the agent
            comes back, instead of failing ``interrupted``. A destructive kind never does.
    """

    name: str
    destructive: bool
    payload: Manifest
    description: str = ""
    boot: Literal["medium", "control"] | None = None
    idempotent: bool | Callable[[Any], bool] = False

    def reruns(self, payload: Any) -> bool:
        """Whether a command of this kind with ``payload`` may run again after an interruption."""
        if self.destructive:
            return False
        if callable(self.idempotent):
            try:
                return bool(self.idempotent(payload))
            except Exception:  # a predicate that cannot judge the payload: not idempotent
                return False
        return self.idempotent is True

    def __post_init__(self) -> None:
        if not is_dotted_name(self.name):
            raise _bad_config(
                "name", f"command kinds are dotted names like power.setPower, got {self.name!r}"
            )
        if not isinstance(self.destructive, bool):
            raise _bad_config("destructive", "must be a boolean")
        if not isinstance(self.payload, Manifest):
            raise _bad_config("payload", "must be a manifest")
        if not isinstance(self.description, str):
            raise _bad_config("description", "must be a string")
        if self.boot not in (None, "medium", "control"):
            raise _bad_config("boot", "must be None, 'medium' or 'control'")
        if not (isinstance(self.idempotent, bool) or callable(self.idempotent)):
            raise _bad_config("idempotent", "must be a boolean or a predicate over the payload")


@dataclass(frozen=True, kw_only=True, eq=False)
class DriverOperation:
    """An operation a site agent's driver runs, ``<concern>.<operation>``.

    A profile step ``{use: 'power.setPower', on: 'site', with: {...}}`` that names no registered
    step resolves to one: ``with`` is validated against ``input`` when the profile is validated,
    created or started, and the step is sent as one ``driver.invoke`` command.

    Args:
        name: ``<concern>.<operation>`` such as ``power.setPower``.
        input: the manifest the step's ``with`` must fit.
        description: one line for people.
    """

    name: str
    input: Manifest
    description: str = ""

    def __post_init__(self) -> None:
        if not is_dotted_name(self.name) or self.name.count(".") != 1:
            raise _bad_config(
                "name", f"driver operations are <concern>.<operation> like power.setPower, got {self.name!r}"
            )
        if not isinstance(self.input, Manifest):
            raise _bad_config("input", "must be a manifest")
        if not isinstance(self.description, str):
            raise _bad_config("description", "must be a string")


class StepDefinition(Protocol):
    """What core needs of a step: ``better_compute.provision.define_step`` makes them."""

    @property
    def extension(self) -> Literal["step"]: ...

    @property
    def id(self) -> str: ...


class ProfileDefinition(Protocol):
    """What core needs of a profile: ``better_compute.provision.define_profile`` makes them."""

    @property
    def extension(self) -> Literal["profile"]: ...

    @property
    def id(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def key(self) -> tuple[str, int]: ...


StepT = TypeVar("StepT", bound=StepDefinition)
ProfileT = TypeVar("ProfileT", bound=ProfileDefinition)


class ComputeModule(Protocol):
    """What a module or plugin contributes: command kinds, steps and profiles it registers."""

    @property
    def id(self) -> str: ...

    @property
    def command_kinds(self) -> Sequence[CommandKind]: ...

    @property
    def steps(self) -> Sequence[StepDefinition]: ...

    @property
    def profiles(self) -> Sequence[ProfileDefinition]: ...


@dataclass(frozen=True, kw_only=True, eq=False)
class Plugin:
    """A bundle of extensions shipped outside the project's packages. Made by ``define_plugin``."""

    id: str
    extensions: tuple[StepDefinition, ...]
    profiles: tuple[ProfileDefinition, ...]
    command_kinds: tuple[CommandKind, ...]
    description: str = ""
    driver_operations: tuple[DriverOperation, ...] = ()
    config_units: tuple[Any, ...] = ()
    """Config units (``better_compute.provision.ConfigUnit``) the plugin adds to the host section."""
    image_signers: tuple[Any, ...] = ()
    """Image signers (``better_compute.metal.signatures.image_signer``) the plugin allowlists."""

    @property
    def steps(self) -> tuple[StepDefinition, ...]:
        """The plugin's steps (every extension is a step today)."""
        return self.extensions


def define_plugin(
    *,
    id: str,
    extensions: Sequence[StepDefinition] = (),
    profiles: Sequence[ProfileDefinition] = (),
    command_kinds: Sequence[CommandKind] = (),
    driver_operations: Sequence[DriverOperation] = (),
    config_units: Sequence[Any] = (),
    image_signers: Sequence[Any] = (),
    description: str = "",
) -> Plugin:
    """A frozen plugin.

    Args:
        id: kebab-case id, unique among modules and plugins (``acme-autoinstall``).
        extensions: the plugin's steps.
        profiles: the plugin's profiles.
        command_kinds: command kinds the plugin's agents implement.
        driver_operations: ``<concern>.<operation>`` operations its site-agent drivers run
            (``DriverOperation``); names are unique across modules and plugins, and profile
            steps that use one are validated against its input like steps.
        config_units: host-configuration units (``ConfigUnit``) the engine adds to the
            built-ins when provision borrows the plugin; unit names are unique (a plugin's unit
            named like a built-in replaces it).
        image_signers: signers (``image_signer(id, public_key)``) the engine allowlists next to
            ``[images] signers``; signer ids are unique.
        description: one line for people.

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` (``extensions[1].id``).
    """
    if not isinstance(id, str) or _PLUGIN_ID_RE.fullmatch(id) is None:
        raise _bad_config("id", f"plugin ids are kebab-case like acme-autoinstall, got {id!r}")
    if not isinstance(description, str):
        raise _bad_config("description", "must be a string")
    plugin = Plugin(
        id=id,
        extensions=as_tuple(extensions, "extensions"),
        profiles=as_tuple(profiles, "profiles"),
        command_kinds=as_tuple(command_kinds, "command_kinds"),
        description=description,
        driver_operations=as_tuple(driver_operations, "driver_operations"),
        config_units=as_tuple(config_units, "config_units"),
        image_signers=as_tuple(image_signers, "image_signers"),
    )
    # Core sits below provision and metal: the units' and signers' classes are checked by the
    # app that composes the plugin; here only their shape and duplicates.
    _check_named(plugin.config_units, "config_units", "name", "unit")
    _check_named(plugin.image_signers, "image_signers", "id", "signer")
    # The same checks the app makes, so a broken plugin fails where it is defined.
    Registry[StepDefinition, ProfileDefinition]().add_module(plugin, path="")
    return plugin


def _check_named(items: tuple[Any, ...], path: str, key: str, what: str) -> None:
    seen: set[str] = set()
    for index, item in enumerate(items):
        name = getattr(item, key, None)
        if not isinstance(name, str):
            raise _bad_config(f"{path}[{index}]", f"not a {what} (it needs a string {key})")
        if name in seen:
            raise _bad_config(f"{path}[{index}].{key}", f"{what} {name!r} is given twice")
        seen.add(name)


class Registry(Generic[StepT, ProfileT]):
    """Collects modules' contributions, refusing anything registered twice.

    Every ``add_*`` takes the ``path`` the object was reached by, used in refusals.
    ``Registry[Step, Profile]()`` keeps ``provision``'s classes in ``steps`` and ``profiles``.
    """

    def __init__(self) -> None:
        # id() -> (object, path); the object is kept so its id cannot be reused.
        self._seen: dict[int, tuple[object, str]] = {}
        self._modules: dict[str, ComputeModule] = {}
        self._steps: dict[str, StepT] = {}
        self._profiles: dict[tuple[str, int], ProfileT] = {}
        self._kinds: dict[str, CommandKind] = {}
        self._operations: dict[str, DriverOperation] = {}

    @property
    def modules(self) -> Mapping[str, ComputeModule]:
        """Registered modules and plugins by id."""
        return MappingProxyType(self._modules)

    @property
    def steps(self) -> Mapping[str, StepT]:
        """Registered steps by id."""
        return MappingProxyType(self._steps)

    @property
    def profiles(self) -> Mapping[tuple[str, int], ProfileT]:
        """Registered profiles by ``(id, version)``."""
        return MappingProxyType(self._profiles)

    @property
    def command_kinds(self) -> Mapping[str, CommandKind]:
        """Registered command kinds by name."""
        return MappingProxyType(self._kinds)

    @property
    def driver_operations(self) -> Mapping[str, DriverOperation]:
        """Registered driver operations by ``<concern>.<operation>``."""
        return MappingProxyType(self._operations)

    def path_of(self, obj: object) -> str | None:
        """The path ``obj`` was registered at, or ``None``."""
        seen = self._seen.get(id(obj))
        return seen[1] if seen is not None and seen[0] is obj else None

    def add_module(self, module: ComputeModule, *, path: str) -> None:
        """Register a module or plugin and everything it contributes."""
        module_id = getattr(module, "id", None)
        if not isinstance(module_id, str) or not module_id:
            raise _bad_config(path, "not a compute module (it needs a string id)")
        self._once(module, path)
        if module_id in self._modules:
            first = self._where(self._modules[module_id])
            raise _bad_config(
                join_path(path, "id"),
                f"module or plugin {module_id!r} is already registered at {first}",
            )
        self._modules[module_id] = module
        steps_name = "extensions" if isinstance(module, Plugin) else "steps"
        parts = (
            ("command_kinds", self.add_command_kind),
            (steps_name, self.add_step),
            ("profiles", self.add_profile),
        )
        for name, add in parts:
            items = as_tuple(getattr(module, name, None), join_path(path, name))
            for index, item in enumerate(items):
                add(item, path=join_path(path, f"{name}[{index}]"))
        # Optional: only modules whose agents run driver operations have them (metal).
        operations = as_tuple(getattr(module, "driver_operations", ()), join_path(path, "driver_operations"))
        for index, operation in enumerate(operations):
            self.add_driver_operation(operation, path=join_path(path, f"driver_operations[{index}]"))

    def add_command_kind(self, kind: CommandKind, *, path: str) -> None:
        """Register a command kind; names are unique."""
        if not isinstance(kind, CommandKind):
            raise _bad_config(path, "not a CommandKind")
        self._once(kind, path)
        if kind.name in self._kinds:
            first = self._where(self._kinds[kind.name])
            raise _bad_config(
                join_path(path, "name"),
                f"command kind {kind.name!r} is already registered at {first}",
            )
        self._kinds[kind.name] = kind

    def add_driver_operation(self, operation: DriverOperation, *, path: str) -> None:
        """Register a driver operation; names are unique."""
        if not isinstance(operation, DriverOperation):
            raise _bad_config(path, "not a DriverOperation")
        self._once(operation, path)
        if operation.name in self._operations:
            first = self._where(self._operations[operation.name])
            raise _bad_config(
                join_path(path, "name"),
                f"driver operation {operation.name!r} is already registered at {first}",
            )
        self._operations[operation.name] = operation

    def add_step(self, step: StepT, *, path: str) -> None:
        """Register a step; step ids share one namespace."""
        if getattr(step, "extension", None) != "step":
            raise _bad_config(path, "not a step (make one with define_step)")
        self._once(step, path)
        if step.id in self._steps:
            first = self._where(self._steps[step.id])
            raise _bad_config(
                join_path(path, "id"),
                f"step id {step.id!r} is already registered at {first}; prefix yours (acme.)",
            )
        self._steps[step.id] = step

    def add_profile(self, profile: ProfileT, *, path: str) -> None:
        """Register a profile; ``(id, version)`` pairs are unique."""
        if getattr(profile, "extension", None) != "profile":
            raise _bad_config(path, "not a profile (make one with define_profile)")
        self._once(profile, path)
        key = (profile.id, profile.version)
        if key in self._profiles:
            first = self._where(self._profiles[key])
            raise _bad_config(
                join_path(path, "version"),
                f"profile {profile.id!r} v{profile.version} is already registered at {first}",
            )
        self._profiles[key] = profile

    def _once(self, obj: object, path: str) -> None:
        seen = self._seen.get(id(obj))
        if seen is not None:
            raise _bad_config(path, f"registered twice: already registered at {seen[1] or 'top level'}")
        self._seen[id(obj)] = (obj, path)

    def _where(self, obj: object) -> str:
        return self.path_of(obj) or "top level"
