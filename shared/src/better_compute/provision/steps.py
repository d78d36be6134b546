"""``define_step``: the three kinds of step.

* a *control-plane* step runs ``run(input, ctx)`` in the engine;
* an *agent* step (``runs_on="site"`` or ``"node"``) is one command of kind ``command`` whose
  payload is the step's validated input;
* a *relaying* step is a control-plane step with ``relays=("site",)``: it runs in the engine,
  where the data lives, sends commands to that agent, and profiles may still address it with
  ``on: site``. It declares the command kinds it sends in ``sends``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import Manifest, parse_duration
from better_compute.core.plugins import DOTTED_NAME_PATTERN, as_tuple, is_dotted_name

from .retry import RetryPolicy, parse_retry

if TYPE_CHECKING:
    from .context import StepContext

__all__ = [
    "AGENTS",
    "CONTROL_PLANE",
    "PLACES",
    "STEP_ID_PATTERN",
    "Place",
    "RunFn",
    "Step",
    "define_step",
]

CONTROL_PLANE: Final = "control-plane"
AGENTS: Final = ("site", "node")
PLACES: Final = (CONTROL_PLANE, *AGENTS)
Place = Literal["control-plane", "site", "node"]

STEP_ID_PATTERN: Final = DOTTED_NAME_PATTERN

RunFn = Callable[[dict[str, Any], "StepContext"], Awaitable[Any]]


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


@dataclass(frozen=True, kw_only=True, eq=False)
class Step:
    """A step, frozen. Made by ``define_step``; compared by identity."""

    extension: ClassVar[Literal["step"]] = "step"

    id: str
    runs_on: Place
    timeout: str
    timeout_ms: int
    input: Manifest
    run: RunFn | None
    command: str | None
    relays: tuple[str, ...]
    sends: tuple[str, ...]
    retry_safe: bool
    description: str
    retry: RetryPolicy | None = None

    @property
    def is_agent_step(self) -> bool:
        """Whether the step is one command run by an agent."""
        return self.runs_on != CONTROL_PLANE

    def accepts(self, on: str | None) -> bool:
        """Whether a profile step with this ``on:`` resolves to this step."""
        return on is None or on == self.runs_on or on in self.relays


def _is_async_callable(fn: object) -> bool:
    # An object with `async def __call__` is as good as an `async def` function.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - looking for an async __call__, not callability
    )


def define_step(
    *,
    id: str,
    runs_on: Place,
    timeout: str,
    input: Manifest,
    run: RunFn | None = None,
    command: str | None = None,
    relays: tuple[str, ...] | list[str] = (),
    sends: tuple[str, ...] | list[str] = (),
    retry_safe: bool = False,
    description: str = "",
    retry: RetryPolicy | Mapping[str, Any] | None = None,
) -> Step:
    """Check a step's shape and return it frozen (``step.extension == "step"``).

    Args:
        id: dotted, camelCase segments (``autoinstall.renderIso``); one namespace for all
            steps, so prefix yours.
        runs_on: ``"control-plane"``, ``"site"`` or ``"node"``.
        timeout: duration string (``"5m"``), longer than zero: the step's deadline.
        input: manifest the profile step's ``with`` must fit.
        run: control-plane steps only, ``async def run(input, ctx)``; must be safe to repeat.
        command: agent steps only, the command kind to send (checked against the registered
            kinds when the app is built).
        relays: control-plane steps only; agents (``"site"``, ``"node"``) a profile may name
            in ``on:`` for this step.
        sends: control-plane steps only; command kinds the step enqueues, so the workflow's
            destructive batch covers them.
        retry_safe: whether a failed attempt may simply be run again as a new attempt. Only a
            retry-safe step may have a retry policy (its own default or a profile's).
        description: one line for people.
        retry: the default retry policy of the step (``{"attempts": 3, "backoff": "2s",
            "maxBackoff": "30s", "on": ["UNAVAILABLE"]}``); a profile step's ``retry`` replaces it.

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` naming the bad argument.
    """
    if not is_dotted_name(id):
        raise _bad("id", f"step ids are dotted names matching {STEP_ID_PATTERN}, got {id!r}")
    if runs_on not in PLACES:
        raise _bad("runs_on", f"runs_on must be one of {', '.join(PLACES)}, got {runs_on!r}")
    timeout_ms = parse_duration(timeout, path="timeout", code=ErrorCode.INVALID_CONFIG)
    if timeout_ms <= 0:
        raise _bad("timeout", "timeout must be longer than zero")
    if not isinstance(input, Manifest):
        raise _bad("input", "input must be a manifest (better_compute.core.manifest)")
    if not isinstance(retry_safe, bool):
        raise _bad("retry_safe", "retry_safe must be a boolean")
    if not isinstance(description, str):
        raise _bad("description", "description must be a string")
    policy = parse_retry(retry, "retry") if retry is not None else None
    if policy is not None and not retry_safe:
        raise _bad("retry", "only a retry_safe step retries on its own: set retry_safe=True or drop retry")
    relay_list = as_tuple(relays, "relays")
    send_list = as_tuple(sends, "sends")

    if runs_on == CONTROL_PLANE:
        if command is not None:
            raise _bad("command", "a control-plane step runs `run`; only agent steps name a command")
        if run is None:
            raise _bad("run", "a control-plane step needs `run`")
        if not _is_async_callable(run):
            raise _bad("run", "run must be an async function: async def run(input, ctx)")
        _check_distinct(relay_list, "relays", lambda agent: agent in AGENTS, "an agent: site or node")
        _check_distinct(send_list, "sends", is_dotted_name, "a command kind like site.httpProxy")
    else:
        if run is not None:
            raise _bad("run", "an agent step sends its command; only control-plane steps have `run`")
        if not is_dotted_name(command):
            raise _bad("command", f"an agent step names its command kind, got {command!r}")
        if relay_list:
            raise _bad("relays", "only control-plane steps relay to agents")
        if send_list:
            raise _bad("sends", "an agent step's command already names its kind; drop `sends`")

    return Step(
        id=id,
        runs_on=runs_on,
        timeout=timeout,
        timeout_ms=timeout_ms,
        input=input,
        run=run,
        command=command,
        relays=relay_list,
        sends=send_list,
        retry_safe=retry_safe,
        description=description,
        retry=policy,
    )


def _check_distinct(items: tuple[Any, ...], name: str, valid: Callable[[Any], bool], expected: str) -> None:
    for index, item in enumerate(items):
        if not valid(item):
            raise _bad(f"{name}[{index}]", f"expected {expected}, got {item!r}")
        if item in items[:index]:
            raise _bad(f"{name}[{index}]", f"{item!r} is listed twice")
