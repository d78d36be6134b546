"""``make demo``, the README's first command, as a new operator runs it: the simulated fleet
(``NO_VM=1``: five machines and a sixth discovered; the VM's path is test_vm_lifecycle's)
through enroll, inspect, commission, deploy and release, the quorum's batches approved once
their machines wait for them. Then, on the stack the demo kept (``KEEP=1``), docs/fleet-demo.md's
rollout block line by line (read from the doc: ``doc_examples()``), the batches signed as the
reader's approver would, and ``bcx dev down``.

Long (``make test-long``): a stack, a simulator and six rollouts of its own, two minutes or so.
A demo whose approval step waits on words the watch line no longer says stops with an error
(before, it waited 600 s and then approved)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from doc_blocks import doc_block

ROOT = Path(__file__).resolve().parents[2]
BCX = str(Path(sys.executable).parent / "bcx")
DOC = "docs/fleet-demo.md"


def doc_examples() -> list[str]:
    """The lines of fleet-demo.md's rollout block this test runs (the doc test checks them)."""
    return doc_block(DOC, "tests/e2e/test_demo.py")


def _bcx(argv: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BCX, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _approver(env: dict[str, str], key: Path, stop: threading.Event, signed: list[str]) -> None:
    """Sign every open batch as the demo's approver, as an operator at a second terminal would."""
    while not stop.wait(0.5):
        listed = _bcx(["--json", "batches", "list", "--state", "open"], env, timeout=60)
        if listed.returncode != 0:
            continue
        for batch in json.loads(listed.stdout)["batches"]:
            if batch["id"] in signed:
                continue
            done = _bcx(
                ["batches", "approve", batch["id"], "--approver", "demo", "--key-file", str(key), "--yes"],
                env,
                timeout=60,
            )
            if done.returncode == 0:
                signed.append(batch["id"])


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_make_demo_tells_the_whole_story_on_the_simulated_fleet(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BC_", "BCX_"))}
    env |= {"NO_VM": "1", "KEEP": "1", "BC_STATE_DIR": str(state), "BCX_CONFIG": os.devnull}
    try:
        done = subprocess.run(
            ["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        # each rollout's summary, in order: all five machines ended where the verb takes them
        # (commission and release leave a machine ready)
        ends = re.findall(r"^5 nodes in [0-9.]+s: (5 \w+)$", out, re.M)
        assert ends == ["5 inspected", "5 ready", "5 deployed", "5 ready"], out[-4000:]
        # commission, deploy and release write disks: a batch each, signed once its machines wait
        assert len(re.findall(r">> bcx batches approve batch_", out)) == 3, out[-4000:]
        assert "the fleet's whole story" in out
        assert "BC_STATE_DIR" in out  # KEEP=1 says how to reach the kept stack

        # the doc's rollout block on the kept stack, its batches signed as they open
        stop, signed = threading.Event(), []
        approver = threading.Thread(
            target=_approver, args=(env, state / "approver.pem", stop, signed), daemon=True
        )
        approver.start()
        try:
            runs = []
            for line in doc_examples():
                argv = shlex.split(line)
                assert argv[:3] == ["uv", "run", "bcx"], line
                runs.append((line, _bcx(argv[3:], env)))
        finally:
            stop.set()
            approver.join(timeout=120)
        for line, run in runs:
            assert run.returncode == 0, (line, run.stdout[-3000:], run.stderr[-2000:])
        (_, deploy), _, (_, watch) = runs
        assert re.search(r"^5 nodes in [0-9.]+s: 5 deployed$", deploy.stdout, re.M), deploy.stdout[-3000:]
        assert re.search(r"^5 nodes in [0-9.]+s: 5 ready$", watch.stdout, re.M), watch.stdout[-3000:]
        assert len(signed) == 2, signed  # the deploy's batch and the release's
    finally:
        _bcx(["dev", "down"], env, timeout=300)
