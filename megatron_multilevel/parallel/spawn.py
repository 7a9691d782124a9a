"""Run a function on N local gloo/NCCL ranks (file rendezvous) and collect what each returns.

Used by tools that need a layout of several ranks on one machine (checkpoint verification,
resharding, benchmarks) and by the tests. ``fn`` must be importable (module level).
"""

import multiprocessing as mp
import os
import tempfile
import traceback
from pathlib import Path
from typing import Optional

import torch


def _entry(fn, rank, world_size, workdir, tensor_model_parallel_size, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    out = Path(workdir) / f"rank{rank}.pt"
    try:
        import warnings

        from megatron_multilevel.compat import quiet_library_notices

        quiet_library_notices()  # a new process: the libraries' known notices dropped here too
        warnings.filterwarnings("ignore")
        from megatron_multilevel.distributed import init_distributed, shutdown_distributed

        init_distributed(tensor_model_parallel_size, init_method=f"file://{workdir}/rendezvous", rank=rank,
                         world_size=world_size)
        torch.save({"ok": True, "result": fn(rank, world_size, *args)}, out)
        shutdown_distributed()  # as a run does: no gloo threads left to the interpreter's teardown
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise


def run_ranks(fn, world_size: int, *args, workdir: Optional[str] = None, tensor_model_parallel_size: int = 1,
              context: str = "spawn", timeout: float = 3600) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the results by rank."""
    owned = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="ranks-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context(context)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(workdir), tensor_model_parallel_size, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(world_size):
        path = workdir / f"rank{r}.pt"
        if not path.exists():
            raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
        data = torch.load(path, weights_only=False)
        if not data["ok"]:
            raise RuntimeError(f"rank {r} failed:\n{data['error']}")
        results.append(data["result"])
    if owned:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return results
