"""Composition: the one object every service process loads.

>>> app = better_compute(modules=[metal(), provision_module(modules=[metal(), acme])],
...                      plugins=[acme])

Services load it with ``--app package.module:attr`` (``load_app``); the default one is
``better_compute.app.default:app``, which also loads every plugin installed under the entry-point
group ``better_compute.plugins`` (``discover=True``). Each service takes what it needs: the engine
``app.steps`` and ``app.profiles`` (what the provision module can resolve), the config units and
the plugins' image signers, the command queue ``app.command_kinds``.

A discovered plugin is registered *and* lent to the provision module, so its steps and profiles
resolve with no other line of Python: installing the package and restarting the services is all.
A provision module also takes the config units of every plugin it borrows.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any, Final, TypeVar

from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.core.plugins import (
    CommandKind,
    ComputeModule,
    DriverOperation,
    Plugin,
    Registry,
    as_tuple,
)
from better_compute.metal.signatures import ImageSigner
from better_compute.provision.config_units import BUILTIN_CONFIG_UNITS, ConfigUnit
from better_compute.provision.module import ProvisionModule, provision_module
from better_compute.provision.profiles import Profile
from better_compute.provision.steps import Step

__all__ = [
    "PLUGIN_ENTRY_POINT_GROUP",
    "App",
    "PluginSource",
    "better_compute",
    "discover_plugins",
    "load_app",
]

PLUGIN_ENTRY_POINT_GROUP: Final = "better_compute.plugins"

_SPEC_RE: Final = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


@dataclass(frozen=True, kw_only=True)
class PluginSource:
    """Where a discovered plugin came from: its entry point and the distribution that declares it."""

    entry_point: str
    """The entry point's name in ``better_compute.plugins``."""
    value: str
    """What it names (``acme_plugin:plugin``)."""
    distribution: str | None = None
    version: str | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class App:
    """A deployment's composition, frozen. Made by ``better_compute()``."""

    modules: tuple[ComputeModule, ...]
    plugins: tuple[ComputeModule, ...]
    steps: Mapping[str, Step]
    """Steps the engine resolves (the provision module's own and borrowed), by id."""
    profiles: tuple[Profile, ...]
    """Shipped profiles the engine resolves."""
    command_kinds: Mapping[str, CommandKind]
    """Every registered command kind, by name."""
    provision: ProvisionModule | None
    """The provision module, when there is one (user data, config units, image verifier)."""
    driver_operations: Mapping[str, DriverOperation] = field(default_factory=lambda: MappingProxyType({}))
    """Every registered driver operation ``<concern>.<operation>``, by name."""
    plugin_sources: Mapping[str, PluginSource] = field(default_factory=lambda: MappingProxyType({}))
    """The entry point each discovered plugin came from, by plugin id (listed ones have none)."""
    image_signers: Mapping[str, ImageSigner] = field(default_factory=lambda: MappingProxyType({}))
    """Image signers the plugins allowlist, by signer id (the engine adds ``[images] signers``)."""

    def command_kind(self, name: str, *, path: str = "kind") -> CommandKind:
        """The registered kind ``name``, or ``INVALID_CONFIG`` at ``path``."""
        kind = self.command_kinds.get(name) if isinstance(name, str) else None
        if kind is None:
            raise _bad(path, f"unknown command kind {name!r}: no module registers it")
        return kind

    def profile(self, id: str, *, version: int | None = None) -> Profile:
        """A shipped profile; the highest version when ``version`` is ``None``.

        Raises:
            BcError: ``NOT_FOUND`` at ``id`` (or ``version``).
        """
        matching = [p for p in self.profiles if p.id == id]
        if version is not None:
            matching = [p for p in matching if p.version == version]
        if not matching:
            path = "version" if version is not None and any(p.id == id for p in self.profiles) else "id"
            raise BcError(ErrorCode.NOT_FOUND, f"no shipped profile {id!r}", {"path": path})
        return max(matching, key=lambda p: p.version)


def better_compute(
    *,
    modules: Sequence[ComputeModule] = (),
    plugins: Sequence[ComputeModule] = (),
    discover: bool = False,
) -> App:
    """Compose a deployment.

    Args:
        modules: compute modules (``metal()``, ``provision_module(...)``); ids are unique,
            so there is at most one provision module.
        plugins: plugins (``define_plugin``) to register. A plugin whose steps the engine
            should resolve is also listed in ``provision_module(modules=[...])``.
        discover: also register plugins found under the entry-point group
            ``better_compute.plugins`` (an entry point that is one of ``plugins`` is skipped).

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path``: anything registered twice, a
            duplicate id, an agent step whose ``command`` (or a ``sends`` entry) no module
            registers, a borrowed module that is not registered.
    """
    module_list = as_tuple(modules, "modules")
    plugin_list = as_tuple(plugins, "plugins")
    if not isinstance(discover, bool):
        raise _bad("discover", "discover must be a boolean")

    registry = Registry[Step, Profile]()
    for index, module in enumerate(module_list):
        registry.add_module(module, path=f"modules[{index}]")
    for index, plugin in enumerate(plugin_list):
        registry.add_module(plugin, path=f"plugins[{index}]")
    discovered: list[tuple[str, ComputeModule]] = []
    sources: dict[str, PluginSource] = {}
    if discover:
        listed = module_list + plugin_list
        for source, found in _discover(PLUGIN_ENTRY_POINT_GROUP):
            if not any(found is item for item in listed):
                path = f"entry_points.{source.entry_point}"
                registry.add_module(found, path=path)
                plugin_list += (found,)
                discovered.append((path, found))
                sources[found.id] = source

    # At most one: module ids are unique and a provision module's id is always "provision".
    provision: ProvisionModule | None = None
    for index, module in enumerate(module_list):
        if isinstance(module, ProvisionModule):
            provision = _lend(module, f"modules[{index}]", discovered)
            _check_borrowed(provision, f"modules[{index}]", registry)

    _check_command_kinds(registry)
    return App(
        modules=module_list,
        plugins=plugin_list,
        steps=provision.resolvable_steps if provision else MappingProxyType({}),
        profiles=provision.resolvable_profiles if provision else (),
        command_kinds=registry.command_kinds,
        provision=provision,
        driver_operations=registry.driver_operations,
        plugin_sources=MappingProxyType(sources),
        image_signers=_image_signers(registry),
    )


T = TypeVar("T")


def _lend(
    provision: ProvisionModule, path: str, discovered: Sequence[tuple[str, ComputeModule]]
) -> ProvisionModule:
    """``provision`` borrowing the discovered plugins too, with the config units of every plugin it
    borrows; ``provision`` itself when there is nothing to add."""
    borrowed = [(join_path(path, f"modules[{i}]"), m) for i, m in enumerate(provision.modules)]
    # one the app's provision already borrows (and only lists there) is lent once
    discovered = [(p, m) for p, m in discovered if not any(m is b for b in provision.modules)]
    borrowed += discovered
    own_units = [u for n, u in provision.config_units.items() if BUILTIN_CONFIG_UNITS.get(n) is not u]
    given = {u.name: join_path(path, "config_units") for u in own_units}
    lent_units = _gathered(
        borrowed, "config_units", ConfigUnit, "name", given,
        kind="config unit", expected="a ConfigUnit (better_compute.provision.ConfigUnit)",
    )  # fmt: skip
    if not discovered and not lent_units:
        return provision
    return provision_module(
        modules=[m for _, m in borrowed],
        steps=provision.steps,
        profiles=provision.profiles,
        user_data=provision.user_data,
        config_units=[*own_units, *lent_units],
        image_verifier=provision.image_verifier,
    )


def _image_signers(registry: Registry[Step, Profile]) -> Mapping[str, ImageSigner]:
    """Every registered plugin's image signers by id; an id given twice is ``INVALID_CONFIG``."""
    sources = [(registry.path_of(m) or m.id, m) for m in registry.modules.values()]
    signers = _gathered(
        sources, "image_signers", ImageSigner, "id", {},
        kind="image signer", expected="an image signer (better_compute.metal.signatures.image_signer)",
    )  # fmt: skip
    return MappingProxyType({signer.id: signer for signer in signers})


def _gathered(
    sources: Sequence[tuple[str, Any]], attr: str, cls: type[T], key: str, given: dict[str, str], *,
    kind: str, expected: str,
) -> list[T]:  # fmt: skip
    """Each source's ``attr`` items, each an instance of ``cls`` whose ``key`` no other item (nor
    one in ``given``: key -> path) has; ``INVALID_CONFIG`` at the item's path otherwise."""
    found: list[T] = []
    for source_path, source in sources:
        items = as_tuple(getattr(source, attr, ()), join_path(source_path, attr))
        for index, item in enumerate(items):
            item_path = join_path(source_path, f"{attr}[{index}]")
            if not isinstance(item, cls):
                raise _bad(item_path, f"not {expected}")
            name = str(getattr(item, key))
            if name in given:
                raise _bad(join_path(item_path, key), f"{kind} {name!r} is already given at {given[name]}")
            given[name] = item_path
            found.append(item)
    return found


def _steps_field(module: ComputeModule) -> str:
    return "extensions" if isinstance(module, Plugin) else "steps"


def _check_borrowed(provision: ProvisionModule, path: str, registry: Registry[Step, Profile]) -> None:
    """A borrowed module must be registered, with the very steps and profiles it lends."""
    for index, module in enumerate(provision.modules):
        module_path = join_path(path, f"modules[{index}]")
        if module.id not in registry.modules:
            raise _bad(
                module_path,
                f"provision borrows {module.id!r}, which is not registered: "
                "list it in better_compute(modules=[...]) or (plugins=[...]) too",
            )
        for step_index, step in enumerate(module.steps):
            if registry.steps.get(step.id) is not step:
                raise _bad(
                    join_path(module_path, f"{_steps_field(module)}[{step_index}]"),
                    f"step {step.id!r} is not the one registered under that id",
                )
        for profile_index, profile in enumerate(module.profiles):
            if registry.profiles.get(profile.key) is not profile:
                raise _bad(
                    join_path(module_path, f"profiles[{profile_index}]"),
                    f"profile {profile.id!r} v{profile.version} is not the one registered",
                )


def _check_command_kinds(registry: Registry[Step, Profile]) -> None:
    """Every kind a step sends must be registered, or the command queue would refuse it."""
    kinds = registry.command_kinds
    for step in registry.steps.values():
        path = registry.path_of(step) or step.id
        if step.command is not None and step.command not in kinds:
            raise _bad(
                join_path(path, "command"),
                f"step {step.id!r} sends {step.command!r}, which no module registers",
            )
        for index, kind in enumerate(step.sends):
            if kind not in kinds:
                raise _bad(
                    join_path(path, f"sends[{index}]"),
                    f"step {step.id!r} declares {kind!r}, which no module registers",
                )


def _entry_points(group: str) -> Sequence[Any]:
    return tuple(metadata.entry_points(group=group))


def _is_module(obj: object) -> bool:
    return isinstance(getattr(obj, "id", None), str) and all(
        hasattr(obj, name) for name in ("command_kinds", "steps", "profiles")
    )


def discover_plugins(*, group: str = PLUGIN_ENTRY_POINT_GROUP) -> Mapping[str, ComputeModule]:
    """Plugins installed under the entry-point ``group``, by entry-point name.

    An entry point names a plugin (or module) object, or a function returning one.

    Raises:
        BcError: ``INVALID_CONFIG`` at ``entry_points.<name>`` for one that fails to load.
    """
    return MappingProxyType({source.entry_point: found for source, found in _discover(group)})


def _source(entry_point: Any) -> PluginSource:
    dist = getattr(entry_point, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    version = getattr(dist, "version", None) if dist is not None else None
    return PluginSource(
        entry_point=str(entry_point.name),
        value=str(getattr(entry_point, "value", "")),
        distribution=name if isinstance(name, str) else None,
        version=version if isinstance(version, str) else None,
    )


def _discover(group: str) -> list[tuple[PluginSource, ComputeModule]]:
    found: list[tuple[PluginSource, ComputeModule]] = []
    names: set[str] = set()
    for entry_point in _entry_points(group):
        path = f"entry_points.{entry_point.name}"
        if entry_point.name in names:  # two distributions declare one name: which would win is luck
            raise _bad(path, f"two installed packages declare the entry point {entry_point.name!r}")
        names.add(entry_point.name)
        try:
            obj = entry_point.load()
            if not _is_module(obj) and callable(obj):
                obj = obj()
        except BcError as exc:
            if exc.code is ErrorCode.INVALID_CONFIG:
                raise exc.with_path_prefix(path) from exc
            raise _bad(path, f"plugin entry point failed to load: {exc}") from exc
        except Exception as exc:
            raise _bad(path, f"plugin entry point failed to load: {exc!r}") from exc
        if not _is_module(obj):
            raise _bad(path, "the entry point is not a plugin (define_plugin) or module")
        found.append((_source(entry_point), obj))
    return found


def load_app(spec: str) -> App:
    """Load the app named by ``package.module:attr`` (an ``App`` or a function returning one).

    Raises:
        BcError: ``INVALID_CONFIG`` at ``app`` for a malformed spec, a module that cannot be
            imported, a missing attribute, or something that is not an app. A ``BcError``
            raised while building the app keeps its own path.
    """
    if not isinstance(spec, str) or _SPEC_RE.fullmatch(spec) is None:
        raise _bad("app", f"expected package.module:attr, got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except BcError:
        raise
    except Exception as exc:
        raise _bad("app", f"cannot import {module_name!r}: {exc!r}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _bad("app", f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, App) and inspect.isfunction(obj):
        try:
            obj = obj()
        except BcError:
            raise
        except Exception as exc:
            raise _bad("app", f"{spec!r} failed: {exc!r}") from exc
    if not isinstance(obj, App):
        raise _bad("app", f"{spec!r} is a {type(obj).__name__}, not an App (better_compute(...))")
    return obj
