"""Read and write a parameter's values, or its optimizer state's, under DeepSpeed ZeRO stages 0-3.

ZeRO-3 keeps each parameter (and its fp32 master and moments) as equal flat partitions over the
data-parallel ranks (:func:`gather_range`, :func:`write_range`, :func:`write_zero3_partition`);
ZeRO-1/2 and the bf16 optimizer keep the fp32 master and moments as one fragment of a flat buffer
per rank, reached through the parameter's ``_hp_mapping`` (:func:`fragment_range`,
:func:`write_fragment_range`). Optimizer state is created lazily by torch and DeepSpeed;
:func:`materialize_optimizer_state` creates it so that it can be written before the first step.
"""

from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.parallel.muon_state import materialize_muon_state

StateKey = Optional[Literal["exp_avg", "exp_avg_sq", "momentum_buffer"]]


def gather_range(part: torch.Tensor, group, start: int, stop: int, device=None) -> torch.Tensor:
    """Elements ``[start, stop)`` of a flat tensor kept as equal partitions over ``group`` (rank
    ``r`` holds ``[r * P, (r + 1) * P)`` in ``part``), on every rank: each rank whose partition
    overlaps the range broadcasts its piece."""
    size = part.numel()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = torch.empty(stop - start, dtype=part.dtype, device=part.device if device is None else device)
    for owner in range(start // size, min(world, -(-stop // size))):
        lo, hi = max(start, owner * size), min(stop, (owner + 1) * size)
        piece = out[lo - start : hi - start]
        if owner == rank:
            piece.copy_(part[lo - owner * size : hi - owner * size])
        if world > 1:
            dist.broadcast(piece, group=group, group_src=owner)
    return out


def write_range(part: torch.Tensor, group, start: int, values: torch.Tensor, numel: int) -> None:
    """Store this rank's overlap of elements ``[start, start + len(values))`` of a flat tensor of
    ``numel`` elements in its partition ``part`` (the partitioning of :func:`gather_range`); the
    range that ends the tensor also zeroes the padding. Nothing is communicated."""
    size = part.numel()
    first = size * dist.get_rank(group)
    stop = start + values.numel()
    lo, hi = max(start, first), min(stop, first + size)
    if lo < hi:
        part[lo - first : hi - first].copy_(values[lo - start : hi - start])
    if stop == numel:
        part[max(0, numel - first) :].zero_()


def fragment_range(p, key: StateKey, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flat fp32 master (or moment ``key``) of a ZeRO-1/2 or bf16
    parameter: each rank adds its fragment's overlap, as DeepSpeed's full gather does."""
    assert key != "momentum_buffer" or not getattr(p, "use_muon", False), "Muon's matrices move whole"
    out = torch.zeros(stop - start, dtype=torch.float32, device=p.device)
    mapping = p._hp_mapping
    if mapping is not None:
        address = mapping.lp_fragment_address
        lo, hi = max(start, address.start), min(stop, address.start + address.numel)
        if lo < hi:
            out[lo - start : hi - start].copy_(mapping.get_hp_fragment(key)[lo - address.start : hi - address.start])
    dist.all_reduce(out, group=p._dp_group)
    return out


def write_fragment_range(p, key: StateKey, start: int, values: torch.Tensor) -> None:
    """Store this rank's fragment's overlap of a range of a ZeRO-1/2 parameter's flat moment."""
    assert key != "momentum_buffer" or not getattr(p, "use_muon", False), "Muon's matrices move whole"
    mapping = p._hp_mapping
    if mapping is None:
        return
    address = mapping.lp_fragment_address
    lo, hi = max(start, address.start), min(start + values.numel(), address.start + address.numel)
    if lo < hi:
        mapping.get_hp_fragment(key)[lo - address.start : hi - address.start].copy_(values[lo - start : hi - start])


def local_shape(p) -> torch.Size:
    """The shape of this rank's tensor-parallel shard (whole over data-parallel ranks)."""
    return p.ds_shape if is_zero3(p) else p.shape


def inner_torch_optimizer(optimizer):
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def materialize_optimizer_state(optimizer, keys: Sequence[str]) -> None:
    """Create the state ``keys`` (zeros; Adam's also step 0) for every parameter that has none yet.

    Torch's Adam and SGD, and DeepSpeed's ZeRO optimizers around them, create their state lazily
    at the first step; moments can only be written into a state that exists. A zero state is what
    a fresh Adam starts from, and what SGD's momentum starts from without dampening. Muon's state
    is per parameter and in layouts of its own (``muon_state.materialize_muon_state``).
    """
    inner = inner_torch_optimizer(optimizer)
    if materialize_muon_state(optimizer, inner):
        link_optimizer_state(optimizer)
        return
    params = [p for group in inner.param_groups for p in group["params"]]
    # ZeRO-3 hands its flat fp32 partitions to the torch optimizer only during a step.
    params += list(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    adam = "exp_avg" in keys
    for p in params:
        state = inner.state[p]
        if not state:
            if adam:
                state["step"] = torch.tensor(0.0)
            for key in tuple(keys) + (("max_exp_avg_sq",) if adam and inner.defaults.get("amsgrad") else ()):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    link_optimizer_state(optimizer)


def link_optimizer_state(optimizer) -> None:
    """Link every parameter to its slice of the flat optimizer state (ZeRO-1/2, bf16 optimizer).

    DeepSpeed links them lazily, once, right after the first step of the first parameter group:
    the parameters of the other groups (no weight decay) stay linked to the empty state they had
    then, and reading or writing their moments through ``safe_get_full_optimizer_state`` fails.
    Linking again after the state exists fixes every group. Nothing to do for other optimizers."""
    if optimizer is not None and hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def write_zero3_partition(p, value: torch.Tensor) -> None:
    """Write this rank's ZeRO-3 partition of ``value`` into ``p.ds_tensor``.

    Every rank holds the same full value, so each keeps its own flat slice, as ZeRO-3's own
    partitioning does (``GatheredParameters(modifier_rank=...)`` would gather and broadcast the
    whole parameter only to end with the same slices).
    """
    assert getattr(p, "ds_secondary_tensor", None) is None, "hierarchical partitioning is not supported"
    assert p.ds_tensor.numel() * dist.get_world_size(group=p.ds_process_group) >= value.numel() == p.ds_numel
    # value: p.ds_shape -> (ds_numel,), of which this rank keeps its (P,) partition
    write_range(p.ds_tensor.data, p.ds_process_group, 0, value.reshape(-1), p.ds_numel)


def is_zero3(p) -> bool:
    return hasattr(p, "ds_id")


def partitioned_init(**kwargs):
    """``deepspeed.zero.Init(**kwargs)`` for a target model whose every partition a writer fills.

    Megatron creates each parameter whole (on the CPU left untouched: ``torch.empty``); zero.Init
    then broadcasts it from rank 0 before keeping each rank's partition, so every other rank writes,
    and holds for a moment, a whole word embedding. The values are overwritten anyway: this Init
    partitions without the broadcast.
    """
    import deepspeed

    if not hasattr(deepspeed.zero.Init, "_zero_init_param"):
        # a DeepSpeed whose Init no longer has this step: its own Init (correct, with the broadcast)
        return deepspeed.zero.Init(**kwargs)

    class _Init(deepspeed.zero.Init):
        def _zero_init_param(self, param):
            self._convert_to_deepspeed_param(param)
            param.partition()

    return _Init(**kwargs)
