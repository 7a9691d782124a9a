"""Transitions between the levels of a V-cycle on live, distributed models.

``coarsen`` takes the fine level's model (plain, or the module of a DeepSpeed engine at any ZeRO
stage and tensor-parallel size) and builds the coarse level's model in the coarse layout with
coalesced parameters; it keeps the fine model as it was (for interpolation) in a
:class:`~megatron_multilevel.parallel.streams.Snapshot`. ``prolong`` de-coalesces the coarse model,
interpolates with that snapshot (or adds the coarse correction to it) and builds the fine
level's model again. Both return a model
ready for ``deepspeed.initialize``; optionally mapped Adam moments are staged and loaded into the
new engine with :func:`load_moments`.

Fast path: same tensor-parallel size at both levels, groupings local to each shard, no ZeRO-3:
every rank maps its own shards and nothing is communicated (but three numbers per tensor under
``perturbation_std``, for the full tensor's deviation). Otherwise parameters are gathered,
projected and resharded one layer at a time, and the word embedding and output layer one slab of
vocabulary rows at a time (``streams.vocab_slabs``; whole under ``perturbation_std``, whose noise
is scaled by the whole tensor's deviation). A step that changes the TP size always takes this
general path: its groupings are local to the shards both levels share
(``level_maps.grouping_shards``), not to either level's own, and the operators see only full
tensors (or full rows).
"""

import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.config import ZERO_STAGES, ModelConfig, check_alpha, undivided_size, valid_tp_sizes
from megatron_multilevel.level_maps import LevelMap
from megatron_multilevel.operators import (
    coalesce_layers,
    coalesce_model_params,
    coarse_layer_of,
    correct,
    decoalesce_layer,
    decoalesce_model_params,
    depth_groups,
    group_member,
    interpolate,
)
from megatron_multilevel.parallel.streams import (
    Groups,
    ModelReader,
    ModelWriter,
    Snapshot,
    Storage,
    vocab_slabs,
)
from megatron_multilevel.parallel.zero import inner_torch_optimizer, materialize_optimizer_state, partitioned_init
from megatron_multilevel.plan import layer_prefix


@dataclass(frozen=True)
class Layout:
    """How one level is laid out over the ranks (data parallelism takes the rest)."""

    tensor_model_parallel_size: int = 1
    zero_stage: int = 0

    def check(self, cfg: ModelConfig, world_size: int, what: str) -> None:
        """Raise ``ValueError`` if a model of ``cfg`` cannot be laid out this way."""
        tp = self.tensor_model_parallel_size
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"{what}: invalid ZeRO stage {self.zero_stage}; valid choices are {list(ZERO_STAGES)}")
        if tp < 1 or world_size % tp:
            raise ValueError(
                f"{what}: tensor_model_parallel_size = {tp} does not divide the world size {world_size}"
            )
        undivided = undivided_size(cfg, tp)
        if undivided is not None:
            raise ValueError(
                f"{what}: tensor_model_parallel_size = {tp} does not divide model.{undivided}; "
                f"valid values are {valid_tp_sizes(cfg)}"
            )


def uses_fast_path(level_map: LevelMap, fine: Layout, coarse: Layout) -> bool:
    """Whether each rank can map its own shards with no communication."""
    tp = fine.tensor_model_parallel_size
    return (
        tp == coarse.tensor_model_parallel_size
        and fine.zero_stage < 3
        and coarse.zero_stage < 3
        and all(level_map.shard(r, tp) is not None for r in range(tp))
    )


@dataclass
class FineSnapshot:
    """The fine model as it was just before coalescing (and its moments, if they are mapped)."""

    params: Snapshot
    moments: dict[str, Snapshot] = field(default_factory=dict)
    step: int = 0


@dataclass
class Staged:
    """A level's model with its parameters in place, and moments to load after initialize."""

    model: torch.nn.Module
    cfg: ModelConfig
    local: bool
    moments: dict[str, Snapshot] = field(default_factory=dict)
    step: int = 0


def _build_target(cfg: ModelConfig, layout: Layout, ds_config: Optional[dict]) -> torch.nn.Module:
    from megatron_multilevel.distributed import set_tensor_model_parallel_size
    from megatron_multilevel.models import build_model

    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() != layout.tensor_model_parallel_size:
        set_tensor_model_parallel_size(layout.tensor_model_parallel_size)
    if layout.zero_stage < 3:
        return build_model(cfg, perform_initialization=False)
    from megatron_multilevel.parallel.mpu import mpu

    # Parameters are partitioned as they are created: no rank ever holds the whole model.
    config = dict(ds_config or {})
    config.setdefault("zero_optimization", {})["stage"] = 3
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    with partitioned_init(
        data_parallel_group=parallel_state.get_data_parallel_group(), config_dict_or_path=config, mpu=mpu
    ):
        return build_model(cfg, perform_initialization=False)


def _optimizer_step(optimizer) -> int:
    """The optimizer's step count (Adam's and AdamW's ``step`` state; 0 for SGD, which keeps none,
    and without an optimizer): what mapped moments are bias-corrected with after a transition."""
    if optimizer is None:
        return 0
    steps = [int(s["step"]) for s in inner_torch_optimizer(optimizer).state.values() if "step" in s]
    return max(steps, default=0)


def _check_layouts(level_map: LevelMap, fine: Layout, coarse: Layout) -> None:
    world = dist.get_world_size()
    fine.check(level_map.fine, world, "fine level layout")
    coarse.check(level_map.coarse, world, "coarse level layout")


def coarsen(
    fine_module: torch.nn.Module,
    level_map: LevelMap,
    *,
    fine_layout: Layout,
    coarse_layout: Layout,
    ds_config: Optional[dict] = None,
    optimizer=None,
    moments: Sequence[str] = (),
    keep: Storage = "memory",
    keep_dir: Optional[str] = None,
) -> tuple[Staged, FineSnapshot]:
    """Build the coarse level from the fine one; keep the fine one for interpolation.

    ``fine_module`` runs in ``fine_layout`` (the current parallel_state); the coarse model is
    built in ``coarse_layout``. ``keep`` says where the fine snapshot lives: "memory" (on the
    device), "cpu" or "disk" (under ``keep_dir``). ``moments`` names the optimizer state to carry
    (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``: ``config.optimizer_state_keys``);
    with it, ``optimizer`` is the fine engine's optimizer and the coalesced state is staged for
    :func:`load_moments`.
    """
    _check_layouts(level_map, fine_layout, coarse_layout)
    fast = uses_fast_path(level_map, fine_layout, coarse_layout)
    fine_groups = Groups.current()
    op_map = level_map.shard(fine_groups.tp_rank, fine_groups.tp_size) if fast else level_map
    group = _snapshot_group(fast)

    def snapshot(kind: str) -> Snapshot:
        directory = None if keep_dir is None else f"{keep_dir}/{kind}"
        return Snapshot(group, storage=keep, directory=directory)

    readers = {None: ModelReader(fine_module, level_map.fine, fine_groups, local=fast)}
    readers.update(
        {k: ModelReader(fine_module, level_map.fine, fine_groups, local=fast, optimizer=optimizer, state_key=k)
         for k in moments}
    )
    before = FineSnapshot(snapshot("params"), step=_optimizer_step(optimizer) if moments else 0)
    coarse_model = _build_target(level_map.coarse, coarse_layout, ds_config)
    writer = ModelWriter(coarse_model, level_map.coarse, Groups.current(), local=fast)
    _coarsen_stream(readers[None], writer, op_map, tee=before.params)
    staged = Staged(coarse_model, level_map.coarse, fast, step=before.step)
    for key in moments:
        before.moments[key] = snapshot(key)
        staged.moments[key] = Snapshot(group)
        _coarsen_stream(readers[key], staged.moments[key], op_map, tee=before.moments[key])
    return staged, before


def snapshot_level(
    fine_module: torch.nn.Module,
    level_map: LevelMap,
    *,
    fine_layout: Layout,
    coarse_layout: Layout,
    optimizer=None,
    moments: Sequence[str] = (),
    keep: Storage = "memory",
    keep_dir: Optional[str] = None,
) -> FineSnapshot:
    """The snapshot ``coarsen`` keeps, taken again from a fine model (e.g. a resumed run's
    checkpoint of the level just before it was coalesced)."""
    _check_layouts(level_map, fine_layout, coarse_layout)
    fast = uses_fast_path(level_map, fine_layout, coarse_layout)
    groups = Groups.current()
    group = _snapshot_group(fast)
    keys = (None,) + tuple(moments)
    before = FineSnapshot(None, step=_optimizer_step(optimizer) if moments else 0)
    for key in keys:
        kind = key or "params"
        snapshot = Snapshot(group, storage=keep, directory=None if keep_dir is None else f"{keep_dir}/{kind}")
        reader = ModelReader(fine_module, level_map.fine, groups, local=fast, optimizer=optimizer, state_key=key)
        _copy_stream(reader, snapshot, level_map.fine.num_layers, cfg=level_map.fine)
        if key is None:
            before.params = snapshot
        else:
            before.moments[key] = snapshot
    return before


def prolong(
    coarse_module: torch.nn.Module,
    before: Optional[FineSnapshot],
    level_map: LevelMap,
    alpha: float,
    *,
    coarse_layout: Layout,
    fine_layout: Layout,
    ds_config: Optional[dict] = None,
    optimizer=None,
    moments: Sequence[str] = (),
    perturbation_std: float = 0.0,
    seed: int = 0,
    correction: bool = False,
) -> Staged:
    """Build the fine level again: de-coalesce the coarse model and interpolate with ``before``.

    The result is ``(1 - alpha) * before + alpha * decoalesce(coarse)`` in ``fine_layout`` (with
    ``before`` None, growing a model, ``alpha`` must be 1, and mapped moments are the coarse
    optimizer's de-coalesced); with ``correction``, ``before + alpha * (decoalesce(coarse) -
    decoalesce(coalesce(before)))`` (``operators.correct_model``; mapped moments are blended), plus,
    with ``perturbation_std``, Gaussian noise of that size relative to each weight's own standard
    deviation (seeded by ``seed`` and the parameter's name: the same on every rank). ``moments``
    names the optimizer state carried, as for :func:`coarsen`.
    """
    check_alpha(alpha)
    _check_layouts(level_map, fine_layout, coarse_layout)
    if before is None and alpha != 1.0:
        raise ValueError(f"prolong: alpha {alpha} interpolates with the model before coalescing, and there is none")
    if before is not None and set(moments) - set(before.moments):
        raise ValueError(f"prolong: moments {list(moments)} need the fine level's, kept only for those coarsen "
                         f"carried ({list(before.moments)})")
    fast = uses_fast_path(level_map, fine_layout, coarse_layout)
    coarse_groups = Groups.current()
    op_map = level_map.shard(coarse_groups.tp_rank, coarse_groups.tp_size) if fast else level_map
    reader = ModelReader(coarse_module, level_map.coarse, coarse_groups, local=fast)
    moment_readers = {
        k: ModelReader(coarse_module, level_map.coarse, coarse_groups, local=fast, optimizer=optimizer, state_key=k)
        for k in moments
    }
    step = _optimizer_step(optimizer) if moments else 0
    fine_model = _build_target(level_map.fine, fine_layout, ds_config)
    writer = ModelWriter(fine_model, level_map.fine, Groups.current(), local=fast)
    _prolong_stream(reader, before and before.params, writer, op_map, alpha, perturbation_std=perturbation_std,
                    seed=seed, correction=correction)
    staged = Staged(fine_model, level_map.fine, fast, step=step)
    for key, moment_reader in moment_readers.items():
        staged.moments[key] = Snapshot(_snapshot_group(fast))
        _prolong_stream(moment_reader, None if before is None else before.moments[key], staged.moments[key], op_map,
                        alpha)
    return staged


def load_moments(engine, staged: Staged) -> None:
    """Load staged optimizer moments (Adam's, or SGD's momentum) into a freshly initialised
    DeepSpeed engine (ZeRO 0-3)."""
    if not staged.moments:
        return
    materialize_optimizer_state(engine.optimizer, tuple(staged.moments))
    for key, snapshot in staged.moments.items():
        writer = ModelWriter(
            engine.module, staged.cfg, Groups.current(), local=staged.local,
            optimizer=engine.optimizer, state_key=key,
        )
        _copy_stream(snapshot, writer, staged.cfg.num_layers, cfg=staged.cfg)
    if "exp_avg" not in staged.moments:
        return  # SGD's momentum has no step count
    # Adam's bias correction continues from the step count the moments were built over.
    for state in inner_torch_optimizer(engine.optimizer).state.values():
        state["step"] = torch.tensor(float(staged.step))


def _snapshot_group(fast: bool):
    from megatron.core import parallel_state

    # Fast path: local shards, partitioned over the ranks that hold the same shard.
    return parallel_state.get_data_parallel_group() if fast else None


def _coarsen_stream(reader, writer, level_map: LevelMap, *, tee=None) -> None:
    """Coalesce parameter by parameter: a rank holds at most one parameter of each fine layer of
    a depth group, or one slab of vocabulary rows (full, or its shard on the fast path), beyond its
    own shards."""
    for name in reader.model_names:
        for rows in vocab_slabs(reader, name, level_map.fine):
            value = reader.read_model([name], rows)
            if tee is not None:
                tee.write_model(value, rows)
            writer.write_model(coalesce_model_params(value, level_map), rows)
    for k, members in enumerate(depth_groups(level_map)):
        for name in reader.layer_names:
            fine = []
            for i in members:
                fine.append(reader.read_layer(i, [name]))
                if tee is not None:
                    tee.write_layer(i, fine[-1])
            writer.write_layer(k, coalesce_layers(fine, level_map))
            del fine


def _perturb(values: dict, std: float, seed: int, writer: ModelWriter, layer: Optional[int] = None) -> dict:
    """Add seeded Gaussian noise, ``std`` times each full tensor's standard deviation, to the
    parameters outside the layers or (``layer``) of one layer; the noise is drawn for the full
    tensor and each rank adds its part of it, so that every layout (the fast path's TP shards
    included) builds the same model."""
    if not std:
        return values
    key, prefix = ("model", "") if layer is None else (f"layer{layer}", layer_prefix(writer.cfg, layer))
    out = {}
    for name, t in values.items():
        if t.numel() <= 1:
            out[name] = t
            continue
        gen = torch.Generator().manual_seed(seed + zlib.crc32(f"{key}/{name}".encode()))
        noise = writer.full_tensor_noise(prefix + name, t.shape, gen).to(t.device)
        out[name] = (t.float() + std * writer.full_tensor_std(prefix + name, t) * noise).to(t.dtype)
    return out


def _prolong_stream(coarse_reader, before_reader, writer, level_map: LevelMap, alpha: float, *,
                    perturbation_std: float = 0.0, seed: int = 0, correction: bool = False) -> None:
    """De-coalesce and interpolate (or correct) parameter by parameter (slab by slab of
    vocabulary rows). The correction's starting coarse model is coalesced again from ``before``,
    one depth group at a time, as ``_coarsen_stream`` made it."""
    for name in coarse_reader.model_names:
        for rows in vocab_slabs(coarse_reader, name, level_map.fine, whole=perturbation_std > 0):
            values = decoalesce_model_params(coarse_reader.read_model([name], rows), level_map)
            if before_reader is not None:  # None when growing (alpha 1): nothing to interpolate with
                before = before_reader.read_model([name], rows)
                if correction:
                    start = decoalesce_model_params(coalesce_model_params(before, level_map), level_map)
                    values = correct(before, values, start, alpha)
                else:
                    values = interpolate(before, values, alpha)
            writer.write_model(_perturb(values, perturbation_std, seed, writer), rows)
    for k, members in enumerate(depth_groups(level_map)):
        assert all(coarse_layer_of(level_map, j) == k for j in members), (k, members)
        for name in coarse_reader.layer_names:
            coarse = coarse_reader.read_layer(k, [name])
            before = [] if before_reader is None else [before_reader.read_layer(j, [name]) for j in members]
            start = coalesce_layers(before, level_map) if correction and before else None
            for i, j in enumerate(members):
                member = group_member(level_map, j)
                decoalesced = decoalesce_layer(coarse, level_map, member)
                if not before:  # growing (alpha 1); new tensors per fine layer: the writer adopts them
                    values = decoalesced
                elif start is not None:
                    values = correct(before[i], decoalesced, decoalesce_layer(start, level_map, member), alpha)
                else:
                    values = interpolate(before[i], decoalesced, alpha)
                writer.write_layer(j, _perturb(values, perturbation_std, seed, writer, j))
            del coarse, before, start


def _copy_stream(reader, writer, num_layers: int, *, cfg: Optional[ModelConfig] = None) -> None:
    """Copy parameter by parameter; with ``cfg`` (the model's), the vocabulary slab by slab."""
    for name in reader.model_names:
        for rows in [None] if cfg is None else vocab_slabs(reader, name, cfg):
            writer.write_model(reader.read_model([name], rows), rows)
    for i in range(num_layers):
        for name in reader.layer_names:
            writer.write_layer(i, reader.read_layer(i, [name]))
