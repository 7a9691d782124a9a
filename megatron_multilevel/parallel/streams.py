"""Read and write a level's parameters (or Adam moments) one layer at a time, in any layout.

A *reader* returns, per layer, the full tensors (general path: gathered over tensor-parallel
ranks and, under ZeRO-3, over data-parallel ranks) or this rank's tensor-parallel shards (fast
path). A *writer* takes the same and stores this rank's part: into a Megatron model (its TP shard;
under ZeRO-3 through ``GatheredParameters``), into DeepSpeed's optimizer state, or into a
:class:`Snapshot` (flat partitions spread over a process group, kept in memory, on the CPU or on
disk). No rank ever holds more than its own shards plus the layer being moved.

All methods are collective: every rank of the groups involved calls them in the same order.
"""

import math
import os
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.parallel.tp_layout import partition_dim, shard, unshard
from megatron_multilevel.plan import layer_prefix, parameter_plan

StateKey = Optional[Literal["exp_avg", "exp_avg_sq", "momentum_buffer"]]
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
Storage = Literal["memory", "cpu", "disk"]
STORAGES = ("memory", "cpu", "disk")


@dataclass(frozen=True)
class Groups:
    """The tensor-parallel group of this rank in one layout, captured so that it outlives a
    later change of Megatron's ``parallel_state``."""

    tp_group: object
    tp_rank: int
    tp_size: int

    @classmethod
    def current(cls) -> "Groups":
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )


def _split_names(names, cfg: ModelConfig) -> tuple[list[str], list[str]]:
    """Parameter names outside the layers (full names), and those of every layer (relative to the
    layer's prefix: every layer has the same), in a fixed order."""
    plan = parameter_plan(cfg)
    model, layers = [], [[] for _ in range(cfg.num_layers)]
    for name in names:
        layer, _ = plan.rule(name)
        (model if layer is None else layers[layer]).append(name)
    relative = [[n[len(layer_prefix(cfg, i)):] for n in names] for i, names in enumerate(layers)]
    assert all(r == relative[0] for r in relative), "every layer has the same parameters"
    return model, relative[0]


def _inner_torch_optimizer(optimizer):
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def materialize_adam_state(optimizer) -> None:
    """Create Adam's state (zero moments, step 0) for every parameter that has none yet."""
    materialize_optimizer_state(optimizer, ADAM_KEYS)


def materialize_optimizer_state(optimizer, keys: Sequence[str]) -> None:
    """Create the state ``keys`` (zeros; Adam's also step 0) for every parameter that has none yet.

    Torch's Adam and SGD, and DeepSpeed's ZeRO optimizers around them, create their state lazily
    at the first step; moments can only be written into a state that exists. A zero state is what
    a fresh Adam starts from, and what SGD's momentum starts from without dampening.
    """
    inner = _inner_torch_optimizer(optimizer)
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
    # ZeRO-1/2 and the bf16 optimizer link each parameter to its slice of the flat state lazily, once,
    # right after the first step of the first parameter group: link again, or the parameters of the
    # other groups (no weight decay) stay linked to the empty state they had then.
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _write_zero3_partition(p, value: torch.Tensor) -> None:
    """Write this rank's ZeRO-3 partition of ``value`` into ``p.ds_tensor``.

    Every rank holds the same full value, so each keeps its own flat slice, as ZeRO-3's own
    partitioning does (``GatheredParameters(modifier_rank=...)`` would gather and broadcast the
    whole parameter only to end with the same slices).
    """
    assert getattr(p, "ds_secondary_tensor", None) is None, "hierarchical partitioning is not supported"
    part = p.ds_tensor
    size = part.numel()
    start = size * dist.get_rank(group=p.ds_process_group)
    flat = value.reshape(-1)
    count = max(0, min(size, flat.numel() - start))
    assert size * dist.get_world_size(group=p.ds_process_group) >= flat.numel() == p.ds_numel
    part.data.zero_()
    if count:
        part.data[:count].copy_(flat[start : start + count])


def _owns_storage(t: torch.Tensor) -> bool:
    """A contiguous tensor that is not a view of another one."""
    return t._base is None and t.is_contiguous()


def _is_zero3(p) -> bool:
    return hasattr(p, "ds_id")


class _ModelStream:
    def __init__(self, module, cfg: ModelConfig, groups: Groups, *, local: bool = False,
                 optimizer=None, state_key: StateKey = None):
        self.params = dict(module.named_parameters())
        self.cfg, self.groups, self.local = cfg, groups, local
        self.optimizer, self.state_key = optimizer, state_key
        self.plan = parameter_plan(cfg)


class ModelReader(_ModelStream):
    """Reads a live Megatron model (plain or inside a DeepSpeed engine), layer by layer.

    ``state_key`` selects an Adam moment instead of the parameters; ``local`` returns this rank's
    tensor-parallel shards instead of full tensors.
    """

    def __init__(self, module, cfg: ModelConfig, groups: Groups, **kwargs):
        super().__init__(module, cfg, groups, **kwargs)
        self.model_names, self.layer_names = _split_names(self.params, cfg)

    def read_model(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {name: self._read(name) for name in names}

    def read_layer(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        prefix = layer_prefix(self.cfg, layer)
        return {name: self._read(prefix + name) for name in names}

    def _read(self, name: str) -> torch.Tensor:
        value = self._local_value(self.params[name])
        _, rule = self.plan.rule(name)
        g = self.groups
        if self.local or g.tp_size == 1 or partition_dim(rule) is None:
            return value
        shards = [torch.empty_like(value) for _ in range(g.tp_size)]
        dist.all_gather(shards, value.contiguous(), group=g.tp_group)
        return unshard(shards, rule)

    def _local_value(self, p) -> torch.Tensor:
        """This rank's tensor-parallel shard, whole over data-parallel ranks, in fp32 where the
        optimizer keeps fp32 masters."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.state_key is not None:
            if _is_zero3(p) or hasattr(p, "_hp_mapping"):
                return safe_get_full_optimizer_state(p, self.state_key)
            state = _inner_torch_optimizer(self.optimizer).state.get(p, {})
            value = state.get(self.state_key)
            return torch.zeros_like(p, dtype=torch.float32) if value is None else value.detach().float()
        if _is_zero3(p):
            if getattr(p, "_z3_optimizer", None) is not None:
                return safe_get_full_fp32_param(p)
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                return p.data.detach().clone()
        if p.dtype != torch.float32 and hasattr(p, "_hp_mapping"):
            return safe_get_full_fp32_param(p)  # the fp32 master, not the bf16 copy
        return p.detach()


class ModelWriter(_ModelStream):
    """Writes full tensors (or, with ``local``, this rank's shards) into a Megatron model built in
    the target layout, before ``deepspeed.initialize`` (so that the optimizer starts from them);
    with ``state_key``, into the Adam moments of an initialised engine instead."""

    def write_model(self, values: dict[str, torch.Tensor]) -> None:
        self._write(values)

    def write_layer(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        prefix = layer_prefix(self.cfg, layer)
        self._write({prefix + name: t for name, t in values.items()})

    def _target(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if self.local:
            return full
        _, rule = self.plan.rule(name)
        return shard(full, rule, self.groups.tp_rank, self.groups.tp_size)

    def _write(self, values: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(values) - set(self.params))
        assert not unknown, f"the target model has no parameters {unknown}"
        params = [(self.params[n], self._target(n, t)) for n, t in values.items()]
        for (p, v), name in zip(params, values):
            expected = tuple(p.ds_shape) if _is_zero3(p) else tuple(p.shape)
            assert tuple(v.shape) == expected, (name, tuple(v.shape), expected)
        if self.state_key is not None:
            self._write_state(params)
            return
        for p, _ in params:
            assert not hasattr(p, "_hp_mapping") and getattr(p, "_z3_optimizer", None) is None, (
                "parameters are written before deepspeed.initialize, so the optimizer starts from them"
            )
        with torch.no_grad():
            for p, v in params:
                if _is_zero3(p):
                    _write_zero3_partition(p, v)
                elif _owns_storage(v) and v.dtype == p.dtype and v.device == p.device:
                    p.data = v  # a fresh result of the operators: adopt it, do not copy it
                else:
                    p.data.copy_(v)

    def _write_state(self, params) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        torch_optimizer = _inner_torch_optimizer(self.optimizer)
        for p, v in params:
            if _is_zero3(p) or hasattr(p, "_hp_mapping"):
                safe_set_full_optimizer_state(p, v.float(), self.state_key)
            else:
                torch_optimizer.state[p][self.state_key].copy_(v)


class Snapshot:
    """A level's tensors kept for later (the fine model before coalescing, staged moments),
    each stored as flat equal partitions over the ranks of ``group``.

    With ``group`` the world and full tensors, the snapshot no longer depends on the layout it
    came from; with the data-parallel group and local shards, it serves the fast path.
    """

    def __init__(self, group=None, *, storage: Storage = "memory", directory: Optional[str] = None):
        if storage not in STORAGES:
            raise ValueError(f"invalid snapshot storage {storage!r}; valid choices are {list(STORAGES)}")
        if storage == "disk" and not directory:
            raise ValueError("a snapshot stored on disk needs a directory")
        self.group, self.storage, self.directory = group, storage, directory
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._parts: dict[tuple[str, str], torch.Tensor] = {}
        self._shapes: dict[tuple[str, str], tuple[torch.Size, torch.dtype]] = {}
        self.model_names: list[str] = []
        self.layer_names: list[str] = []

    def write_model(self, values: dict[str, torch.Tensor]) -> None:
        self._put("model", values, self.model_names)

    def write_layer(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        self._put(f"layer{layer}", values, self.layer_names)

    def read_model(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {name: self._get("model", name) for name in names}

    def read_layer(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {name: self._get(f"layer{layer}", name) for name in names}

    def _put(self, key: str, values: dict[str, torch.Tensor], names: list[str]) -> None:
        for name, t in values.items():
            if name not in names:
                names.append(name)
            flat = t.detach().reshape(-1)
            chunk = math.ceil(flat.numel() / self.size)
            device = t.device if self.storage == "memory" else torch.device("cpu")
            part = torch.zeros(chunk, dtype=t.dtype, device=device)
            mine = flat[self.rank * chunk : (self.rank + 1) * chunk]
            part[: mine.numel()].copy_(mine)
            self._shapes[key, name] = (t.shape, t.dtype)
            if self.storage == "disk":
                os.makedirs(self.directory, exist_ok=True)
                path = self._path(key, name)
                torch.save(part, path + ".tmp")
                os.replace(path + ".tmp", path)
            else:
                self._parts[key, name] = part

    def _path(self, key: str, name: str) -> str:
        return os.path.join(self.directory, f"{key}.{name}.rank{self.rank}.pt")

    def _get(self, key: str, name: str) -> torch.Tensor:
        shape, dtype = self._shapes[key, name]
        part = torch.load(self._path(key, name)) if self.storage == "disk" else self._parts[key, name]
        if torch.cuda.is_available():
            part = part.to(torch.device("cuda", torch.cuda.current_device()))
        if self.size > 1:
            gathered = part.new_empty(part.numel() * self.size)
            dist.all_gather_into_tensor(gathered, part, group=self.group)
            part = gathered
        return part[: math.prod(shape)].view(shape).to(dtype)

    def local_bytes(self) -> int:
        """Bytes this rank holds in memory (zero for a snapshot on disk)."""
        return sum(t.numel() * t.element_size() for t in self._parts.values())


class TensorsReader:
    """Full tensors held in memory (a consolidated checkpoint), behind the reader interface."""

    def __init__(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig):
        self.tensors, self.cfg = tensors, cfg
        self.model_names, self.layer_names = _split_names(tensors, cfg)

    def read_model(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name] for name in names}

    def read_layer(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        prefix = layer_prefix(self.cfg, layer)
        return {name: self.tensors[prefix + name] for name in names}
