#!/usr/bin/env bash
# GPU validation in one command (see tools/gpu_check.py for what it checks and prints).
#
#   bash tools/gpu_check.sh             # on a GPU machine; under 8 minutes on one GPU
#   bash tools/gpu_check.sh --dry-run   # small shapes on the CPU
#
# Uses the Python that already has the project's dependencies (PYTHON, else python); without
# them it makes .venv-gpu beside the checkout, reusing the machine's own CUDA build of torch
# (system site packages), and installs the project into it.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-python}"
if ! "$python_bin" -c "import megatron.core, deepspeed, sentencepiece" 2>/dev/null; then
  if [ ! -x .venv-gpu/bin/python ]; then
    echo "setting up .venv-gpu (once) ..."
    python3 -m venv --system-site-packages .venv-gpu
    .venv-gpu/bin/python -m pip install -q --upgrade pip
    # keep the machine's torch; install it only where there is none
    .venv-gpu/bin/python -c "import torch" 2>/dev/null || .venv-gpu/bin/python -m pip install -q torch
    DS_BUILD_OPS=0 .venv-gpu/bin/python -m pip install -q -e ".[test]"
  fi
  python_bin=.venv-gpu/bin/python
  # its own environment, its own cache of DeepSpeed's compiled ops: a cache names ops, not the
  # Python or torch they were built for, so another environment's would be loaded and fail
  export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions-gpu"
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
export PYTHONUNBUFFERED=1
exec "$python_bin" tools/gpu_check.py "$@"
