"""bcx against bc-command-queue and bc-pki processes: commands, agents and the batch quorum,
with approvals signed by key files that never leave the approver's machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx
from better_compute.wire.cmdq import EnqueueCommand


async def ok_json(settings: Settings, *args: str) -> Any:
    out = await bcx(settings, *args, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


async def test_bcx_drives_commands_agents_and_the_batch_quorum(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    s = bc_settings
    keys: dict[str, str] = {}
    for name in ("alice", "bob"):
        made = await ok_json(
            s, "batches", "keygen", "--key-file", str(tmp_path / f"{name}.pem"), "--approver", name
        )
        keys[name] = made["publicKey"]
        assert (tmp_path / f"{name}.pem").stat().st_mode & 0o777 == 0o600
    again = await bcx(s, "batches", "keygen", "--key-file", str(tmp_path / "alice.pem"))
    assert again.returncode == 1
    assert "CONFLICT" in again.stderr
    approvers = tmp_path / "approvers.toml"
    approvers.write_text(
        "threshold = 2\n"
        + "".join(f'[[approvers]]\nid = "{n}"\npublicKey = "{k}"\n' for n, k in keys.items())
    )
    bc_processes.extra_env.update(BC_CMDQ_QUORUM_FILE=str(approvers), BC_CMDQ_SWEEP="100ms")
    bc_processes.start("bc-pki")
    cmdq = bc_processes.start("bc-command-queue")
    await bc_processes.wait_ready()
    cq = CommandQueueClient(bc_api)

    node = new_id("node")
    batch = await ok_json(
        s, "batches", "create", "--kind", "node.wipe", "--node", node, "--note", "rebuild rack 4"
    )
    assert (batch["state"], batch["kinds"], batch["nodes"]) == ("open", ["node.wipe"], [node])
    wipe = await cq.enqueue(
        EnqueueCommand(
            node_id=node, site_id="site-x", kind="node.wipe", key="w", target="node", batch_id=batch["id"]
        )
    )
    assert wipe.state == "pending"

    # a key that is not the approver's is refused, and counts for nothing
    wrong = await bcx(
        s, "batches", "approve", batch["id"], "--approver", "bob", "--key-file", str(tmp_path / "alice.pem")
    )
    assert wrong.returncode == 1
    # the usual error line: error: CODE: message (at path), as every other command prints it
    assert wrong.stderr.startswith("error: UNAUTHENTICATED: "), wrong.stderr
    first = await bcx(
        s, "batches", "approve", batch["id"], "--approver", "alice", "--key-file", str(tmp_path / "alice.pem")
    )
    assert first.returncode == 0, first.stderr
    assert "1/2" in first.stdout
    assert "approved by alice" in first.stdout
    second = await ok_json(
        s, "batches", "approve", batch["id"], "--approver", "bob", "--key-file", str(tmp_path / "bob.pem")
    )
    assert second["state"] == "approved"
    assert [a["approverId"] for a in second["approvals"]] == ["alice", "bob"]
    listed = await ok_json(s, "batches", "list", "--state", "approved")
    assert [b["id"] for b in listed["batches"]] == [batch["id"]]
    shown = await bcx(s, "batches", "get", batch["id"])
    assert "rebuild rack 4" in shown.stdout
    assert "approved" in shown.stdout

    # several batches in one approval; one that is not there is named and does not stop the rest
    more = [
        (await ok_json(s, "batches", "create", "--kind", "node.wipe", "--node", node))["id"] for _ in range(2)
    ]
    ghost = new_id("batch")
    for name in ("alice", "bob"):
        both = await bcx(
            s, "batches", "approve", *more, ghost, "--approver", name,
            "--key-file", str(tmp_path / f"{name}.pem"), "--json",
        )  # fmt: skip
        assert both.returncode == 1, both.stderr
        out = json.loads(both.stdout)
        assert [b["id"] for b in out["batches"]] == more
        assert [(e["id"], e["code"]) for e in out["errors"]] == [(ghost, "NOT_FOUND")]
    assert [(await cq.get_batch(id=b)).state for b in more] == ["approved", "approved"]
    quorum = await bcx(s, "quorum", "show")
    assert quorum.returncode == 0, quorum.stderr
    assert "threshold 2 of 2" in quorum.stdout
    assert {"alice", "bob"} <= set(quorum.stdout.split())

    # the approved wipe went out to the node's (absent) bcd
    got = await ok_json(s, "commands", "get", wipe.id)
    assert (got["state"], got["batchId"], got["destructive"]) == ("dispatched", batch["id"], True)
    table = await bcx(s, "commands", "list", "--node", node)
    assert table.stdout.splitlines()[0].split()[:4] == ["ID", "NODE", "KIND", "STATE"]
    assert wipe.id in table.stdout
    assert "dispatched" in table.stdout
    page = await ok_json(s, "commands", "list", "--kind", "node.wipe", "--state", "dispatched")
    assert [c["id"] for c in page["commands"]] == [wipe.id]
    cancelled = await bcx(s, "commands", "cancel", wipe.id, "--reason", "wrong rack")
    assert cancelled.stdout.strip() == f"cancelled {wipe.id}"
    assert (await cq.get(id=wipe.id)).reason == "wrong rack"
    nothing = await ok_json(s, "commands", "cancel", wipe.id)
    assert nothing == {"cancelled": []}
    missing = await bcx(s, "commands", "get", new_id("cmd"), "--json")
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["error"]["code"] == "NOT_FOUND"

    assert (await ok_json(s, "agents", "list"))["agents"] == []
    assert (await bcx(s, "agents", "list")).stdout.strip() == "no agents"
    # the private keys never reached the service
    for name in ("alice", "bob"):
        secret = (tmp_path / f"{name}.pem").read_text().splitlines()[1]
        assert secret not in cmdq.output()
