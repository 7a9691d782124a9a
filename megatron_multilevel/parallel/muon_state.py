"""DeepSpeed's Muon state (``MuonWithAuxAdam``) in each ZeRO stage: which parameters keep which key,
where it lives, and how a full tensor of it is read and written.

A parameter DeepSpeed tagged ``use_muon`` keeps Muon's ``momentum_buffer``; the others its auxiliary
Adam's ``exp_avg`` and ``exp_avg_sq`` (``config.muon``); a parameter of any other optimizer has no
tag and keeps every key of its optimizer (:func:`carries_state`). Where the state lives:

- ZeRO 0: per parameter, in the optimizer's ``state``, as torch keeps it;
- ZeRO 3: the momentum of a Muon sub-group in the same flat partitions as Adam's moments, reached
  through ``safe_get_full_optimizer_state`` like theirs;
- ZeRO 1/2: the Adam groups' moments in the flat partitions, reached through the parameters'
  ``_hp_mapping``; a Muon group's momentum in a buffer of its own on each rank, the *whole*
  matrices that overlap that rank's partition one after the other (``params_in_partition``: a
  matrix split between two partitions is held whole by both, which step it alike). Read here from
  the first data-parallel rank holding the matrix, written by every rank holding it
  (:func:`read_momentum`, :func:`write_momentum`).

Optimizer state is created lazily by DeepSpeed; :func:`materialize_muon_state` creates Muon's,
in DeepSpeed's own layout, so that it can be written before the first step.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_multilevel.config.muon import AUX_ADAM_STATE_KEYS, MUON_STATE_KEYS


def carries_state(p, key: Optional[str]) -> bool:
    """Whether the parameter ``p`` keeps the optimizer state ``key`` (``None``: the parameter itself)."""
    use_muon = getattr(p, "use_muon", None)
    if key is None or use_muon is None:
        return True
    return key in (MUON_STATE_KEYS if use_muon else AUX_ADAM_STATE_KEYS)


def _zero12_momentum(optimizer, p) -> tuple[int, Optional[torch.Tensor]]:
    """The parameter group of ``p`` (a Muon matrix under ZeRO 1/2) and the view of this rank's
    momentum buffer that holds it whole (``None`` where this rank's partition does not overlap it)."""
    inner = optimizer.optimizer
    for i, group in enumerate(optimizer.bit16_groups):
        if any(q is p for q in group):
            break
    else:
        raise AssertionError("the parameter is not one of the optimizer's")
    offset = 0
    for q in optimizer.params_in_partition[i]:
        if q is p:
            buffer = inner.state[inner.param_groups[i]["params"][0]]["momentum_buffer"]
            return i, buffer.narrow(0, offset, p.numel()).view(p.shape)
        offset += q.numel()
    return i, None


def is_zero12_momentum(p, key: Optional[str], optimizer) -> bool:
    """Whether ``key`` of ``p`` is a Muon momentum in ZeRO 1/2's buffer of whole matrices."""
    muon = bool(getattr(p, "use_muon", False))
    return key == "momentum_buffer" and muon and hasattr(optimizer, "params_in_partition")


def read_momentum(optimizer, p) -> torch.Tensor:
    """The full momentum of the Muon matrix ``p`` under ZeRO 1/2, on every data-parallel rank (fp32)."""
    _, mine = _zero12_momentum(optimizer, p)
    group = p._dp_group
    world = dist.get_world_size(group)
    owner = torch.tensor([dist.get_rank(group) if mine is not None else world])
    dist.all_reduce(owner, op=dist.ReduceOp.MIN, group=group)
    assert int(owner) < world, "some data-parallel rank holds every matrix"
    value = mine.float().clone() if mine is not None else torch.empty(p.shape, dtype=torch.float32, device=p.device)
    if world > 1:
        dist.broadcast(value, group=group, group_src=int(owner))
    return value


def write_momentum(optimizer, p, value: torch.Tensor) -> None:
    """Store the full momentum ``value`` of the Muon matrix ``p`` under ZeRO 1/2 on every rank that
    holds it (nothing is communicated)."""
    _, mine = _zero12_momentum(optimizer, p)
    if mine is not None:
        mine.copy_(value.reshape(p.shape))


def full_state(p, key: str, optimizer) -> torch.Tensor:
    """The full optimizer state ``key`` of ``p`` (this rank's TP shard) under ZeRO 1-3."""
    if is_zero12_momentum(p, key, optimizer):
        return read_momentum(optimizer, p)
    from deepspeed.utils import safe_get_full_optimizer_state

    return safe_get_full_optimizer_state(p, key)


def set_full_state(p, value: torch.Tensor, key: str, optimizer) -> None:
    """Store the full optimizer state ``key`` of ``p`` (this rank's TP shard) under ZeRO 1-3."""
    if is_zero12_momentum(p, key, optimizer):
        write_momentum(optimizer, p, value)
        return
    from deepspeed.utils import safe_set_full_optimizer_state

    safe_set_full_optimizer_state(p, value, key)


def _zero_adam_state(state: dict, like: torch.Tensor) -> None:
    if not state:
        state["step"] = torch.tensor(0.0)
        for key in AUX_ADAM_STATE_KEYS:
            state[key] = torch.zeros_like(like, memory_format=torch.preserve_format)


def materialize_muon_state(optimizer, inner) -> bool:
    """Create Muon's state (zeros; the auxiliary Adam's step 0) wherever it has none yet, in the
    layout DeepSpeed keeps it in; ``False`` (and nothing done) when ``inner``, the optimizer
    DeepSpeed wraps, is not Muon."""
    if not any("use_muon" in group for group in inner.param_groups):
        return False
    if hasattr(optimizer, "sub_groups_using_muon"):  # ZeRO 3: one flat partition per sub-group
        for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
            if not optimizer.sub_groups_using_muon[i]:
                _zero_adam_state(inner.state[flat], flat)
            elif "momentum_buffer" not in inner.state.get(flat, {}):
                optimizer._create_momentum_buffer(optimizer.fp16_partitioned_groups_flat_numel[i], i, flat.ds_id)
        return True
    for i, group in enumerate(inner.param_groups):
        for p in group["params"]:
            if not group["use_muon"]:
                _zero_adam_state(inner.state[p], p)
            elif hasattr(optimizer, "params_in_partition"):  # ZeRO 1/2: whole matrices per rank
                optimizer._muon_momentum_buffer(optimizer.params_in_partition[i], i, torch.float32, p.device)
            elif "momentum_buffer" not in inner.state[p]:
                assert p.dim() >= 2, "Muon without ZeRO steps the matrices themselves"
                inner.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True
