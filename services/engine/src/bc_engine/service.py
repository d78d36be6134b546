"""The bc-engine service process."""

from __future__ import annotations

from typing import ClassVar

from better_compute.service import Service

__all__ = ["EngineService"]


class EngineService(Service):
    """Provision engine: profiles, workflows, the reconciler, step execution"""

    name: ClassVar[str] = "bc-engine"
    api_name: ClassVar[str] = "engine"
    schema: ClassVar[str | None] = "engine"
    migrations_package: ClassVar[str | None] = "bc_engine.migrations"
    description: ClassVar[str] = (
        "Provision engine: profiles, workflows, the reconciler, step execution"
    )
