"""Run a function on N gloo ranks (file rendezvous, no port races) and collect what each returns.

Ranks are forked from a fork server that has imported torch, Megatron-Core and DeepSpeed once,
so a spawn costs well under a second after the first; still, put several checks in one spawn.
"""

import multiprocessing as mp
import os
import traceback
from pathlib import Path

import torch

_PRELOAD = ["torch", "deepspeed", "megatron.core", "megatron_multilevel.parallel.transition"]
_context = None


def _ctx():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _entry(fn, rank, world_size, workdir, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    out = Path(workdir) / f"rank{rank}.pt"
    try:
        import warnings

        warnings.filterwarnings("ignore")
        from megatron_multilevel.distributed import init_distributed

        init_distributed(1, init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise


def run_ranks(fn, world_size: int, workdir, *args, timeout: float = 600):
    """``fn(rank, world_size, *args)`` on every rank; returns the list of results by rank."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = _ctx()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(workdir), args)) for r in range(world_size)]
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
    return results
