"""``provision_module``: what the engine can resolve.

Provision *registers* only its own steps and profiles. It *borrows* the steps and profiles of
the modules listed in ``modules`` (``metal()``, plugins), which register them themselves: list
those in ``better_compute(modules=…)`` or ``better_compute(plugins=…)`` as well. The engine
resolves a profile's ``use:`` against provision's own steps plus the borrowed ones, and nothing
else.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.plugins import CommandKind, ComputeModule, Registry, as_tuple

from .config_units import ConfigUnit, merge_config_units
from .profiles import Profile
from .steps import Step
from .templates import UserData

__all__ = ["PROVISION_MODULE_ID", "ImageVerifier", "ProvisionModule", "provision_module"]

PROVISION_MODULE_ID = "provision"


class ImageVerifier(Protocol):
    """Replaces the catalog's signature check of an image (allowlisted Ed25519 / P-256 signers).

    Returns whether ``signature`` is acceptable for ``tenant_id``'s image ``name@version`` at
    ``url`` with digest ``digest``. ``payload`` is the image's signing payload
    (``better_compute.metal.signatures.image_signing_payload``): what a signature must cover so
    it binds the name, version and URL as well as the digest.
    """

    async def __call__(
        self,
        *,
        tenant_id: str,
        digest: str,
        signature: bytes,
        name: str,
        version: str,
        url: str,
        payload: bytes,
    ) -> bool: ...


_VERIFIER_KEYWORDS: Final = ("tenant_id", "digest", "signature", "name", "version", "url", "payload")


def _takes_verifier_keywords(verifier: Any) -> bool:
    try:
        params = inspect.signature(verifier).parameters.values()
    except (TypeError, ValueError):
        return True  # a builtin or C callable: it is called and judged then
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return all(k in names for k in _VERIFIER_KEYWORDS)


@dataclass(frozen=True, kw_only=True, eq=False)
class ProvisionModule:
    """The provision module. Made by ``provision_module``."""

    id: str = field(default=PROVISION_MODULE_ID, init=False)
    command_kinds: tuple[CommandKind, ...] = field(default=(), init=False)
    steps: tuple[Step, ...]
    """Steps provision registers as its own."""
    profiles: tuple[Profile, ...]
    """Profiles provision registers as its own."""
    modules: tuple[ComputeModule, ...]
    """Modules whose steps and profiles provision borrows."""
    user_data: UserData | None
    config_units: Mapping[str, ConfigUnit]
    """Built-in units with the module's own added (same name replaces)."""
    image_verifier: ImageVerifier | None
    resolvable_steps: Mapping[str, Step]
    """Every step the engine can resolve: own and borrowed, by id."""
    resolvable_profiles: tuple[Profile, ...]
    """Every shipped profile: own and borrowed."""


def provision_module(
    *,
    modules: Sequence[ComputeModule] = (),
    steps: Sequence[Step] = (),
    profiles: Sequence[Profile] = (),
    user_data: UserData | None = None,
    config_units: Sequence[ConfigUnit] = (),
    image_verifier: ImageVerifier | None = None,
) -> ProvisionModule:
    """The provision module: steps and profiles the engine resolves, user data, config units.

    Args:
        modules: modules and plugins whose steps and profiles the engine borrows.
        steps: steps provision registers as its own.
        profiles: profiles provision registers as its own.
        user_data: URLs and templates for ``userdata.render``.
        config_units: units added to the built-ins; a built-in's name replaces it.
        image_verifier: replaces the image signature check.

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` (``steps[1].id``, ``modules[0]``).
    """
    own_steps = as_tuple(steps, "steps")
    own_profiles = as_tuple(profiles, "profiles")
    borrowed = as_tuple(modules, "modules")

    # One namespace for everything the engine resolves: own and borrowed may not clash.
    registry = Registry[Step, Profile]()
    # Shipped steps (userdata.render) resolve in every deployment; a step of yours with the
    # same id is a duplicate (INVALID_CONFIG at path shipped).
    from .userdata import SHIPPED_STEPS

    for step in SHIPPED_STEPS:
        registry.add_step(step, path="shipped")
    for index, step in enumerate(own_steps):
        registry.add_step(step, path=f"steps[{index}]")
    for index, profile in enumerate(own_profiles):
        registry.add_profile(profile, path=f"profiles[{index}]")
    for index, module in enumerate(borrowed):
        path = f"modules[{index}]"
        if isinstance(module, ProvisionModule):
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                "provision cannot borrow from a provision module",
                {"path": path},
            )
        registry.add_module(module, path=path)

    if user_data is not None and not isinstance(user_data, UserData):
        raise BcError(ErrorCode.INVALID_CONFIG, "expected UserData(...)", {"path": "user_data"})
    if image_verifier is not None and not callable(image_verifier):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "image_verifier must be an async function",
            {"path": "image_verifier"},
        )
    if image_verifier is not None and not _takes_verifier_keywords(image_verifier):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "image_verifier must take the keywords tenant_id, digest, signature, name, version, url"
            " and payload: image signatures now cover the name, version and URL too (docs/images.md)",
            {"path": "image_verifier"},
        )
    units = merge_config_units(config_units, path="config_units")

    return ProvisionModule(
        steps=own_steps,
        profiles=own_profiles,
        modules=borrowed,
        user_data=user_data,
        config_units=units,
        image_verifier=image_verifier,
        resolvable_steps=registry.steps,
        resolvable_profiles=tuple(registry.profiles.values()),
    )
