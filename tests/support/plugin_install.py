"""A plugin package installed as an operator's ``uv pip install`` would, into a folder the services
get on ``sys.path`` (test_plugins, the doc examples' long test)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def uv_install(package: Path, target: Path) -> None:
    """``uv pip install --no-deps --target`` (better-compute is the services' own already). The build
    backend, uv_build, is in uv's cache from the workspace's own sync, so this takes a second."""
    uv = os.environ.get("UV") or shutil.which("uv")  # `uv run` sets UV
    command = [uv] if uv else [sys.executable, "-m", "uv"]
    done = subprocess.run(
        [*command, "pip", "install", "--quiet", "--offline", "--no-deps", "--target", str(target),
         str(package)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
