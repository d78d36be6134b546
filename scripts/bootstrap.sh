# Sourced by the other scripts: makes sure uv exists and the workspace is installed
# exactly as uv.lock says. Needs only python3 (3.11+) and pip on the machine.
set -euo pipefail
if command -v uv >/dev/null 2>&1; then
  UV=(uv)
else
  if ! python3 -m uv --version >/dev/null 2>&1; then
    echo "bootstrap: installing uv with pip" >&2
    python3 -m pip install --quiet --disable-pip-version-check uv
  fi
  UV=(python3 -m uv)
fi
"${UV[@]}" sync --frozen --all-packages --all-extras --quiet
