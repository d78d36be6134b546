"""The bc-secrets service process."""

from __future__ import annotations

from typing import ClassVar

from better_compute.service import Service

__all__ = ["SecretsService"]


class SecretsService(Service):
    """Secrets: encrypted values behind SecretRefs"""

    name: ClassVar[str] = "bc-secrets"
    api_name: ClassVar[str] = "secrets"
    schema: ClassVar[str | None] = "secrets"
    migrations_package: ClassVar[str | None] = "bc_secrets.migrations"
    description: ClassVar[str] = "Secrets: encrypted values behind SecretRefs"
