"""The refusal pki answers an unknown, spent or revoked token and a signature that does not count."""

from __future__ import annotations

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["unauthenticated"]


def unauthenticated(reason: str, message: str) -> BcError:
    return BcError(ErrorCode.UNAUTHENTICATED, message, {"reason": reason})
