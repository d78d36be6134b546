"""The bc-pki service process."""

from __future__ import annotations

from typing import ClassVar

from better_compute.service import Service

__all__ = ["PkiService"]


class PkiService(Service):
    """PKI: certificate authority, join tokens, joins, signature verification"""

    name: ClassVar[str] = "bc-pki"
    api_name: ClassVar[str] = "pki"
    schema: ClassVar[str | None] = "pki"
    migrations_package: ClassVar[str | None] = "bc_pki.migrations"
    description: ClassVar[str] = (
        "PKI: certificate authority, join tokens, joins, signature verification"
    )
