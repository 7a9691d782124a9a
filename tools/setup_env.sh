#!/usr/bin/env bash
# Create the project's virtualenv with the pinned CPU steps (`make run` and `make test` call this on
# first use, and again when pyproject.toml changes; CI through `make test`):
#
#   tools/setup_env.sh [VENV_DIR]        (default .venv)
#
# GPU users keep their own environment (their CUDA torch) and skip this: `make run PYTHON=python`.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
python="$venv/bin/python"
"$python" -m pip install -q --upgrade pip
# CPU machines: the pinned CPU wheel first, so that nothing pulls a CUDA build of torch.
"$python" -m pip install -q "torch==2.13.0"
DS_BUILD_OPS=0 "$python" -m pip install -q -e ".[test]"
"$python" -m pip check
