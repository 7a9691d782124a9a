"""Megatron's sequence parallelism (``parallel.sequence_parallel``) under DeepSpeed.

With sequence parallelism on, the activations between the tensor-parallel regions (norms,
dropout, residual adds) are split along the sequence over the tensor-parallel ranks instead of
replicated: activation memory there falls by the TP size. Megatron then marks the parameters that
act on a sequence shard (norm weights and biases, row-parallel biases, BERT's LM-head dense) with
``sequence_parallel = True``: each rank's gradient of them covers its own shard only, and the full
gradient is their sum over the tensor-parallel group. Megatron sums them in its own DDP's
``finalize_model_grads``, which DeepSpeed never calls; here a tensor hook on each marked parameter
sums its gradient over the TP group as autograd produces it, before DeepSpeed's accumulation hooks
see it (any ZeRO stage, any number of micro-batches). Tensor hooks also fire under
``torch.autograd.grad`` and run in the order they were registered: the coherence step gradients
(``parallel/coherence.py``) are the summed ones, and its hook, registered later, adds its term to
the sum.

The choice is one per run and level (``RunConfig.level_sequence_parallel``): ``LevelEngines``
passes it to ``models.build_model``, which builds the model with Megatron's sequence parallelism and
the norms that support it, then adds these hooks to every model it builds for such a level, a
level's first model or the empty target of a transition.
"""

import torch
import torch.distributed as dist


def register_sequence_parallel_grad_hooks(model: torch.nn.Module) -> int:
    """Sum the gradient of every parameter Megatron marks ``sequence_parallel`` over the current
    tensor-parallel group, as autograd delivers it; returns how many parameters got a hook."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    count = 0
    for p in model.parameters():
        if p.requires_grad and getattr(p, "sequence_parallel", False) and not has_sequence_parallel_grad_hook(p):
            p._sequence_parallel_grad_hook = p.register_hook(_all_reduce_over(group))
            count += 1
    return count


def has_sequence_parallel_grad_hook(p: torch.Tensor) -> bool:
    return getattr(p, "_sequence_parallel_grad_hook", None) is not None


def _all_reduce_over(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # This rank's gradient covers its sequence shard: the sum over the TP group is the full one.
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook
