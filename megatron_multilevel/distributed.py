"""Process groups: ``torch.distributed`` plus Megatron-Core's ``parallel_state``.

NCCL on GPU, gloo on CPU. Megatron needs both initialised even for a single process.
"""

import contextlib
import glob
import io
import os
import re
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_multilevel.cpu_shims import apply_cpu_shims
from megatron_multilevel.extensions import first_build_notice, use_extensions_dir


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    tensor_model_parallel_size: int = 1,
    *,
    seed: int = 1234,
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> None:
    """Initialise ``torch.distributed`` (if needed) and Megatron's model-parallel groups.

    Without arguments, rank and world size come from the launcher's environment
    (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``); a single process without a launcher
    gets a one-rank group.
    """
    apply_cpu_shims()
    if not dist.is_initialized():
        if rank is None:
            rank = int(os.environ.get("RANK", 0))
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", 1))
        # DeepSpeed reads these even when the process group already exists.
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(rank))
        if init_method is None and "MASTER_ADDR" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(
            backend=default_backend(), init_method=init_method, rank=rank, world_size=world_size
        )
        init_deepspeed_comm()
    set_tensor_model_parallel_size(tensor_model_parallel_size, seed=seed)


def _deepspeed_shm_segment(rank: int) -> str:
    """The name DeepSpeed's CPU shared-memory all-reduce gives a rank's segment (csrc/cpu/comm/shm.cpp)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def init_deepspeed_comm() -> None:
    """``deepspeed.comm`` over the existing process group, without the shared memory it leaks.

    On CPU, when every rank is local (``LOCAL_SIZE`` equals the world size, as DeepSpeed's launcher
    sets it), DeepSpeed 0.19 maps a 66 MiB ``/dev/shm`` segment per rank for its inference
    all-reduce and never unlinks it: each run leaves them behind, killed or not, and /dev/shm is
    RAM, so a day of runs or a test suite fills the machine's memory. Once every rank has mapped
    its peers' segments (``TorchBackend`` returns only then), each rank unlinks its own name: the
    mappings stay valid for the process's life and the memory is freed when it exits, however it
    exits. DeepSpeed offers no switch for this; training never uses that all-reduce.
    """
    import deepspeed

    use_extensions_dir()  # the launcher's folder of DeepSpeed's compiled ops, in a tool's process too
    cpu = not torch.cuda.is_available()
    if not cpu:
        deepspeed.init_distributed(dist_backend=default_backend())
        return
    clear_stale_extension_locks()  # DeepSpeed loads its CPU communication op below
    without_built_notice(lambda: deepspeed.init_distributed(dist_backend=default_backend()))  # the segments exist only with DeepSpeed's CPU accelerator
    if dist.get_world_size() > 1:
        dist.barrier()  # every peer has mapped this rank's segment
    segment = _deepspeed_shm_segment(dist.get_rank())
    if os.path.exists(segment):
        os.unlink(segment)


# DeepSpeed's print at every load of its CPU communication op, compiled or not (deepspeed/comm/torch.py)
BUILT_NOTICE = re.compile(r"DeepSpeed \S+ built successfully\n?")


def without_built_notice(load) -> None:
    """Call ``load`` with its standard output held back, then print it less ``BUILT_NOTICE`` lines:
    every rank of every run printed one, saying nothing a user can act on. DeepSpeed prints it with
    ``print``, so no logging filter reaches it."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            load()
    finally:
        sys.stdout.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                                 if not BUILT_NOTICE.fullmatch(line)))
        sys.stdout.flush()


STALE_LOCK_SECONDS = 600.0


def clear_stale_extension_locks(max_age: float = STALE_LOCK_SECONDS) -> list[str]:
    """Remove the build locks of torch's JIT extensions that a killed process left; return them.

    ``torch.utils.cpp_extension.load`` (with which DeepSpeed builds and loads its CPU communication
    op at every start) takes a ``lock`` file in the extension's build directory on every load, even
    when nothing needs building, and only the process that took it removes it. A run killed in that
    window leaves it behind, and every later run on the machine then waits on it forever, printing
    nothing. A load holds it for seconds and a build for about a minute, so a lock older than
    ``max_age`` seconds is stale. torch offers no switch for this.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    removed = []
    for path in glob.glob(os.path.join(root, "*", "lock")):
        try:
            if time.time() - os.path.getmtime(path) > max_age:
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:  # another rank removed it first
            pass
    for path in removed:
        print(f"warning: removed {path}, a build lock left by a killed process {max_age:.0f}+ s ago "
              f"(every run would have waited on it)", file=sys.stderr)
    return removed


def shutdown_distributed() -> None:
    """Destroy Megatron's parallel groups and every process group, before the interpreter exits.

    A process that exits with its groups alive leaves gloo's worker threads to be torn down with the
    interpreter, which now and then aborts a rank whose run had finished ("terminate called without
    an active exception", exit -6: pytorch/pytorch#190489); on GPU, NCCL warns of the same. torch
    does not destroy them at exit itself, so the run does, once every collective is done."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def init_single_process() -> None:
    """A one-rank process group for a tool's own process, unless one exists (file rendezvous: no
    port that another run could hold)."""
    if not dist.is_initialized():
        notice = first_build_notice()  # the launcher says it for a run; a tool, here
        if notice:
            print(notice, flush=True)
        init_distributed(1, init_method=f"file://{tempfile.mktemp(prefix='rdv-')}", rank=0, world_size=1)


def set_tensor_model_parallel_size(tensor_model_parallel_size: int, *, seed: int = 1234,
                                   pipeline_model_parallel_size: int = 1) -> None:
    """(Re)build Megatron's parallel groups for a tensor-parallel size (and a pipeline-parallel
    size); data parallelism takes the remaining ranks. Groups of an earlier layout stay usable by
    whoever captured them."""
    from megatron.core import parallel_state

    world_size = dist.get_world_size()
    if world_size % (tensor_model_parallel_size * pipeline_model_parallel_size):
        stages = f" x pipeline_model_parallel_size {pipeline_model_parallel_size}" * (pipeline_model_parallel_size > 1)
        raise ValueError(f"parallel.tensor_model_parallel_size = {tensor_model_parallel_size}{stages} does not "
                         f"divide the world size {world_size}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                             pipeline_model_parallel_size=pipeline_model_parallel_size)
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Seed the default generator and Megatron's model-parallel RNG tracker alike on every rank."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
