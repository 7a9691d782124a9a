"""First-order coherence (the MG/OPT tau correction) on live, distributed models.

At restriction the trainer computes ``v = P^T grad L_fine(theta) - grad L_coarse(R theta)`` on one
global batch (:func:`step_gradients` on each model, the restriction of the fine gradient being the
adjoint of the prolongation, the pure ``ode_operators.restrict_gradient``) and installs a
:class:`CoherenceHook` that adds ``v`` to every gradient of the coarse model for the rest of its phase. Every rank holds ``v`` for its own
tensor-parallel shards (whole over data-parallel ranks, ZeRO-3 included); on disk it is kept as
full tensors beside the checkpoints of the coarse phase, so that a resume at another layout reads it.
"""

import functools
import os
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.parallel.tp_layout import partition_dim, shard, unshard
from megatron_multilevel.plan import parameter_plan

FILE = "coherence.pt"


def step_gradients(module: torch.nn.Module, micro_loss: Callable[[int], torch.Tensor],
                   accumulation: int) -> dict[str, torch.Tensor]:
    """The gradient of one training step's loss (the mean of ``accumulation`` micro-batch losses,
    averaged over the data-parallel ranks), per parameter, for this rank's shards, in fp32.

    ``torch.autograd.grad`` leaves ``.grad`` and DeepSpeed's gradient hooks alone, so the engine
    that owns ``module`` is not disturbed. Each micro-batch's loss is divided by ``accumulation``
    before the backward pass, as DeepSpeed does (a :class:`CoherenceHook` sees what it would see).
    """
    from megatron.core import parallel_state

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    total: dict[str, torch.Tensor] = {}
    for micro in range(accumulation):
        grads = torch.autograd.grad(micro_loss(micro) / accumulation, [p for _, p in params], allow_unused=True)
        for (name, p), g in zip(params, grads):
            shape = tuple(p.ds_shape) if hasattr(p, "ds_id") else tuple(p.shape)  # ZeRO-3: the whole shape
            g = torch.zeros(shape, device=p.device) if g is None else g.float()
            total[name] = g if name not in total else total[name] + g
    group = parallel_state.get_data_parallel_group()
    size = parallel_state.get_data_parallel_world_size()
    for g in total.values():
        dist.all_reduce(g, group=group)
        g.div_(size)
    return total


def global_dots(pairs: Sequence[tuple[dict, dict]], cfg: ModelConfig) -> list[float]:
    """``<a, b>`` over the whole model for each pair of per-parameter tensors held as this rank's
    tensor-parallel shards of the current layout (whole over data-parallel ranks): a partitioned
    tensor's products summed over the TP group, a replicated one counted once (collective)."""
    return _reduce([(k, name, t, b[name]) for k, (a, b) in enumerate(pairs) for name, t in a.items()],
                   len(pairs), cfg)


def _reduce(products, count: int, cfg: ModelConfig) -> list[float]:
    """Sum the products of ``(k, name, a, b)`` items (an iterable, consumed once) into ``count``
    global dot products."""
    from megatron.core import parallel_state as ps

    plan = parameter_plan(cfg)
    tp = ps.get_tensor_model_parallel_world_size()
    sums = None  # [split, whole] x count, on the tensors' device (NCCL reduces device tensors)
    for k, name, a, b in products:
        if sums is None:
            sums = torch.zeros(2, count, dtype=torch.float64, device=a.device)
        split = tp > 1 and partition_dim(plan.rule(name)[1]) is not None
        sums[0 if split else 1, k] += torch.dot(a.double().flatten(), b.to(a.device).double().flatten())
    assert sums is not None, "no tensors to multiply"
    if tp > 1:
        dist.all_reduce(sums[0], group=ps.get_tensor_model_parallel_group())
    return sums.sum(0).tolist()


def statistics(restricted_fine: dict[str, torch.Tensor], coarse: dict[str, torch.Tensor],
               cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``v = P^T grad L_fine - grad L_coarse`` and how well the coarse model models the fine one at
    the restricted point: the global norms of the three, the cosine of the two gradients, and
    ``rho = |v| / |P^T grad L_fine|`` (0 where both vanish; collective). ``rho`` small: the coarse
    gradient nearly is the restricted fine one, and ``v`` a small correction; ``rho`` above 1: ``v``
    outweighs the fine gradient it is meant to restore, cancelling the coarse model's own slope."""
    v = {name: restricted_fine[name] - g for name, g in coarse.items()}
    ff, cc, fc, vv = global_dots([(restricted_fine, restricted_fine), (coarse, coarse), (restricted_fine, coarse),
                                  (v, v)], cfg)
    fine_norm, coarse_norm, v_norm = (max(x, 0.0) ** 0.5 for x in (ff, cc, vv))
    cosine = fc / (fine_norm * coarse_norm) if fine_norm * coarse_norm > 0 else 0.0
    rho = v_norm / fine_norm if fine_norm > 0 else (0.0 if v_norm == 0 else float("inf"))
    return v, {"fine_grad_norm": fine_norm, "coarse_grad_norm": coarse_norm, "v_norm": v_norm, "cosine": cosine,
               "rho": rho}


def installs(stats: dict[str, float], max_ratio: "float | None") -> bool:
    """The gate: whether the term goes in, given the restriction's :func:`statistics` and
    ``multilevel.ode.coherence_max_ratio`` (None: always)."""
    return max_ratio is None or stats["rho"] <= max_ratio


def parameter_dot(v: dict[str, torch.Tensor], module: torch.nn.Module, cfg: ModelConfig) -> float:
    """``<v, theta>`` for the parameters ``theta`` of ``module`` (a coarse model in the layout ``v``
    is held in; under ZeRO-3 each parameter gathered in turn; collective)."""
    from megatron_multilevel.parallel.streams import Groups, ModelReader

    reader = ModelReader(module, cfg, Groups.current(), local=True)
    return _reduce(((0, name, t, reader.read_model([name])[name]) for name, t in v.items()), 1, cfg)[0]


def _add(grad: torch.Tensor, *, v: torch.Tensor) -> torch.Tensor:
    return grad + v.to(grad.dtype)


class CoherenceHook:
    """Adds ``v[name]`` to every gradient of the parameter ``name`` of ``module``.

    DeepSpeed divides each micro-batch's loss by the number of accumulation steps, so each
    micro-batch gets that share of ``v``.
    """

    def __init__(self, module: torch.nn.Module, v: dict[str, torch.Tensor], accumulation: int):
        params = dict(module.named_parameters())
        assert set(v) == {n for n, p in params.items() if p.requires_grad}, sorted(set(v) ^ set(params))
        self.v = v
        self.handles = [params[name].register_hook(functools.partial(_add, v=t / accumulation))
                        for name, t in v.items()]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def save(v: dict[str, torch.Tensor], cfg: ModelConfig, directory: str) -> None:
    """Write ``v`` as full tensors into ``directory`` (collective; rank 0 writes)."""
    from megatron.core import parallel_state as ps

    plan = parameter_plan(cfg)
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    full = {}
    for name, t in v.items():
        rule = plan.rule(name)[1]
        if tp > 1 and partition_dim(rule) is not None:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=group)
            t = unshard(shards, rule)
        full[name] = t.cpu()
    if dist.get_rank() == 0:
        path = os.path.join(directory, FILE)
        torch.save(full, path + ".tmp")
        os.replace(path + ".tmp", path)


def load(directory: str, cfg: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's shards of the ``v`` saved in ``directory``."""
    from megatron.core import parallel_state as ps

    path = os.path.join(directory, FILE)
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {directory} of a coarse phase with coherence lacks {FILE}")
    plan = parameter_plan(cfg)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    full = torch.load(path, map_location="cpu", weights_only=True)
    return {name: shard(t, plan.rule(name)[1], rank, tp).contiguous().to(device) for name, t in full.items()}
