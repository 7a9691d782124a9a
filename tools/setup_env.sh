#!/usr/bin/env bash
# Create the project's virtualenv with the pinned CPU steps (`make run` and `make test` call this on
# first use, and again when pyproject.toml changes; CI through `make test`):
#
#   tools/setup_env.sh [VENV_DIR] [PYTHON]        (defaults .venv and python3)
#
# PYTHON picks the interpreter and so the Megatron-Core (pyproject.toml's markers): 0.16.1 below
# Python 3.12, 0.19 from 3.12 on (.ci/compat builds that one).
# GPU users keep their own environment (their CUDA torch) and skip this: `make run PYTHON=python`.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
base_python="${2:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
  "$base_python" -m venv "$venv"
fi
python="$venv/bin/python"
"$python" -m pip install -q --upgrade pip
# CPU machines: the pinned CPU wheel first, so that nothing pulls a CUDA build of torch. (Where no
# CPU wheel of this torch lies on disk for the interpreter, pip takes PyPI's: PyPI has only the
# default build, CUDA libraries included, about 4 GB; it runs on the CPU all the same.)
"$python" -m pip install -q "torch==2.13.0"
DS_BUILD_OPS=0 "$python" -m pip install -q -e ".[test]"
"$python" -m pip check
