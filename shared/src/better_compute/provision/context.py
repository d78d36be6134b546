"""The seams a control-plane step sees: ``StepContext`` and the services behind it.

These are protocols; the engine provides the implementations. Only what a step author calls is
declared here, so tests can pass small fakes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, Literal, Protocol, TypeVar

from better_compute.core.keys import attempt_key

T = TypeVar("T")

__all__ = [
    "AgentCertificate",
    "JoinRole",
    "JoinToken",
    "Log",
    "Pki",
    "Secrets",
    "Sql",
    "StepContext",
    "StepCoordinates",
    "StepNode",
    "Workflows",
    "step_command_key",
]

JoinRole = Literal["node", "site", "provisioned", "discovery"]


class Sql(Protocol):
    """The engine's database, for a step's own tables (``plg_<plugin>_…``)."""

    async def query(self, sql: str, *args: Any) -> Sequence[Mapping[str, Any]]:
        """Run one statement with ``$n`` parameters and return its rows."""
        ...

    def transaction(self) -> AbstractAsyncContextManager[Sql]:
        """``async with ctx.sql.transaction() as tx:``; commits on success, rolls back on error."""
        ...


class JoinToken(Protocol):
    """A freshly minted join token; ``token`` is the secret, ``id`` is safe to store."""

    @property
    def id(self) -> str: ...

    @property
    def token(self) -> str: ...


class AgentCertificate(Protocol):
    """A certificate an agent got when it joined."""

    @property
    def cert_id(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def created_at(self) -> datetime:
        """When the agent joined (the certificate was issued)."""
        ...


class Pki(Protocol):
    """The certificate authority, as a step sees it."""

    async def issue_join_token(
        self,
        *,
        tenant_id: str,
        role: JoinRole,
        site_id: str | None = None,
        ttl_seconds: int,
        max_uses: int = 1,
        expect: Mapping[str, str] | None = None,
        held: bool = False,
    ) -> JoinToken:
        """Mint a join token; ``expect`` holds hardware claims (``mac``, ``productUuid``, …);
        ``held``: it goes on the boot network, and a join with it is ``pending`` until the site
        agent that served it confirms its boot entry closed clean."""
        ...

    async def certificates(self, *, agent_id: str) -> Sequence[AgentCertificate]:
        """The agent's valid certificates, newest first; a node's agent id is the node id."""
        ...


class Secrets(Protocol):
    """Encrypted values behind ``SecretRef``s (``sec_…``)."""

    async def put(
        self,
        value: bytes,
        *,
        idempotency_key: str | None = None,
        label: str | None = None,
        for_node: bool = False,
    ) -> str:
        """Store ``value`` for this workflow step and return its SecretRef (``sec_…``).

        The same ``idempotency_key`` returns the same ref, so a re-run stores nothing twice.
        With ``for_node`` the value is meant for the workflow's node (its user data): a later
        step's command to that node may carry the reference, and only the node may fetch it.
        """
        ...


class Workflows(Protocol):
    """Starting other workflows from a step."""

    async def start(
        self,
        tx: Sql,
        *,
        profile_id: str,
        profile_version: int | None = None,
        node_id: str | None = None,
        owner: str | None = None,
    ) -> str:
        """Start a workflow inside ``tx`` and return its id; ``owner`` hears when it ends."""
        ...


class Log(Protocol):
    """A bound structlog logger; events are snake_case actions, context as keywords."""

    def debug(self, event: str, **kw: Any) -> Any: ...

    def info(self, event: str, **kw: Any) -> Any: ...

    def warning(self, event: str, **kw: Any) -> Any: ...

    def error(self, event: str, **kw: Any) -> Any: ...


class StepNode(Protocol):
    """The node a workflow runs for."""

    @property
    def id(self) -> str: ...

    @property
    def site_id(self) -> str: ...

    @property
    def tenant_id(self) -> str: ...

    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def macs(self) -> Sequence[str]:
        """The node's MAC addresses (lower case, ``aa:bb:…``)."""
        ...

    @property
    def bmc(self) -> Mapping[str, Any] | None:
        """``{driver, address, credentialsRef, systemId?, insecure?}``, or None without a BMC.

        ``credentialsRef`` is a SecretRef (``sec_…``); the password is never here.
        """
        ...

    @property
    def state(self) -> str:
        """The lifecycle state (``enrolled``, ``deploying``, …; DESIGN section 10)."""
        ...

    @property
    def inventory(self) -> Mapping[str, Any] | None:
        """The hardware the node's bcd last reported (``inspect.collect``, discovery), read when
        the step runs: ``cpus`` (``model``, ``cores``), ``memory`` (``totalBytes``), ``disks``,
        ``nics``, ``gpus``, ``system`` (``productUuid``, ``serial``, …); None before the first.

        What bcd reports is the machine's word, node-signed: trust it as far as that goes.
        """
        ...


class StepCoordinates(Protocol):
    """Where a step run sits: enough to build its command keys."""

    @property
    def workflow_id(self) -> str: ...

    @property
    def step(self) -> int:
        """Index of the step in its workflow (0-based)."""
        ...

    @property
    def attempt(self) -> int:
        """Attempt number of this step, from 1."""
        ...


class StepContext(StepCoordinates, Protocol):
    """What a control-plane step's ``run(input, ctx)`` receives.

    ``pki`` and ``secrets`` may be absent; a step that needs them should raise
    ``INVALID_CONFIG`` rather than fail on ``None``.
    """

    @property
    def sql(self) -> Sql: ...

    @property
    def node(self) -> StepNode | None: ...

    @property
    def idempotency_key(self) -> str:
        """Stable across re-runs of the same attempt: key your side effects by it."""
        ...

    @property
    def batch_id(self) -> str | None:
        """The workflow's destructive batch, when the quorum gave it one."""
        ...

    @property
    def pki(self) -> Pki | None: ...

    @property
    def secrets(self) -> Secrets | None: ...

    @property
    def workflows(self) -> Workflows: ...

    @property
    def log(self) -> Log: ...

    async def once(self, name: str, load: Callable[[], Awaitable[T]]) -> T:
        """What ``load()`` gave the first run of this attempt that asked for ``name``; the
        attempt's later runs get the same without calling it (a step waiting on its commands runs
        again at each one's end). Kept in the engine's memory only, for the attempt: a run on
        another engine or after a restart calls ``load`` again, so use it for a read whose answer
        the attempt may take once, never for a side effect."""
        ...


def step_command_key(ctx: StepCoordinates, key: str | None = None) -> str:
    """The command key of this step attempt: ``wf:<workflow_id>:<step>#<attempt>[:<key>]``.

    Keys are per attempt, so a retried step starts its commands over.

    Args:
        ctx: the step's context.
        key: tells several commands of one step apart (``boot-device``); letters, digits,
            ``.``, ``_`` and ``-``, up to 64 characters.

    Raises:
        BcError: ``INVALID_INPUT`` at ``key`` for a malformed key.
    """
    return attempt_key(ctx.workflow_id, ctx.step, ctx.attempt, key)
