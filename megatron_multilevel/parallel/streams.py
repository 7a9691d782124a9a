"""Read and write a level's parameters (or Adam moments) one layer at a time, in any layout.

A *reader* returns, per layer, the full tensors (general path: gathered over tensor-parallel
ranks and, under ZeRO-3, over data-parallel ranks) or this rank's tensor-parallel shards (fast
path). A *writer* takes the same and stores this rank's part: into a Megatron model (its TP shard;
under ZeRO-3 its own partition), or into DeepSpeed's optimizer state; a
:class:`~megatron_multilevel.parallel.snapshot.Snapshot` (flat partitions spread over a process
group, kept in memory, on the CPU or on disk) is written and read the same way. No rank ever holds more than its own shards plus the layer being moved. How one parameter's
values, or its optimizer state's, are read and written under each ZeRO stage (0-3) lives in
:mod:`megatron_multilevel.parallel.zero`; the readers and writers here are built on it.

The word embedding and the output layer (``[vocab, hidden]``) move in *slabs* of vocabulary rows
(:class:`Rows`, :func:`vocab_slabs`): their rows map independently, and a block of rows of the full
tensor is a contiguous range of its flat ZeRO partitions, so a rank gathers only that range (each
owner broadcasts its overlap) and keeps only its own overlap of what it writes. A slab is at most
one FFN weight matrix, so no vocabulary size makes a transition hold more than the layer stream does.

All methods are collective: every rank of the groups involved calls them in the same order.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.parallel.muon_state import carries_state, full_state, set_full_state
from megatron_multilevel.parallel.tp_layout import partition_dim, shard, unshard
from megatron_multilevel.parallel.zero import (
    StateKey,
    fragment_range,
    gather_range,
    inner_torch_optimizer,
    is_zero3,
    link_optimizer_state,
    local_shape,
    write_fragment_range,
    write_range,
    write_zero3_partition,
)
from megatron_multilevel.parallel.stages import TIED_OUTPUT, WORD_EMBEDDING, StageTable, global_name, layer_offset
from megatron_multilevel.plan import VOCAB, layer_prefix, parameter_plan


@dataclass(frozen=True)
class Groups:
    """The tensor-parallel group (and pipeline group) of this rank in one layout, captured so that
    it outlives a later change of Megatron's ``parallel_state``."""

    tp_group: object
    tp_rank: int
    tp_size: int
    pp_group: object = None
    pp_rank: int = 0
    pp_size: int = 1

    @classmethod
    def current(cls) -> "Groups":
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_group(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(),
        )


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, stop)`` (dim 0) of a tensor of ``num_rows`` rows."""

    start: int
    stop: int
    num_rows: int


def vocab_slab_rows(cfg: ModelConfig) -> int:
    """Vocabulary rows moved at a time: ``ffn_hidden_size`` rows of ``hidden_size``, the size of
    one FFN weight matrix of ``cfg`` (a third of a GPT layer, the largest tensor the layer stream
    moves at once)."""
    return max(1, cfg.ffn_hidden_size)


def vocab_slabs(reader, name: str, cfg: ModelConfig, *, whole: bool = False) -> list[Optional[Rows]]:
    """The blocks that parameter ``name`` (outside the layers, of a model of ``cfg``'s plan) moves
    in: slabs of :func:`vocab_slab_rows` rows where its dim 0 is the vocabulary, else (or with
    ``whole``) one block, ``None``, the whole tensor."""
    if whole or parameter_plan(cfg).model[name].dims[0] != VOCAB:
        return [None]
    num_rows, step = reader.num_rows(name), vocab_slab_rows(cfg)
    return [Rows(start, min(start + step, num_rows), num_rows) for start in range(0, num_rows, step)]


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


def _owns_storage(t: torch.Tensor) -> bool:
    """A contiguous tensor that is not a view of another one."""
    return t._base is None and t.is_contiguous()


class _ModelStream:
    """Parameters by their whole-model names. Under pipeline parallelism a rank holds its stage's
    (``stages``: who holds what); the last stage's copy of a tied word embedding is written with it."""

    def __init__(self, module, cfg: ModelConfig, groups: Groups, *, local: bool = False,
                 optimizer=None, state_key: StateKey = None):
        named = {name: p for name, p in module.named_parameters() if carries_state(p, state_key)}
        self.tied_copy = named.pop(TIED_OUTPUT, None) if cfg.share_embeddings_and_output_weights else None
        offset = layer_offset(module) if groups.pp_size > 1 else 0
        self.params = {global_name(name, offset): p for name, p in named.items()}
        self.cfg, self.groups, self.local = cfg, groups, local
        self.optimizer, self.state_key = optimizer, state_key
        self.plan = parameter_plan(cfg)
        if state_key is not None:
            link_optimizer_state(optimizer)
        self.stages = None if groups.pp_size == 1 else StageTable(
            groups.pp_group, groups.pp_rank, {name: (self._shape(name), self._dtype(p)) for name, p in self.params.items()})
        self.names = list(self.params) if self.stages is None else self.stages.names

    def _shape(self, name: str) -> tuple:
        """The shape a reader returns for ``name``: the full tensor's, or this rank's shard's."""
        shape = list(local_shape(self.params[name]))
        if self._tp_split(name):
            shape[partition_dim(self.plan.rule(name)[1])] *= self.groups.tp_size
        return tuple(shape)

    def _dtype(self, p) -> torch.dtype:
        """The dtype of :meth:`_local_value`: fp32 for moments and where the optimizer keeps fp32
        masters."""
        fp32_master = getattr(p, "_z3_optimizer", None) is not None if is_zero3(p) else hasattr(p, "_hp_mapping")
        return torch.float32 if self.state_key is not None or fp32_master else p.dtype

    def _targets(self, name: str) -> list:
        """This rank's parameters that hold ``name`` (none on another stage; two where a stage holds
        the word embedding and its tied copy)."""
        own = [self.params[name]] if name in self.params else []
        return own + ([self.tied_copy] if name == WORD_EMBEDDING and self.tied_copy is not None else [])

    def _tp_partitioned(self, name: str) -> bool:
        """Whether the model holds ``name`` as tensor-parallel shards."""
        _, rule = self.plan.rule(name)
        return self.groups.tp_size > 1 and partition_dim(rule) is not None

    def _tp_split(self, name: str) -> bool:
        """Whether the full tensor of ``name`` is split over the tensor-parallel ranks (assembled
        from their shards when read, sharded when written)."""
        return not self.local and self._tp_partitioned(name)


class ModelReader(_ModelStream):
    """Reads a live Megatron model (plain or inside a DeepSpeed engine), layer by layer.

    ``state_key`` selects an Adam moment instead of the parameters; ``local`` returns this rank's
    tensor-parallel shards instead of full tensors.
    """

    def __init__(self, module, cfg: ModelConfig, groups: Groups, **kwargs):
        super().__init__(module, cfg, groups, **kwargs)
        self.model_names, self.layer_names = _split_names(self.names, cfg)

    def read_model(self, names: Sequence[str], rows: Optional[Rows] = None) -> dict[str, torch.Tensor]:
        """The full tensors of ``names`` (or, with ``rows``, those rows of each)."""
        return {name: self._on_every_stage(name, rows) for name in names}

    def read_layer(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        prefix = layer_prefix(self.cfg, layer)
        return {name: self._on_every_stage(prefix + name) for name in names}

    def _on_every_stage(self, name: str, rows: Optional[Rows] = None) -> torch.Tensor:
        """Read by this rank, or under pipeline parallelism by the stage holding ``name`` and sent to
        every stage."""
        mine = self.stages is None or self.stages.is_mine(name)
        value = (self._read(name) if rows is None else self._read_rows(name, rows)) if mine else None
        if self.stages is None:
            return value
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        return self.stages.broadcast(name, value, None if rows is None else (rows.start, rows.stop), device)

    def num_rows(self, name: str) -> int:
        """Rows (dim 0) of the tensor ``read_model`` returns for ``name``."""
        if self.stages is not None:
            return self.stages.shapes[name][0][0]
        rows = local_shape(self.params[name])[0]
        return rows * self.groups.tp_size if self._tp_split(name) else rows

    def _read(self, name: str) -> torch.Tensor:
        value = self._local_value(self.params[name])
        if not self._tp_split(name):
            return value
        _, rule = self.plan.rule(name)
        g = self.groups
        shards = [torch.empty_like(value) for _ in range(g.tp_size)]
        dist.all_gather(shards, value.contiguous(), group=g.tp_group)
        return unshard(shards, rule)

    def _read_rows(self, name: str, rows: Rows) -> torch.Tensor:
        """Rows of the full tensor: tensor-parallel rank ``t`` holds full rows ``[t * R, (t + 1) * R)``
        (vocab-parallel) and broadcasts its overlap with ``rows``."""
        p = self.params[name]
        if not self._tp_split(name):
            return self._local_rows(p, rows.start, rows.stop)
        _, rule = self.plan.rule(name)
        assert partition_dim(rule) == 0, f"{name} is split over tensor-parallel ranks on dim {partition_dim(rule)}"
        g, shape = self.groups, local_shape(p)
        local = shape[0]
        out = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=self._dtype(p), device=p.device)
        for t in range(rows.start // local, -(-rows.stop // local)):
            lo, hi = max(rows.start, t * local), min(rows.stop, (t + 1) * local)
            piece = out[lo - rows.start : hi - rows.start]
            if t == g.tp_rank:
                piece.copy_(self._local_rows(p, lo - t * local, hi - t * local))
            dist.broadcast(piece, group=g.tp_group, group_src=t)
        return out

    def _local_rows(self, p, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of :meth:`_local_value`, reading no more than those rows."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        shape = local_shape(p)
        rows_shape = (stop - start, *shape[1:])
        width, key = math.prod(shape[1:]), self.state_key
        if is_zero3(p):
            if key is not None:
                part = safe_get_local_optimizer_state(p, key)
            elif getattr(p, "_z3_optimizer", None) is not None:
                part = safe_get_local_fp32_param(p)
            else:
                part = p.ds_tensor
            # part: this rank's flat partition (P,) -> (P,); the gathered range
            # (rows * width,) -> (rows, *shape[1:]), rows = stop - start
            return gather_range(part.reshape(-1), p.ds_process_group, start * width, stop * width).view(rows_shape)
        if hasattr(p, "_hp_mapping") and (key is not None or p.dtype != torch.float32):
            # (rows * width,) -> (rows, *shape[1:]), rows = stop - start
            return fragment_range(p, key, start * width, stop * width).view(rows_shape)
        if key is None:
            return p.detach()[start:stop]
        value = inner_torch_optimizer(self.optimizer).state.get(p, {}).get(key)
        if value is None:
            return torch.zeros(rows_shape, dtype=torch.float32, device=p.device)
        return value.detach()[start:stop].float()

    def _local_value(self, p) -> torch.Tensor:
        """This rank's tensor-parallel shard, whole over data-parallel ranks, in fp32 where the
        optimizer keeps fp32 masters."""
        from deepspeed.utils import safe_get_full_fp32_param

        if self.state_key is not None:
            if is_zero3(p) or hasattr(p, "_hp_mapping"):
                return full_state(p, self.state_key, self.optimizer)
            state = inner_torch_optimizer(self.optimizer).state.get(p, {})
            value = state.get(self.state_key)
            return torch.zeros_like(p, dtype=torch.float32) if value is None else value.detach().float()
        if is_zero3(p):
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

    def write_model(self, values: dict[str, torch.Tensor], rows: Optional[Rows] = None) -> None:
        """Write full tensors (or, with ``rows``, those rows of each)."""
        if rows is None:
            self._write(values)
            return
        for name, value in values.items():
            self._write_rows(name, rows, value)

    def write_layer(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        prefix = layer_prefix(self.cfg, layer)
        self._write({prefix + name: t for name, t in values.items()})

    def _shard_of_full(self, name: str) -> bool:
        """Whether what this rank writes of ``name`` is its tensor-parallel shard of the full tensor
        (``local``: the fast path, which maps every rank's own shards) rather than the full tensor."""
        return self.local and self._tp_partitioned(name)

    def full_tensor_noise(self, name: str, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
        """Standard normal noise drawn for the full tensor of ``name`` with ``generator``: the part
        of it that this rank's values of ``shape`` hold, so that every layout adds the same noise."""
        if not self._shard_of_full(name):
            return torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
        _, rule = self.plan.rule(name)
        full = list(shape)
        full[partition_dim(rule)] *= self.groups.tp_size
        noise = torch.randn(full, generator=generator, dtype=torch.float32)
        return shard(noise, rule, self.groups.tp_rank, self.groups.tp_size)

    def full_tensor_std(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The (unbiased) standard deviation of the full tensor of ``name``, of which ``value`` is
        what this rank writes; on the fast path from every TP rank's count, sum and sum of squares."""
        if not self._shard_of_full(name):
            return value.float().std()
        v = value.detach().double()
        stats = torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device), v.sum(),
                             (v * v).sum()])
        dist.all_reduce(stats, group=self.groups.tp_group)
        n, total, squares = stats.tolist()
        return torch.tensor(max(squares - total * total / n, 0.0) / (n - 1)).sqrt().float().to(value.device)

    def _write_rows(self, name: str, rows: Rows, value: torch.Tensor) -> None:
        """Store this rank's overlap of rows of the full tensor: its tensor-parallel shard's rows
        (vocab-parallel: rank ``t`` holds ``[t * R, (t + 1) * R)``), and under ZeRO-3 only the part
        of those in its own partition (nothing on another pipeline stage). Nothing is communicated."""
        assert name in self.names, f"the target model has no parameter {name!r}"
        for p in self._targets(name):
            self._write_rows_into(p, name, rows, value)

    def _write_rows_into(self, p, name: str, rows: Rows, value: torch.Tensor) -> None:
        _, rule = self.plan.rule(name)
        shape = local_shape(p)
        split = self._tp_split(name)
        assert not split or partition_dim(rule) == 0, (name, partition_dim(rule))
        first = shape[0] * self.groups.tp_rank if split else 0
        expected = (shape[0] * (self.groups.tp_size if split else 1), *shape[1:])
        assert (rows.num_rows, *value.shape[1:]) == expected and len(value) == rows.stop - rows.start, (
            name, rows, tuple(value.shape), expected)
        lo, hi = max(rows.start, first), min(rows.stop, first + shape[0])
        if lo >= hi:
            return
        mine, start = value[lo - rows.start : hi - rows.start], lo - first
        flat_start = start * math.prod(shape[1:])
        if self.state_key is not None:
            self._write_state_rows(p, start, flat_start, mine)
            return
        assert not hasattr(p, "_hp_mapping") and getattr(p, "_z3_optimizer", None) is None, (
            "parameters are written before deepspeed.initialize, so the optimizer starts from them"
        )
        with torch.no_grad():
            if is_zero3(p):
                # mine: (hi - lo, *shape[1:]) -> ((hi - lo) * width,), width = prod(shape[1:])
                write_range(p.ds_tensor.data, p.ds_process_group, flat_start, mine.reshape(-1), p.ds_numel)
            else:
                p.data[start : start + len(mine)].copy_(mine)

    def _write_state_rows(self, p, start: int, flat_start: int, mine: torch.Tensor) -> None:
        from deepspeed.utils import safe_get_local_optimizer_state, safe_set_local_optimizer_state

        key = self.state_key
        if is_zero3(p):
            part = safe_get_local_optimizer_state(p, key)
            # mine: (n, *rest) -> (n * prod(rest),), n rows of this rank's shard
            write_range(part, p.ds_process_group, flat_start, mine.reshape(-1).float(), p.ds_numel)
            safe_set_local_optimizer_state(p, part, key)
        elif hasattr(p, "_hp_mapping"):
            # mine: (n, *rest) -> (n * prod(rest),), n rows of this rank's shard
            write_fragment_range(p, key, flat_start, mine.reshape(-1).float())
        else:
            inner_torch_optimizer(self.optimizer).state[p][key][start : start + len(mine)].copy_(mine)

    def _target(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if self.local:
            return full
        _, rule = self.plan.rule(name)
        return shard(full, rule, self.groups.tp_rank, self.groups.tp_size)

    def _write(self, values: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(values) - set(self.names))
        assert not unknown, f"the target model has no parameters {unknown}"
        params = [(p, self._target(n, t)) for n, t in values.items() for p in self._targets(n)]
        for p, v in params:
            expected = tuple(local_shape(p))
            assert tuple(v.shape) == expected, (tuple(v.shape), expected)
        if self.state_key is not None:
            self._write_state(params)
            return
        for p, _ in params:
            assert not hasattr(p, "_hp_mapping") and getattr(p, "_z3_optimizer", None) is None, (
                "parameters are written before deepspeed.initialize, so the optimizer starts from them"
            )
        with torch.no_grad():
            for p, v in params:
                if is_zero3(p):
                    write_zero3_partition(p, v)
                elif _owns_storage(v) and v.dtype == p.dtype and v.device == p.device:
                    p.data = v  # a fresh result of the operators: adopt it, do not copy it
                else:
                    p.data.copy_(v)

    def _write_state(self, params) -> None:
        torch_optimizer = inner_torch_optimizer(self.optimizer)
        for p, v in params:
            if is_zero3(p) or hasattr(p, "_hp_mapping"):
                set_full_state(p, v.float(), self.state_key, self.optimizer)
            else:
                torch_optimizer.state[p][self.state_key].copy_(v)


class TensorsReader:
    """Full tensors held in memory (a consolidated checkpoint), behind the reader interface."""

    def __init__(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig):
        self.tensors, self.cfg = tensors, cfg
        self.model_names, self.layer_names = _split_names(tensors, cfg)

    def read_model(self, names: Sequence[str], rows: Optional[Rows] = None) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name] if rows is None else self.tensors[name][rows.start : rows.stop]
                for name in names}

    def num_rows(self, name: str) -> int:
        return self.tensors[name].shape[0]

    def read_layer(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        prefix = layer_prefix(self.cfg, layer)
        return {name: self.tensors[prefix + name] for name in names}


class TensorsWriter:
    """Full tensors collected in memory (the inverse of :class:`TensorsReader`), behind the writer
    interface: what a reader of a live model, copied into it, holds as a consolidated state."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.tensors = cfg, {}

    def write_model(self, values: dict[str, torch.Tensor], rows: Optional[Rows] = None) -> None:
        assert rows is None, "collected whole"
        self.tensors.update(values)

    def write_layer(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        prefix = layer_prefix(self.cfg, layer)
        self.tensors.update({prefix + name: t for name, t in values.items()})
