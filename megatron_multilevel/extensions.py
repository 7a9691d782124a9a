"""Where DeepSpeed compiles the ops it builds at run time (torch's JIT extensions folder), and the
line that says so before the first build.

One folder for the launcher, ``make`` and every tool: ``TORCH_EXTENSIONS_DIR`` where it is set,
else ``.cache/torch_extensions`` under the repository (``launch/pretrain_vcycle.sh`` and the
Makefile export the same). :func:`use_extensions_dir` sets it in every process that initialises
DeepSpeed (``distributed.init_deepspeed_comm``); without it, a tool run after ``make run``
compiled DeepSpeed's CPU communication op again into torch's default folder under $HOME (about
100 s on 2 cores).
"""

import os
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
# DeepSpeed's CPU communication op (deepspeed/ops/op_builder/cpu/comm.py, ShareMemCommBuilder.NAME):
# every CPU process loads it, and torch's cpp_extension.load builds it into <folder>/<name>/<name>.so
SHM_COMM_OP = "deepspeed_shm_comm"


def default_extensions_dir() -> Optional[str]:
    """``.cache/torch_extensions`` under the repository where the package runs from a checkout (an
    editable install); None where it is installed elsewhere (torch's own default then)."""
    if (ROOT / "pyproject.toml").is_file():
        return str(ROOT / ".cache" / "torch_extensions")
    return None


def extensions_dir() -> str:
    """The folder DeepSpeed builds its ops in: ``TORCH_EXTENSIONS_DIR``, else :func:`default_extensions_dir`,
    else torch's default."""
    folder = os.environ.get("TORCH_EXTENSIONS_DIR") or default_extensions_dir()
    if folder:
        return folder
    from torch.utils.cpp_extension import get_default_build_root

    return get_default_build_root()


def use_extensions_dir() -> str:
    """Set ``TORCH_EXTENSIONS_DIR`` to :func:`default_extensions_dir` unless it is set, before
    DeepSpeed builds or loads an op; return the folder it builds in."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR") and default_extensions_dir():
        os.environ["TORCH_EXTENSIONS_DIR"] = default_extensions_dir()
    return extensions_dir()


def first_build_notice() -> Optional[str]:
    """One line saying that DeepSpeed compiles its CPU communication op now, where a CPU process is
    about to and it is not yet built in the extensions folder; None otherwise (built, or on GPU,
    where DeepSpeed builds no such op)."""
    accelerator = os.environ.get("DS_ACCELERATOR")
    if accelerator is None:
        import torch

        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator != "cpu":
        return None
    folder = extensions_dir()
    if os.path.isfile(os.path.join(folder, SHM_COMM_OP, f"{SHM_COMM_OP}.so")):
        return None
    return (f"DeepSpeed compiles its CPU communication op ({SHM_COMM_OP}) into {folder} the first time: "
            f"about 1-2 minutes on 2 cores, once")
