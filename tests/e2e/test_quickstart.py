"""README's "Your first machine, by hand", line by line as a new operator pastes it (issue 26:
a first own inspect with the README alone, no Python written): the ramdisk built, the stack up, a
simulated machine enrolled by its BMC, inspected, shown, everything down again.

Long (``make test-long``): it starts a whole stack of its own, which the suite's budget has no
room for; the same verbs run in ``make test`` on the shared stacks (test_metal_bcx,
test_bmc_failures)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BCX = str(Path(sys.executable).parent / "bcx")


def doc_examples() -> list[str]:
    """The lines of README's block this test runs (the doc test checks they are its block's)."""
    return _block()


def _block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your first machine, by hand", 1)[1]
    body = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in body.splitlines() if line.strip()]


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    assert argv[:3] == ["uv", "run", "bcx"], argv
    done = subprocess.run(
        [BCX, *argv[3:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_the_readmes_first_machine_is_inspected_by_its_lines_alone(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BC_")}
    lines = _block()
    assert any("inspect" in line for line in lines), lines
    bmc: str | None = None
    said: dict[str, str] = {}
    try:
        for line in lines:
            if line.startswith("export "):
                key, _, value = line.removeprefix("export ").partition("=")
                env[key] = value
                continue
            for command in line.split(" && "):
                if "<BMC URL>" in command:
                    assert bmc is not None, "sim up printed no BMC URL"
                    command = command.replace("<BMC URL>", shlex.quote(bmc))
                argv = shlex.split(command)
                out = _run(argv, tmp_path, env)
                said[" ".join(argv[3:5])] = out
                found = re.search(r"redfish\+http://\S+", out)
                if argv[3:5] == ["sim", "up"] and found:
                    bmc = found.group(0)
    finally:
        for down in (["sim", "down", "--site", "lab1"], ["dev", "down"]):
            subprocess.run([BCX, *down], cwd=tmp_path, env=env, capture_output=True, timeout=120, check=False)
    assert "1 inspected" in said["inspect lab1-m000"], said["inspect lab1-m000"]
    shown = said["nodes show"]
    assert "inspected" in shown, shown
    assert "lab1-m000" in shown, shown
