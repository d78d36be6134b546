"""``make demo``, the README's first command, as a new operator runs it: the simulated fleet
(``NO_VM=1``: five machines and a sixth discovered; the VM's path is test_vm_lifecycle's)
through enroll, inspect, commission, deploy and release, the quorum's batches approved once
their machines wait for them.

Long (``make test-long``): a stack, a simulator and four rollouts of its own, a minute or two.
A demo whose approval step waits on words the watch line no longer says stops with an error
(before, it waited 600 s and then approved)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_make_demo_tells_the_whole_story_on_the_simulated_fleet(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BC_", "BCX_"))}
    env |= {"NO_VM": "1", "BC_STATE_DIR": str(tmp_path / "demo")}
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
    assert "dev down" in out  # the stack stopped: nothing left running
