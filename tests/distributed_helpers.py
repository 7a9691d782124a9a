"""Run a function on N gloo ranks for the tests.

Ranks are forked from a fork server that has imported torch, Megatron-Core and DeepSpeed once,
so a spawn costs well under a second after the first; still, put several checks in one spawn.
"""

import multiprocessing as mp

from megatron_multilevel.parallel import spawn

_PRELOAD = ["torch", "deepspeed", "megatron.core", "megatron_multilevel.parallel.transition"]
mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def run_ranks(fn, world_size: int, workdir, *args, timeout: float = 600):
    """``fn(rank, world_size, *args)`` on every rank; returns the list of results by rank."""
    return spawn.run_ranks(fn, world_size, *args, workdir=str(workdir), context="forkserver", timeout=timeout)
