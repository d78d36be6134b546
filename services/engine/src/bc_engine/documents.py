"""What enters and leaves ``bc.api.engine.*`` besides the request Structs: the bounds of free
fields (labels, profile documents), checked before anything is parsed or stored, and the
replies of nodes and workflows built from their rows. Their JSON columns arrive decoded (the
engine pool's jsonb codec): a step's result or a node's column that is a string is that string,
never parsed again."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire import engine as m
from better_compute.wire.codec import encode

__all__ = ["check_document", "check_labels", "inventory_summary", "node_doc", "workflow_doc"]

_LABEL_KEY_RE: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")


def _too_big(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path})


def check_labels(labels: Mapping[str, str], path: str = "labels") -> None:
    """Refuse labels beyond their bounds, naming the label (``labels.rack``).

    At most ``MAX_LABELS``; keys of letters, digits and ``._/-`` (starting and ending with a
    letter or digit, at most ``MAX_LABEL_KEY``); values of at most ``MAX_LABEL_VALUE``
    characters without control characters.
    """
    if len(labels) > m.MAX_LABELS:
        raise _too_big(path, f"a node has at most {m.MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        if not _LABEL_KEY_RE.match(key):
            raise _too_big(
                path,
                f"label key {key[:80]!r} is not 1 to {m.MAX_LABEL_KEY} letters, digits and ._/-"
                " (starting and ending with a letter or digit)",
            )
        if len(value) > m.MAX_LABEL_VALUE or _CONTROL_RE.search(value):
            raise _too_big(
                f"{path}.{key}",
                f"label {key} must be at most {m.MAX_LABEL_VALUE} characters without control"
                f" characters (got {len(value)})",
            )


def check_document(document: Mapping[str, Any], path: str = "document") -> None:
    """Refuse a profile document beyond ``MAX_DOCUMENT_BYTES``, or a step whose ``with``
    is beyond ``MAX_STEP_INPUT_BYTES`` (as JSON), before it is parsed or stored."""
    size = len(encode(document))
    if size > m.MAX_DOCUMENT_BYTES:
        raise _too_big(path, f"a profile document is at most {m.MAX_DOCUMENT_BYTES} bytes, got {size}")
    steps = document.get("steps")
    if not isinstance(steps, list):
        return
    for i, step in enumerate(steps):
        if isinstance(step, Mapping) and step.get("with") is not None:
            size = len(encode(step["with"]))
            if size > m.MAX_STEP_INPUT_BYTES:
                raise _too_big(
                    f"{path}.steps[{i}].with",
                    f"a step's with is at most {m.MAX_STEP_INPUT_BYTES} bytes, got {size}",
                )


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def inventory_summary(inventory: Any) -> m.InventorySummary | None:
    """CPUs, memory, and how many disks, NICs and GPUs: what a table shows of an inventory."""
    if not isinstance(inventory, Mapping):
        return None
    cpus = inventory.get("cpus")
    memory = inventory.get("memory")

    def count(key: str) -> int | None:
        items = inventory.get(key)
        return len(items) if isinstance(items, list) else None

    return m.InventorySummary(
        cpu_model=cpus.get("model") if isinstance(cpus, Mapping) else None,
        cores=cpus.get("cores") if isinstance(cpus, Mapping) else None,
        memory_bytes=memory.get("totalBytes") if isinstance(memory, Mapping) else None,
        disks=count("disks"),
        nics=count("nics"),
        gpus=count("gpus"),
    )


def node_doc(
    row: Any,
    *,
    full: bool = False,
    current_workflow: m.CurrentWorkflow | msgspec.UnsetType | None = msgspec.UNSET,
) -> m.NodeView:
    """A node; ``full`` (nodes.get) adds its inventory and host section, lists show a summary.

    Its jsonb columns come decoded once by the pool's codec: a JSON string is that string."""
    inventory = row["inventory"]
    return m.NodeView(
        id=row["id"],
        tenant_id=row["tenant_id"],
        site_id=row["site_id"],
        labels=row["labels"],
        name=row.get("name"),
        bmc_inventory=row.get("bmc_inventory"),
        macs=list(row["macs"]),
        bmc=row["bmc"],
        state=row["state"],
        state_reason=row["state_reason"],
        workflow_id=row["workflow_id"],
        power_state=row["power_state"],
        image=row["image"],
        last_error=row["last_error"],
        generation=row["generation"],
        observed_generation=row["observed_generation"],
        inventory_summary=inventory_summary(inventory),
        hardware=row.get("hardware"),
        enrolled_by_rule=row.get("enrolled_by_rule"),
        quarantine=row.get("quarantine"),
        maintenance=row.get("maintenance"),
        discovery_conflict=row.get("discovery_conflict"),
        pending_enrollment=row.get("pending_enrollment"),
        created_at=_iso(row["created_at"]),
        updated_at=_iso(row["updated_at"]),
        inventory=inventory if full else msgspec.UNSET,
        host_section=row["host_section"] if full else msgspec.UNSET,
        current_workflow=current_workflow,
    )


def _step(s: Any) -> m.WorkflowStep:
    return m.WorkflowStep(
        index=s["idx"],
        action=s["action"],
        runs_on=s["runs_on"],
        mode=s["mode"],
        command=s["command"],
        state=s["state"],
        attempt=s["attempt"],
        started_at=_iso(s["started_at"]),
        deadline=_iso(s["deadline"]),
        finished_at=_iso(s["finished_at"]),
        result=s["result"],
        error=s["error"],
        command_id=s["command_id"],
        waiting_for=s.get("waiting_for") if s["state"] in ("pending", "running") else None,
        retry=s.get("retry"),
        retry_at=_iso(s.get("retry_at")) if s["state"] == "pending" else None,
        attempts=list(s.get("attempts") or []),
    )


def workflow_doc(
    row: Any, steps: list[Any] | None = None, *, steps_next: str | msgspec.UnsetType | None = msgspec.UNSET
) -> m.WorkflowView:
    """The workflow; with ``steps`` (rows) its steps, with ``steps_next`` the cursor of the rest."""
    return m.WorkflowView(
        id=row["id"],
        tenant_id=row["tenant_id"],
        node_id=row["node_id"],
        profile=m.WorkflowProfile(
            tenant_id=row["profile_tenant"], id=row["profile_id"], version=row["profile_version"]
        ),
        state=row["state"],
        owner=row["owner"],
        command_kinds=list(row["command_kinds"]),
        batch_id=row["batch_id"],
        error=row["error"],
        created_at=_iso(row["created_at"]),
        finished_at=_iso(row["finished_at"]),
        steps=[_step(s) for s in steps] if steps is not None else msgspec.UNSET,
        steps_next=steps_next,
        queued=row["state"] == "running" and not row.get("admitted", True),
    )
