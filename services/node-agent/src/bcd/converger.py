"""The host converger: applies a node's host section (config units) and reports each unit.

Each unit is idempotent: applied twice, the second run reports ``unchanged`` and changes
nothing. The units live in ``host_units.py`` (``sysctl``, ``kernel-modules``, ``hugepages``,
``k8s-join``) and ``gpu_units.py`` (the NVIDIA ones). A unit this daemon was not built with is
reported as ``unit <name> is not supported by this daemon`` and fails the host section once
the known units had their turn; ``observedGeneration`` advances only when every unit applied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
from msgspec import UNSET

from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger
from better_compute.provision.config_units import BUILTIN_CONFIG_UNITS
from better_compute.wire.commands import ConvergeResult, ConvergeUnit, UnitReport

from .gpu_units import GPU_UNITS
from .host_units import HOST_UNITS
from .system import Machine
from .unit import STATE, Apply, SecretFetcher, Unit, UnitFailed, UnitSkipped

__all__ = ["SUPPORTED_UNITS", "Converger", "UnitFailed"]


def log() -> Any:
    """bcd's logger, as configured when it logs (never bound before ``configure_logging``)."""
    return get_logger(component="bcd")


_UNITS: Final[Mapping[str, Apply]] = {**HOST_UNITS, **GPU_UNITS}
SUPPORTED_UNITS: Final = frozenset(_UNITS)


class Converger:
    """Applies host sections on one machine.

    Args:
        machine: the root and runner.
        fetch_secret: reads a ``SecretRef`` through the secrets gate (``k8s-join``'s token).
    """

    def __init__(self, machine: Machine, *, fetch_secret: SecretFetcher | None = None) -> None:
        self.machine = machine
        self.fetch_secret = fetch_secret

    def observed_generation(self) -> int:
        """The generation of the last host section that applied whole (0 before any)."""
        try:
            doc = json.loads(self.machine.path(f"{STATE}/converge.json").read_text())
            return int(doc.get("observedGeneration", 0))
        except (OSError, ValueError, TypeError):
            return 0

    async def converge(self, *, generation: int, units: Sequence[ConvergeUnit]) -> ConvergeResult:
        """Apply ``units`` in order and report each.

        Raises:
            BcError: ``INVALID_STATE`` (reason ``host-section-failed``) once every known unit
                had its turn, when a unit failed or is not supported; the message names each.
        """
        reports: list[UnitReport] = []
        problems: list[str] = []
        cache: dict[str, Any] = {}  # what units looked up on the machine (its GPUs), once
        for index, entry in enumerate(units):
            report = await self._apply(index, entry, cache)
            if report.status in ("failed", "unsupported") and isinstance(report.detail, str):
                problems.append(report.detail)
            reports.append(report)
        observed = generation if not problems else self.observed_generation()
        doc = ConvergeResult(generation=generation, observed_generation=observed, units=reports)
        Unit(self.machine).write(
            f"{STATE}/converge.json", msgspec.json.format(msgspec.json.encode(doc)).decode() + "\n", 0o600
        )
        log().info("host_converged", generation=generation, observed_generation=observed,
                 units={r.name: r.status for r in reports})  # fmt: skip
        if problems:
            summary = ", ".join(f"{r.name} {r.status}" for r in reports)
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"{'; '.join(problems)} (units: {summary})",
                {"reason": "host-section-failed", "generation": generation, "observedGeneration": observed},
            )
        return doc

    async def _apply(self, index: int, entry: ConvergeUnit, cache: dict[str, Any]) -> UnitReport:
        name = entry.name
        apply = _UNITS.get(name)
        if apply is None:
            return UnitReport(
                name=name, status="unsupported", detail=f"unit {name} is not supported by this daemon"
            )
        try:
            # bcd applies what its own units understand: their settings, defaults filled
            settings = BUILTIN_CONFIG_UNITS[name].settings.validate(
                entry.settings or {}, path=f"units[{index}].settings"
            )
        except BcError as err:
            why = f"unit {name} failed: {err.message} (at {err.path})"
            return UnitReport(name=name, status="failed", detail=why, path=err.path)
        unit = Unit(self.machine, self.fetch_secret, cache=cache)
        try:
            changed, detail = await apply(unit, settings)
        except UnitSkipped as exc:
            return UnitReport(name=name, status="skipped", detail=str(exc))
        except UnitFailed as exc:
            return UnitReport(
                name=name, status="failed", detail=f"unit {name} failed: {exc}", ran=unit.ran or UNSET
            )
        return UnitReport(
            name=name,
            status="changed" if changed else "unchanged",
            detail=detail or UNSET,
            ran=unit.ran or UNSET,
        )
