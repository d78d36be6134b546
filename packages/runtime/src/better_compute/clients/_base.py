"""What every typed client shares: one ``ApiClient`` call per route, decoded into a Struct."""

from __future__ import annotations

from typing import Any, ClassVar, Final, TypeVar

from ..core.errors import BcError, ErrorCode, ServiceUnavailableError
from ..service.client import ApiClient

__all__ = ["ServiceClient", "unavailable"]

T = TypeVar("T")

_WAIT_CODES: Final = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})


def unavailable(err: BcError, service: str) -> ServiceUnavailableError | None:
    """``err`` marked as our own ``service``'s unavailability, when it is one (``UNAVAILABLE``
    or ``TIMEOUT``, see ``ServiceUnavailableError``); None for any other error."""
    if err.code in _WAIT_CODES and not isinstance(err, ServiceUnavailableError):
        return ServiceUnavailableError(err, service=service)
    return None


class ServiceClient:
    """Calls to one service over NATS; raises the service's ``BcError``s.

    Args:
        api: an ``ApiClient`` on the deployment's subject root.
        timeout: seconds to wait for each answer.
    """

    service: ClassVar[str]
    """The service token of the routes (``bc.api.<service>.…``)."""
    unavailable_as: ClassVar[str | None] = None
    """When set, ``UNAVAILABLE``/``TIMEOUT`` are raised as ``ServiceUnavailableError`` naming
    this process (``bc-pki``): a step waits for the service instead of failing."""

    def __init__(self, api: ApiClient, *, timeout: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout

    async def _call(self, route: str, payload: Any, typ: type[T]) -> T:
        try:
            return await self.api.call_as(self.service, route, payload, typ, timeout=self.timeout)
        except BcError as err:
            if self.unavailable_as is not None and (marked := unavailable(err, self.unavailable_as)):
                raise marked from err
            raise
