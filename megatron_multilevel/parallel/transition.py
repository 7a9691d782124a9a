"""Transitions between the levels of a V-cycle on live, distributed models.

``coarsen`` takes the fine level's model (plain, or the module of a DeepSpeed engine at any ZeRO
stage and tensor-parallel size) and builds the coarse level's model in the coarse layout with
coalesced parameters; it keeps the fine model as it was (for interpolation) in a
:class:`~megatron_multilevel.parallel.snapshot.Snapshot`. ``prolong`` de-coalesces the coarse model,
interpolates with that snapshot (or adds the coarse correction to it) and builds the fine
level's model again. Each is handed a builder of its target model (``build_target``, an empty model
in the target layout) and returns it filled, ready for ``deepspeed.initialize``; optionally mapped
Adam moments are staged and loaded into the new engine with
:func:`~megatron_multilevel.parallel.staging.load_moments`.

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

import dataclasses
import zlib
from typing import Callable, Optional, Sequence

import torch

from megatron_multilevel.config import STATE_DEGREE, check_alpha
from megatron_multilevel.growth.fresh import fresh_layer
from megatron_multilevel.level_maps import LevelMap
from megatron_multilevel.operators import (
    check_width_growth,
    coalesce_layers,
    coalesce_model_params,
    coarse_layer_of,
    correct,
    decoalesce_layer,
    decoalesce_model_params,
    depth_groups,
    group_member,
    interpolate,
    upper_layer,
)
from megatron_multilevel.parallel.staging import (FineSnapshot, Layout, Staged, check_layouts, copy_stream,
                                                 optimizer_step, snapshot_group)
from megatron_multilevel.parallel.snapshot import Snapshot, Storage
from megatron_multilevel.parallel.streams import Groups, ModelReader, ModelWriter, vocab_slabs
from megatron_multilevel.plan import layer_prefix


def uses_fast_path(level_map: LevelMap, fine: Layout, coarse: Layout) -> bool:
    """Whether each rank can map its own shards with no communication."""
    tp = fine.tensor_model_parallel_size
    return (
        tp == coarse.tensor_model_parallel_size
        and fine.zero_stage < 3
        and coarse.zero_stage < 3
        # pipelined: the full path, whose snapshots are spread over every rank, not kept whole per stage
        and fine.pipeline.size == coarse.pipeline.size == 1
        and all(level_map.shard(r, tp) is not None for r in range(tp))
    )


def coarsen(
    fine_module: torch.nn.Module,
    level_map: LevelMap,
    *,
    fine_layout: Layout,
    coarse_layout: Layout,
    build_target: Callable[[], torch.nn.Module],
    optimizer=None,
    moments: Sequence[str] = (),
    keep: Storage = "memory",
    keep_dir: Optional[str] = None,
) -> tuple[Staged, FineSnapshot]:
    """Build the coarse level from the fine one; keep the fine one for interpolation.

    ``fine_module`` runs in ``fine_layout`` (the current parallel_state); ``build_target()`` builds
    the empty coarse model in ``coarse_layout`` (switching the parallel state to it). ``keep`` says where the fine snapshot lives: "memory" (on the
    device), "cpu" or "disk" (under ``keep_dir``). ``moments`` names the optimizer state to carry
    (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``: ``config.optimizer_state_keys``);
    with it, ``optimizer`` is the fine engine's optimizer and the coalesced state is staged for
    ``staging.load_moments``.
    """
    check_layouts(level_map.fine, level_map.coarse, fine_layout, coarse_layout)
    fast = uses_fast_path(level_map, fine_layout, coarse_layout)
    fine_groups = Groups.current()
    op_map = level_map.shard(fine_groups.tp_rank, fine_groups.tp_size) if fast else level_map
    group = snapshot_group(fast)

    def snapshot(kind: str) -> Snapshot:
        directory = None if keep_dir is None else f"{keep_dir}/{kind}"
        return Snapshot(group, storage=keep, directory=directory)

    readers = {None: ModelReader(fine_module, level_map.fine, fine_groups, local=fast)}
    readers.update(
        {k: ModelReader(fine_module, level_map.fine, fine_groups, local=fast, optimizer=optimizer, state_key=k)
         for k in moments}
    )
    before = FineSnapshot(snapshot("params"), step=optimizer_step(optimizer) if moments else 0)
    coarse_model = build_target()
    writer = ModelWriter(coarse_model, level_map.coarse, Groups.current(), local=fast)
    _coarsen_stream(readers[None], writer, op_map, tee=before.params)
    staged = Staged(coarse_model, level_map.coarse, fast, step=before.step)
    for key in moments:
        before.moments[key] = snapshot(key)
        staged.moments[key] = Snapshot(group)
        _coarsen_stream(readers[key], staged.moments[key], op_map, tee=before.moments[key], degree=STATE_DEGREE[key])
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
    check_layouts(level_map.fine, level_map.coarse, fine_layout, coarse_layout)
    fast = uses_fast_path(level_map, fine_layout, coarse_layout)
    groups = Groups.current()
    group = snapshot_group(fast)
    keys = (None,) + tuple(moments)
    before = FineSnapshot(None, step=optimizer_step(optimizer) if moments else 0)
    for key in keys:
        kind = key or "params"
        snapshot = Snapshot(group, storage=keep, directory=None if keep_dir is None else f"{keep_dir}/{kind}")
        reader = ModelReader(fine_module, level_map.fine, groups, local=fast, optimizer=optimizer, state_key=key)
        copy_stream(reader, snapshot, level_map.fine.num_layers, cfg=level_map.fine)
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
    build_target: Callable[[], torch.nn.Module],
    optimizer=None,
    moments: Sequence[str] = (),
    perturbation_std: float = 0.0,
    seed: int = 0,
    correction: bool = False,
    width_growth: str = "fpi",
    grown: str = "copy",
    grown_moments: str = "copy",
    keep_branches: bool = False,
    fresh_depth: Optional[int] = None,
) -> Staged:
    """Build the fine level again: de-coalesce the coarse model and interpolate with ``before``.

    The result is ``(1 - alpha) * before + alpha * decoalesce(coarse)`` in ``fine_layout``, written
    into the model ``build_target()`` builds there (with
    ``before`` None, growing a model, ``alpha`` must be 1, and mapped moments are the coarse
    optimizer's de-coalesced); with ``correction``, ``before + alpha * (decoalesce(coarse) -
    decoalesce(coalesce(before)))`` (``operators.correct_model``; mapped moments are blended), plus,
    with ``perturbation_std``, Gaussian noise of that size relative to each weight's own standard
    deviation (seeded by ``seed`` and the parameter's name: the same on every rank). ``moments``
    names the optimizer state carried, as for :func:`coarsen`. ``width_growth`` "aki" grows width
    by bert2BERT's AKI (``operators.decoalesce_tensor_aki``: each layer's new units from the layer
    above), growing only (``before`` None); mapped moments follow their weights, grown the same way.
    Growing in depth, the layers growth adds (the second of every depth group) are copies
    (``grown`` "copy") or freshly initialised (``"fresh"``: ``growth/fresh.py``, seeded by ``seed``,
    their residual outputs zero under ``identity`` depth scaling), and their mapped moments copies
    (``grown_moments`` "copy") or zero (``"zero"``). ``keep_branches``: the growth masks the
    layers it adds (MSG), so the kept branches are kept as the coarse model computed them
    (``operators.keeps_branches``: rescaled under depth-muP, their optimizer state with them).
    ``fresh_depth``: the depth whose initialisation fresh layers take (their residual outputs'
    spread; default the grown level's): a growth through levels that train no step initialises
    every fresh layer for the model it ends in.
    """
    check_alpha(alpha)
    check_layouts(level_map.fine, level_map.coarse, fine_layout, coarse_layout)
    check_width_growth(width_growth, level_map)
    if before is None and alpha != 1.0:
        raise ValueError(f"prolong: alpha {alpha} interpolates with the model before coalescing, and there is none")
    assert grown in ("copy", "fresh") and grown_moments in ("copy", "zero"), (grown, grown_moments)
    assert before is None or (grown, grown_moments) == ("copy", "copy"), "only growing adds layers"
    if before is not None and width_growth != "fpi":
        raise ValueError(f"prolong: width_growth {width_growth!r} grows a level (no model before coalescing); a "
                         f"return that interpolates de-coalesces by 'fpi'")
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
    step = optimizer_step(optimizer) if moments else 0
    fine_model = build_target()
    writer = ModelWriter(fine_model, level_map.fine, Groups.current(), local=fast)
    _prolong_stream(reader, before and before.params, writer, op_map, alpha, perturbation_std=perturbation_std,
                    seed=seed, correction=correction, width_growth=width_growth, grown=grown,
                    keep_branches=keep_branches, fresh_depth=fresh_depth)
    staged = Staged(fine_model, level_map.fine, fast, step=step)
    for key, moment_reader in moment_readers.items():
        staged.moments[key] = Snapshot(snapshot_group(fast))
        _prolong_stream(moment_reader, None if before is None else before.moments[key], staged.moments[key], op_map,
                        alpha, width_growth=width_growth, grown=grown_moments, degree=STATE_DEGREE[key],
                        keep_branches=keep_branches)
    return staged


def _coarsen_stream(reader, writer, level_map: LevelMap, *, tee=None, degree: int = 1) -> None:
    """Coalesce parameter by parameter: a rank holds at most one parameter of each fine layer of
    a depth group, or one slab of vocabulary rows (full, or its shard on the fast path), beyond its
    own shards. ``degree``: 1 for parameters, an optimizer state's ``STATE_DEGREE``."""
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
            writer.write_layer(k, coalesce_layers(fine, level_map, degree=degree))
            del fine


def _perturb(values: dict, std: float, seed: int, writer: ModelWriter, layer: Optional[int] = None) -> dict:
    """Add seeded Gaussian noise, ``std`` times each full tensor's standard deviation, to the
    parameters outside the layers or (``layer``) of one layer; the noise is drawn for the full
    tensor and each rank adds its part of it, so that every layout (the fast path's TP shards
    included) builds the same model."""
    if not std:
        return values
    key, prefix = ("model", "") if layer is None else (f"layer{layer}", layer_prefix(writer.cfg, layer))
    noise = _seeded_noise(writer, seed, key, prefix)
    out = {}
    for name, t in values.items():
        if t.numel() <= 1:
            out[name] = t
            continue
        out[name] = (t.float() + std * writer.full_tensor_std(prefix + name, t) * noise(name, t.shape).to(t.device)
                     ).to(t.dtype)
    return out


def _seeded_noise(writer: ModelWriter, seed: int, key: str, prefix: str):
    """Standard normal noise for a parameter ``name`` (under ``prefix``) of shape ``shape``, seeded by
    ``seed``, ``key`` and the name and drawn for the full tensor (``ModelWriter.full_tensor_noise``),
    so that every layout draws the same."""
    def noise(name: str, shape) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed + zlib.crc32(f"{key}/{name}".encode()))
        return writer.full_tensor_noise(prefix + name, shape, gen)

    return noise


def _prolong_stream(coarse_reader, before_reader, writer, level_map: LevelMap, alpha: float, *,
                    perturbation_std: float = 0.0, seed: int = 0, correction: bool = False,
                    width_growth: str = "fpi", grown: str = "copy", degree: int = 1,
                    keep_branches: bool = False, fresh_depth: Optional[int] = None) -> None:
    """De-coalesce and interpolate (or correct) parameter by parameter (slab by slab of
    vocabulary rows). The correction's starting coarse model is coalesced again from ``before``,
    one depth group at a time, as ``_coarsen_stream`` made it. AKI reads each parameter of the
    coarse layer above too (every rank the same layers, in the same order). Growing, the layers
    growth adds are ``grown``: copies, ``fresh`` layers or ``zero``. ``degree``: 1 for parameters,
    an optimizer state's ``STATE_DEGREE`` (how a rescaled residual branch scales it)."""
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
        up = upper_layer(level_map, k) if width_growth == "aki" else None
        for name in coarse_reader.layer_names:
            coarse = coarse_reader.read_layer(k, [name])
            upper = None if up is None else coarse if up == k else coarse_reader.read_layer(up, [name])
            before = [] if before_reader is None else [before_reader.read_layer(j, [name]) for j in members]
            start = coalesce_layers(before, level_map, degree=degree) if correction and before else None
            for i, j in enumerate(members):
                member = group_member(level_map, j)
                decoalesced = decoalesce_layer(coarse, level_map, member, upper=upper, degree=degree,
                                               keep_branches=keep_branches)
                if not before:  # growing (alpha 1); new tensors per fine layer: the writer adopts them
                    values = decoalesced if member == 0 else _grown_layer(decoalesced, grown, writer, level_map,
                                                                          seed, j, fresh_depth)
                elif start is not None:
                    values = correct(before[i], decoalesced, decoalesce_layer(start, level_map, member, degree=degree),
                                     alpha)
                else:
                    values = interpolate(before[i], decoalesced, alpha)
                writer.write_layer(j, _perturb(values, perturbation_std, seed, writer, j))
            del coarse, upper, before, start


def _grown_layer(copied: dict, grown: str, writer: ModelWriter, level_map: LevelMap, seed: int, layer: int,
                 fresh_depth: Optional[int] = None) -> dict:
    """The values of fine layer ``layer``, which growth adds: ``copied`` (de-coalesced), a fresh
    layer (noise drawn for each full tensor, seeded by ``seed``, the layer and the name; initialised
    for a model of ``fresh_depth`` layers, default the grown level's) or zeros."""
    if grown == "copy":
        return copied
    if grown == "zero":
        return {name: torch.zeros_like(t) for name, t in copied.items()}
    noise = _seeded_noise(writer, seed, f"fresh/layer{layer}", layer_prefix(writer.cfg, layer))
    cfg = level_map.fine if fresh_depth is None else dataclasses.replace(level_map.fine, num_layers=fresh_depth)
    return fresh_layer(copied, cfg, noise, zero_residual=level_map.depth_scaling == "identity")
