"""Key rotation as an operator does it: bcx keys rotate, restart the services, bcx keys rewrap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, run_bcx

pytestmark = pytest.mark.e2e


async def test_rotate_restart_and_rewrap_reseals_every_stored_secret_under_the_new_key(
    bc_processes: ServiceProcesses, bc_settings: Settings, bc_api: ApiClient
) -> None:
    procs = [bc_processes.start("bc-pki"), bc_processes.start("bc-secrets")]
    await bc_processes.wait_ready()
    secrets = SecretsClient(bc_api)
    value = f"rotate-me-{new_id('sec')}".encode()
    stored = await secrets.put(value=value, tenant_id="root", workflow_id=new_id("wf"), step=0)

    rotated = {}
    for service in ("pki", "secrets"):
        # on the host of the services: their state folder (or the key_file setting) names the file
        run = run_bcx(bc_settings, "--state-dir", str(bc_settings.state_dir), "keys", "rotate",
                      "--service", service, "--json")  # fmt: skip
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["path"] == str(Path(bc_settings.state_dir) / "keys" / f"{service}.key")
        text = Path(out["path"]).read_text()  # noqa: ASYNC240 (a small local file)
        key_lines = [ln for ln in text.splitlines() if ln.startswith("bck1:")]
        assert key_lines[0].startswith(f"bck1:{out['keyId']}:")  # the new key on top
        assert all(line.split(":")[2] not in run.stdout for line in key_lines)  # no key printed
        rotated[service] = out["keyId"]
    assert (await secrets.describe(ref=stored.ref)).key_id != rotated["secrets"]

    for proc in procs:  # every instance restarts with the new file
        proc.signal(15)
        assert await proc.wait_exit(timeout=20) is not None
        bc_processes.restart(proc)
    await bc_processes.wait_ready()
    run = run_bcx(bc_settings, "keys", "rewrap", "--json")
    assert run.returncode == 0, run.stderr
    done = {row["service"]: row for row in json.loads(run.stdout)["services"]}
    assert (done["secrets"]["keyId"], done["secrets"]["rewrapped"]) == (rotated["secrets"], 1)
    assert done["pki"]["keyId"] == rotated["pki"]
    assert done["pki"]["rewrapped"] >= 1  # the CA key and the token key
    assert (await secrets.describe(ref=stored.ref)).key_id == rotated["secrets"]
    assert await secrets.get(ref=stored.ref) == value

    table = run_bcx(bc_settings, "keys", "rewrap", "--service", "secrets")
    assert table.returncode == 0, table.stderr
    assert table.stdout.split("\n")[1].split() == ["secrets", rotated["secrets"], "0"]  # nothing left
