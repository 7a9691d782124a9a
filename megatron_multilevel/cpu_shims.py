"""Make Megatron-Core run on a machine without CUDA.

Megatron-Core (0.16 and 0.19 alike) hard-codes CUDA in six places that a CPU run reaches:
1. ``torch.cuda.current_device()`` is the ``device=`` of about twenty allocations
   (attention's global memory buffer, TP mappings, layers, GPTModel);
2. its RNG tracker (forked by attention even with dropout 0) reads and writes the CUDA
   generator through ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` and
   ``torch.cuda.manual_seed``;
3. ``get_default_causal_mask`` builds its mask on ``"cuda"`` when no mask is passed;
4. ``dist_checkpointing.save`` waits for the device (``torch.cuda.synchronize``) after copying
   tensors to the host, which on a CPU has nothing to wait for;
5. the pipeline schedules count tokens in ``torch.zeros([], device="cuda")``;
6. under pipeline parallelism with tied embeddings, the last stage's copy of the word embedding
   is moved to the GPU (``weight.data.cuda()``) before the all-reduce that initialises it.

Each is redirected to the CPU, only when CUDA is absent, so that a GPU run is untouched.
No library offers this; the patch is kept to exactly these six points.
"""

import functools

import torch

_applied = False


def apply_cpu_shims() -> bool:
    """Apply the CPU shims once if CUDA is unavailable; return whether they are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True

    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils

    # 1. Allocations that name the current CUDA device land on the CPU.
    torch.cuda.current_device = lambda: "cpu"

    # 2. The "CUDA" RNG tracker forks the CPU generator instead.
    def get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_rng_state
    mcore_random._set_cuda_rng_state = set_rng_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = torch.manual_seed

    # 3. The default causal mask is built on the CPU (cached: it depends only on the length).
    @functools.lru_cache(maxsize=8)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    transformer_utils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask

    # 4. No device to wait for.
    torch.cuda.synchronize = lambda device=None: None

    # 5. The schedules' "cuda" allocations land on the CPU: they see torch through a view whose
    # zeros() does (the module's only literal device).
    schedules.torch = _TorchOnCpu()

    # 6. A tensor asked onto the GPU stays where it is (there is none).
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    _applied = True
    return True


class _TorchOnCpu:
    """``torch``, except that ``zeros(..., device="cuda")`` allocates on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
