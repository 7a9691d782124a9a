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

The choice is one per run, beside Megatron's ``parallel_state`` (which holds the TP size):
``LevelEngines`` sets it once (:func:`set_sequence_parallel`), and every model built afterwards,
a level's first model or one a transition builds, resolves it against the TP size of the layout
it is built in (:func:`sequence_parallel_active`) and carries its hooks from construction.
"""

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

_setting: Optional[bool] = None  # parallel.sequence_parallel of this process's run (None: auto)


def set_sequence_parallel(setting: Optional[bool]) -> Optional[bool]:
    """Set this process's ``parallel.sequence_parallel`` (None: auto); returns the previous one."""
    global _setting
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(
            f"parallel.sequence_parallel = {setting!r}; valid choices are [null, true, false]"
        )
    previous, _setting = _setting, setting
    return previous


def resolve_sequence_parallel(setting: Optional[bool], tensor_model_parallel_size: int, kind: str) -> bool:
    """Whether a level of ``kind`` ("gpt", "bert") at this TP size runs sequence-parallel.

    Off at TP 1 (Megatron needs TP > 1); ``None`` (auto) turns it on where CUDA is available
    and the model supports it; ``True`` turns it on at every TP > 1."""
    if setting is False or tensor_model_parallel_size == 1:
        return False
    if setting is None:
        return torch.cuda.is_available() and sequence_parallel_supported(kind)
    return True


def sequence_parallel_active(kind: str) -> bool:
    """Whether a model of ``kind`` built now (in the current parallel layout) runs sequence-parallel."""
    from megatron.core import parallel_state

    return resolve_sequence_parallel(_setting, parallel_state.get_tensor_model_parallel_world_size(), kind)


def sequence_parallel_supported(kind: str) -> bool:
    """GPT everywhere (:class:`SequenceParallelTorchNorm` stands in for Megatron's torch norm);
    BERT only with Apex's fused norm, since Megatron's BERT LM head builds its norm itself and its
    torch fallback rejects sequence parallelism."""
    if kind == "gpt":
        return True
    from megatron.core.fusions.fused_layer_norm import HAVE_FUSED_LAYER_NORM

    return bool(HAVE_FUSED_LAYER_NORM)


def check_sequence_parallel_supported(kind: str) -> None:
    if not sequence_parallel_supported(kind):
        raise ValueError(
            f"parallel.sequence_parallel = true: Megatron-Core's BERT LM head needs Apex's fused "
            f"norm for sequence parallelism (its torch norm rejects it), and Apex is not installed "
            f"here (as on every CPU machine); valid choices for model.kind = {kind!r} here are "
            f"[null, false]"
        )


class SequenceParallelTorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch ``LayerNorm`` / ``RMSNorm``, the local layer spec's
    norm without Apex) that also runs under sequence parallelism: a norm acts on each token alone,
    so on a sequence shard it is the same module; its parameters are marked ``sequence_parallel``
    as Megatron's fused norms mark theirs. Parameter names stay ``weight`` / ``bias``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return norm


def local_spec_with_sequence_parallel_norms(layer_spec, num_layers: int):
    """The block spec of ``num_layers`` layers of the local ``layer_spec`` and a final norm, with
    :class:`SequenceParallelTorchNorm` wherever Megatron would build its torch norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    layer_spec = _replace_module(layer_spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    final_norm = SequenceParallelTorchNorm if LayerNormImpl is WrappedTorchNorm else LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=final_norm)


def _replace_module(spec, old: type, new: type):
    """``spec`` (a ModuleSpec, a submodules dataclass or a module class) with ``old`` replaced by ``new``."""
    if spec is old:
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _replace_module(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not getattr(spec, k)})
    return spec


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
