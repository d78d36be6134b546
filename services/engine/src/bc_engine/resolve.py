"""Resolving a profile's ``use:`` entries into the steps a workflow persists.

Each ``use`` resolves once, when the workflow starts (or when ``profiles.validate`` /
``profiles.render`` ask):

1. a registered step with that id — an ``on:`` must match its ``runs_on`` or a relay;
2. otherwise, with ``on:`` naming an agent, a registered driver operation
   ``<concern>.<operation>`` (``app.driver_operations``), sent as one ``driver.invoke`` command;
3. otherwise the ``fallback:``, resolved the same way.

``with`` is validated against the step's (or the driver operation's) input at the same moment.
An unknown name is reported with the closest registered names (did you mean).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.core.manifest import Manifest
from better_compute.provision import BUILTIN_CONFIG_UNITS, Profile, ProfileStep, RetryPolicy, Step
from better_compute.provision.userdata import BUILTIN_TEMPLATES
from better_compute.wire import engine as m

__all__ = ["MAX_STEPS", "Problem", "ResolvedStep", "resolve_profile"]

MAX_STEPS = 512
AGENTS = frozenset({"site", "node"})
DRIVER_INVOKE = "driver.invoke"
DEFAULT_DRIVER_TIMEOUT_MS = 10 * 60_000


@dataclass(frozen=True)
class ResolvedStep:
    idx: int
    action: str  # the `use` that resolved (the fallback's when the fallback did)
    runs_on: str  # control-plane, site or node
    mode: str  # control-plane, agent or driver
    command: str | None
    input: dict[str, Any]
    timeout_ms: int
    via: str  # step, driver, fallback-step or fallback-driver
    sends: tuple[str, ...] = ()
    retry: dict[str, Any] | None = None  # the policy, as stored (RetryPolicy.to_stored)

    def view(self) -> m.RenderedStep:
        return m.RenderedStep(
            index=self.idx,
            action=self.action,
            runs_on=self.runs_on,
            mode=self.mode,
            command=self.command,
            input=self.input,
            timeout_ms=self.timeout_ms,
            via=self.via,
            sends=list(self.sends),
            retry=self.retry,
        )


@dataclass(frozen=True)
class Problem:
    path: str
    code: str
    message: str

    def to_document(self) -> dict[str, Any]:
        """As ``details.problems`` of an error."""
        return {"path": self.path, "code": self.code, "message": self.message}

    def view(self) -> m.Problem:
        return m.Problem(path=self.path, code=self.code, message=self.message)

    def to_error(self, **extra: Any) -> BcError:
        return BcError(self.code, self.message, {"path": self.path, **extra})


@dataclass
class Resolution:
    steps: list[ResolvedStep] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def command_kinds(self) -> list[str]:
        kinds: list[str] = []
        for s in self.steps:
            for kind in (s.command, *s.sends):
                if kind and kind not in kinds:
                    kinds.append(kind)
        return kinds


def _with_problems(input: Manifest, with_: dict[str, Any], path: str) -> list[Problem]:
    """Every problem of a step's ``with`` (not only the first), at ``<path>.with.<field>``."""
    at = join_path(path, "with")
    return [Problem(join_path(at, e.path or ""), e.code.value, e.message) for e in input.problems(with_)]


def _resolve_one(
    app: App, ps: ProfileStep, idx: int, path: str, fallback: bool, retry: RetryPolicy | None = None
) -> ResolvedStep | list[Problem] | None:
    """A resolved step, its problems (resolution stops there), or None (try the fallback).

    ``retry`` is the profile step's own policy (a fallback resolves under its step's); a
    registered step that is not ``retry_safe`` refuses one. A driver operation has no definition
    to say so: the profile's policy holds (its command settled, so a retry never overlaps it)."""
    prefix = "fallback-" if fallback else ""
    step: Step | None = app.steps.get(ps.use)
    with_ = dict(ps.with_)
    if step is not None:
        if ps.on is not None and not step.accepts(ps.on):
            allowed = [step.runs_on, *step.relays]
            return [
                Problem(
                    join_path(path, "on"),
                    ErrorCode.INVALID_INPUT.value,
                    f"step {ps.use} runs on {' or '.join(allowed)}, not {ps.on}",
                )
            ]
        if problems := _with_problems(step.input, with_, path):
            return problems
        if retry is not None and not step.retry_safe:
            return [
                Problem(
                    join_path(path, "retry"),
                    ErrorCode.INVALID_INPUT.value,
                    f"step {ps.use} is not retry-safe: a failed attempt may have done part of its"
                    " work, so it is retried only by an operator (bcx workflows retry)",
                )
            ]
        policy = retry or step.retry
        stored = policy.to_stored() if policy is not None else None
        value = step.input.validate(with_)
        timeout_ms = ps.timeout_ms or step.timeout_ms
        if step.is_agent_step:
            return ResolvedStep(
                idx, ps.use, step.runs_on, "agent", step.command, value, timeout_ms,
                prefix + "step", retry=stored,
            )  # fmt: skip
        return ResolvedStep(
            idx, ps.use, "control-plane", "control-plane", None, value, timeout_ms,
            prefix + "step", tuple(step.sends), stored,
        )  # fmt: skip
    operation = app.driver_operations.get(ps.use)
    if ps.on in AGENTS and operation is not None:
        if problems := _with_problems(operation.input, with_, path):
            return problems
        with_ = operation.input.validate(with_)
        kind = app.command_kinds.get(DRIVER_INVOKE)
        payload: dict[str, Any] = {"operation": ps.use, "input": with_}
        if kind is not None:
            try:
                payload = kind.payload.validate(payload)
            except BcError as err:
                return [Problem(join_path(path, "with"), err.code.value, err.message)]
        return ResolvedStep(
            idx, ps.use, ps.on, "driver", DRIVER_INVOKE, payload,
            ps.timeout_ms or DEFAULT_DRIVER_TIMEOUT_MS, prefix + "driver",
            retry=retry.to_stored() if retry is not None else None,
        )  # fmt: skip
    return None


def _unknown(app: App, ps: ProfileStep, path: str) -> Problem:
    """``use`` names neither a step nor (with an agent ``on:``) a driver operation."""
    if ps.on in AGENTS or (ps.on is None and ps.use in app.driver_operations):
        names = [*app.steps, *app.driver_operations]
    else:
        names = list(app.steps)
    if ps.use in app.driver_operations:
        what = f"{ps.use} is a driver operation: it needs on: site"
    else:
        what = f"{ps.use} is not a registered step" + (" or driver operation" if ps.on in AGENTS else "")
        if ps.on is None:
            what += " (and no on: names an agent for a driver operation)"
        close = difflib.get_close_matches(ps.use, names, n=3, cutoff=0.75)
        if close:
            what += "; did you mean " + " or ".join(close) + "?"
    if ps.fallback is not None:
        what += ", nor is its fallback"
    return Problem(join_path(path, "use"), ErrorCode.INVALID_INPUT.value, what)


def resolve_profile(app: App, profile: Profile, *, has_node: bool | None = None) -> Resolution:
    """Resolve every step; collect every problem with its path (nothing stops at the first).

    ``has_node=False`` also reports agent steps, which need a node to send to.
    """
    out = Resolution()
    if len(profile.steps) > MAX_STEPS:
        out.problems.append(
            Problem(
                "steps",
                ErrorCode.INVALID_INPUT.value,
                f"a workflow holds at most {MAX_STEPS} steps, this profile has {len(profile.steps)}",
            )
        )
        return out
    for idx, ps in enumerate(profile.steps):
        path = f"steps[{idx}]"
        got = _resolve_one(app, ps, idx, path, fallback=False, retry=ps.retry)
        if got is None and ps.fallback is not None:
            got = _resolve_one(
                app, ps.fallback, idx, join_path(path, "fallback"), fallback=True, retry=ps.retry
            )
        if got is None:
            got = [_unknown(app, ps, path)]
        if isinstance(got, list):
            out.problems.extend(got)
            continue
        if has_node is False and got.mode != "control-plane":
            out.problems.append(
                Problem(
                    join_path(path, "on"),
                    ErrorCode.INVALID_INPUT.value,
                    f"{got.action} runs on an agent ({got.runs_on}): the workflow needs a node",
                )
            )
            continue
        out.steps.append(got)
    out.problems.extend(_document_problems(app, profile))
    if profile.writes_disk is None and not out.problems:
        out.problems.extend(_undeclared_boot(app, out.steps))
    return out


def _close(word: str, names: list[str]) -> str:
    close = difflib.get_close_matches(word, names, n=2, cutoff=0.75)
    return "; did you mean " + " or ".join(close) + "?" if close else ""


def _document_problems(app: App, profile: Profile) -> list[Problem]:
    """What the profile names outside its steps and the app does not have: its user-data
    template, its config units and their settings (every problem, each at its path), found
    here, not when a deploy renders them on the machine's way."""
    provision = app.provision
    found: list[Problem] = []
    ud = profile.user_data
    if ud is not None:
        user_data = provision.user_data if provision is not None else None
        templates = dict(user_data.templates) if user_data is not None else {}
        if ud.template is not None and ud.template not in templates:
            found.append(
                Problem(
                    "userData.template", ErrorCode.INVALID_CONFIG.value,
                    f"no user-data template named {ud.template}{_close(ud.template, list(templates))}",
                )
            )  # fmt: skip
        elif ud.template is None and ud.kind not in BUILTIN_TEMPLATES:
            found.append(
                Problem(
                    "userData.template", ErrorCode.INVALID_CONFIG.value,
                    f"kind {ud.kind} ships no template: name one with userData.template",
                )
            )  # fmt: skip
    units = provision.config_units if provision is not None else BUILTIN_CONFIG_UNITS
    host = profile.to_document().get("hostConfig") or {}  # plain JSON, as written
    for i, entry in enumerate(host.get("units") or []):
        path = f"hostConfig.units[{i}]"
        unit = units.get(entry["name"])
        if unit is None:
            message = f"unknown config unit {entry['name']!r}{_close(entry['name'], list(units))}"
            found.append(Problem(join_path(path, "name"), ErrorCode.INVALID_INPUT.value, message))
            continue
        for err in unit.settings.problems(entry.get("settings") or {}, path=join_path(path, "settings")):
            found.append(Problem(err.path or path, err.code.value, err.message))
    return found


def _undeclared_boot(app: App, steps: list[ResolvedStep]) -> list[Problem]:
    """A profile whose own steps give the machine a medium or boot entry to boot (an installer,
    perhaps, which writes the disk with nothing destructive sent) must say whether it writes
    disks; a control-plane step that sends such a kind (``metal.ensureRamdisk``: the bcd
    ramdisk, which writes only when a node command tells it) is that step's own business."""
    for step in steps:
        # the step's own command, or the kind it is named after and sends (a relaying BMC
        # step, ``use: media.insert, on: site``; a driver operation)
        names = [step.command or ""]
        if step.command == DRIVER_INVOKE or step.action in step.sends:
            names.append(step.action)
        if any((kind := app.command_kinds.get(n)) is not None and kind.boot == "medium" for n in names):
            return [
                Problem(
                    "writesDisk",
                    ErrorCode.INVALID_CONFIG.value,
                    f"steps[{step.idx}] ({step.action}) gives the machine something to boot: say whether"
                    " it writes a disk (writesDisk: true puts the workflow's boot commands under the"
                    " destructive-batch quorum, false says it boots nothing that writes)",
                )
            ]
    return []
