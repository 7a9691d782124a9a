"""Where each parameter is split under Megatron tensor parallelism, from the parameter plan.

Pure tensor code (no communication). Column-parallel weights (QKV, FC1, embeddings, output
layer) are split on their output dim, row-parallel ones (attention projection, FC2) on their
input dim; everything else is replicated. SwiGLU's FC1 is ``[gate; up]`` in full, and rank ``r``
holds ``[gate_r; up_r]``, not a contiguous slice. The rule is derived from the plan, so it holds
for checkpoints as well as live models (a test checks it against Megatron's own
``partition_dim`` attributes).
"""

from typing import Optional, Sequence

import torch

from megatron_multilevel.plan import ParamRule

# Dimension kinds that Megatron splits over tensor-parallel ranks.
SPLIT_KINDS = ("vocab", "qkv", "heads", "ffn", "ffn_glu")


def partition_dim(rule: ParamRule) -> Optional[int]:
    """The dim this parameter is split on under tensor parallelism, or None if replicated."""
    for dim, d in enumerate(rule.dims):
        if d.kind in SPLIT_KINDS:
            return dim
    return None


def _is_stacked(rule: ParamRule, dim: int) -> bool:
    return rule.dims[dim].kind == "ffn_glu"


def shard(full: torch.Tensor, rule: ParamRule, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of a full tensor (a view where possible)."""
    dim = partition_dim(rule)
    if dim is None or tp == 1:
        return full
    if _is_stacked(rule, dim):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def unshard(shards: Sequence[torch.Tensor], rule: ParamRule) -> torch.Tensor:
    """The full tensor from all ranks' shards, in rank order."""
    dim = partition_dim(rule)
    if dim is None or len(shards) == 1:
        return shards[0]
    if _is_stacked(rule, dim):
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(list(shards), dim=dim)


def check_divisible(name: str, shape: Sequence[int], rule: ParamRule, tp: int) -> None:
    dim = partition_dim(rule)
    if dim is not None and shape[dim] % tp:
        raise ValueError(
            f"parameter {name!r} has {shape[dim]} entries on its tensor-parallel dim {dim}, "
            f"which tensor_model_parallel_size = {tp} does not divide"
        )
