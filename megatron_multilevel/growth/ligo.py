"""LiGO's learned depth operator (Wang et al., ICLR 2023) for a level grown in depth.

Each layer ``l`` of the grown model holds, for every parameter ``p`` of a layer,
``sum_j C_p[l, j] B_p[j]``: the coarse layers' values ``B_p`` (as the copy growth placed them, in
the first layer of each depth group) combined by coefficients ``C_p`` (grown layers x coarse
layers, one matrix per parameter of a layer, as LiGO learns one depth operator per module). ``C``
starts at the copy growth: 1 where layer ``l`` is a copy of coarse layer ``j``, else 0, and 0 on
the residual-branch outputs of the second layer of a group under ``identity`` scaling, so that
before training the grown model is the copy growth bit for bit (the other terms are exact zeros).
``C`` is trained by Adam on the training loss for a number of steps with the weights fixed, then
the grown weights are written into the model, which trains as usual. LiGO also learns a width
operator; a level grown in width too is de-coalesced in width here, not learned.

Each rank holds its tensor-parallel shards of ``B``. A coefficient's gradient is the inner product
of its weight's gradient with ``B`` over every element, so the shards' partial sums are added over
the tensor-parallel group for the parameters split over it (and the sequence-parallel ones, whose
gradients are partial); replicated parameters give every rank the whole sum already. Gradients
are averaged over the data-parallel ranks, so every rank keeps the same ``C``. Memory: a copy of
the coarse layers' shards and one of the grown layers' in the autograd graph, beside the model.

Written here because no library provides it: LiGO's released code targets Hugging Face models
without tensor parallelism.
"""

from typing import Callable

import torch
import torch.distributed as dist

from megatron_multilevel.level_maps import LevelMap
from megatron_multilevel.operators import depth_groups
from megatron_multilevel.plan import is_metadata, layer_prefix, parameter_plan


def initial_coefficients(level_map: LevelMap, names) -> dict[str, torch.Tensor]:
    """``C_p`` of the copy growth of ``level_map`` (grown layers x coarse layers) for each layer
    parameter ``p`` in ``names`` (names local to a layer)."""
    groups = depth_groups(level_map)
    rules = parameter_plan(level_map.fine).layer
    identity = level_map.depth_scaling == "identity"
    out = {}
    for name in names:
        c = torch.zeros(level_map.fine.num_layers, len(groups))
        for j, members in enumerate(groups):
            c[members[0], j] = 1.0
            for second in members[1:]:  # ode scaling halves both members alike; identity zeroes the second's branch
                c[second, j] = 0.0 if identity and rules[name].residual else 1.0
        out[name] = c
    return out


def grown_weights(coefficients: dict, basis: dict, prefixes: list, dtypes: dict) -> dict[str, torch.Tensor]:
    """Every grown layer's parameters: ``sum_j C_p[l, j] B_p[j]``, by full name."""
    out = {}
    for name, c in coefficients.items():
        # C: (L, J), B: (J, *shape) -> (L, *shape)
        layers = torch.einsum("lj,j...->l...", c, basis[name])
        out.update({prefixes[layer] + name: layers[layer].to(dtypes[name]) for layer in range(len(prefixes))})
    return out


class _Grown(torch.nn.Module):
    """The model with its layers' parameters replaced by given tensors, for one forward pass."""

    def __init__(self, model: torch.nn.Module, weights: dict):
        super().__init__()
        self.model, self.weights = model, weights

    def forward(self, *args, **kwargs):
        return torch.func.functional_call(self.model, self.weights, args, kwargs, strict=False)


def learn_depth_operator(model: torch.nn.Module, level_map: LevelMap, batch: Callable[[int, int], object],
                         loss: Callable[[torch.nn.Module, object], torch.Tensor], *, steps: int, lr: float,
                         accumulation: int = 1, tp_group=None, dp_group=None) -> list[float]:
    """Train LiGO's depth operator of the grown ``model`` (the copy growth of ``level_map``, built
    in its layout, not yet in an engine) for ``steps`` steps on ``batch(step, micro)``, then write
    the grown weights into it. Returns the loss of every step (averaged over data-parallel ranks).
    Collective over both groups."""
    cfg = level_map.fine
    params = dict(model.named_parameters())
    prefixes = [layer_prefix(cfg, layer) for layer in range(cfg.num_layers)]
    names = [n[len(prefixes[0]):] for n in params if n.startswith(prefixes[0]) and not is_metadata(n)]
    first = [members[0] for members in depth_groups(level_map)]
    basis = {n: torch.stack([params[prefixes[layer] + n].detach().float() for layer in first]) for n in names}
    dtypes = {n: params[prefixes[0] + n].dtype for n in names}
    coefficients = {n: c.to(basis[n].device).requires_grad_() for n, c in initial_coefficients(level_map, names).items()}
    summed = [n for n in names if getattr(params[prefixes[0] + n], "tensor_model_parallel", False)
              or getattr(params[prefixes[0] + n], "sequence_parallel", False)]
    tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
    dp = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    optimizer = torch.optim.Adam(coefficients.values(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        total = torch.zeros(())
        for micro in range(accumulation):
            value = loss(_Grown(model, grown_weights(coefficients, basis, prefixes, dtypes)), batch(step, micro))
            (value / accumulation).backward()
            total += value.detach().float().cpu() / accumulation
        for name, c in coefficients.items():
            if tp > 1 and name in summed:
                dist.all_reduce(c.grad, group=tp_group)
            if dp > 1:
                dist.all_reduce(c.grad, group=dp_group)
                c.grad /= dp
        optimizer.step()
        if dp > 1:
            dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / dp)
    with torch.no_grad():
        for name, value in grown_weights(coefficients, basis, prefixes, dtypes).items():
            params[name].copy_(value)
    return losses
