"""The ODE strategy's transitions on live, distributed models.

``restrict`` builds the coarse model (every other layer, residual-branch outputs scaled unless the
step is explicit) from the fine one, and keeps the fine model as it was (with its optimizer state when that is kept or
mapped) in a :class:`~megatron_multilevel.parallel.staging.FineSnapshot`, as ``coarsen`` does.
``prolong`` builds the fine model again: the snapshot plus the prolonged coarse change, the coarse
start being recomputed from the snapshot (what the restriction wrote). ``carry`` builds the same
level's model again for a new phase. Each is handed a builder of its target model
(``build_target``) and returns that model filled, ready for ``deepspeed.initialize``, with optimizer
state staged for :func:`~megatron_multilevel.parallel.staging.load_moments`.

The layer selection maps every tensor on its own, so when both models have the same tensor-parallel
size each rank maps its own shards with no communication (``shard_local``); under ZeRO-3 parameters
are gathered over the data-parallel ranks one at a time and partitioned again on writing, and
snapshots are partitioned over the data-parallel ranks that hold the same shards. When the coarse
models have another TP size (``multilevel.ode.coarse_tensor_model_parallel_size``), every tensor is
gathered whole over the source model's TP group, mapped, and resharded into the target layout, one
parameter at a time, and snapshots hold full tensors partitioned over all ranks, as the V-cycle's
general path does.
"""

from typing import Callable, Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.config import STATE_DEGREE, ModelConfig
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.ode_operators import (
    Prolongation,
    add_change,
    coarse_change,
    prolongation_sources,
    restrict_layer,
    unrestrict_layer,
)
from megatron_multilevel.parallel.staging import (FineSnapshot, Layout, Staged, check_layouts, copy_stream,
                                                 optimizer_step, snapshot_group)
from megatron_multilevel.parallel.snapshot import Snapshot, Storage
from megatron_multilevel.parallel.streams import Groups, ModelReader, ModelWriter
from megatron_multilevel.parallel.tp_layout import partition_dim, shard, unshard
from megatron_multilevel.plan import layer_prefix, parameter_plan

OptimizerState = Literal["reset", "keep", "map"]
# How the weight scale ``s`` (``LayerSelection.weight_scale``: the residual scale when the step is
# folded into the weights, 1 when it is explicit) acts on each optimizer state carried into a
# coarse phase and back (``optimizer_state = "map"``): as on any rescaled parameter
# (``config.STATE_DEGREE``), momentum and Adam's first moment restrict as gradients (``s ** -1`` on
# the residual-branch outputs), the second moment as a squared gradient (``s ** -2``), and come
# back multiplied. SGD's momentum would otherwise start a coarse phase with ``s ** 2`` times it.
DEGREE = STATE_DEGREE


def shard_local(fine_layout: Layout, coarse_layout: Layout) -> bool:
    """Whether each rank maps its own tensor-parallel shards (no communication): the selection maps
    every tensor on its own, so whenever both models have the same TP size."""
    return fine_layout.tensor_model_parallel_size == coarse_layout.tensor_model_parallel_size


def _snapshot(kind: str, local: bool, keep: Storage, keep_dir: Optional[str]) -> Snapshot:
    directory = None if keep_dir is None else f"{keep_dir}/{kind}"
    return Snapshot(snapshot_group(local), storage=keep, directory=directory)


def _reader(module, cfg: ModelConfig, groups: Groups, local: bool, optimizer=None, key=None) -> ModelReader:
    return ModelReader(module, cfg, groups, local=local, optimizer=optimizer, state_key=key)


def restrict(fine_module: torch.nn.Module, selection: LayerSelection, *, fine_layout: Layout, coarse_layout: Layout,
             build_target: Callable[[], torch.nn.Module], optimizer=None, keys: Sequence[str] = (),
             map_state: bool = False, keep: Storage = "memory", keep_dir: Optional[str] = None
             ) -> tuple[Staged, FineSnapshot]:
    """Build the coarse model of ``selection`` in ``coarse_layout`` from the fine model (which runs in
    ``fine_layout``, the current parallel state); keep the fine model.

    ``keys`` name the optimizer state (of ``optimizer``, the fine engine's) kept in the snapshot;
    with ``map_state`` it is also restricted and staged for the coarse optimizer.
    """
    check_layouts(selection.fine, selection.coarse, fine_layout, coarse_layout, what="model")
    local = shard_local(fine_layout, coarse_layout)
    fine_groups = Groups.current()  # captured before the coarse model's layout replaces it
    before = FineSnapshot(_snapshot("params", local, keep, keep_dir), step=optimizer_step(optimizer) if keys else 0)
    coarse_model = build_target()
    writer = ModelWriter(coarse_model, selection.coarse, Groups.current(), local=local)
    _restrict_stream(_reader(fine_module, selection.fine, fine_groups, local), writer, selection, tee=before.params)
    staged = Staged(coarse_model, selection.coarse, local, step=before.step)
    for key in keys:
        before.moments[key] = _snapshot(key, local, keep, keep_dir)
        reader = _reader(fine_module, selection.fine, fine_groups, local, optimizer, key)
        if map_state:
            staged.moments[key] = Snapshot(snapshot_group(local))
            _restrict_stream(reader, staged.moments[key], selection, tee=before.moments[key], degree=DEGREE[key])
        else:
            copy_stream(reader, before.moments[key], selection.fine.num_layers)
    return staged, before


def prolong(coarse_module: torch.nn.Module, before: FineSnapshot, selection: LayerSelection, *,
            fine_layout: Layout, coarse_layout: Layout, prolongation: Prolongation = "correction",
            correction_scale: float = 1.0, build_target: Callable[[], torch.nn.Module], optimizer=None,
            state: OptimizerState = "reset", coarse_groups: Optional[Groups] = None) -> Staged:
    """Build the fine model again, in ``fine_layout``: ``before`` plus the prolonged change of the
    coarse model (which runs in ``coarse_layout``).

    ``state``: no optimizer state (``reset``), the fine state kept in ``before`` (``keep``), or that
    state with the selected layers' and shared parameters' taken back from the coarse optimizer
    ``optimizer`` (``map``). ``coarse_groups``: the coarse model's tensor-parallel group, by default
    the current one; a caller that prolongs the same coarse model again (the line search) captures it
    before the first call, which sets up the fine layout.
    """
    check_layouts(selection.fine, selection.coarse, fine_layout, coarse_layout, what="model")
    local = shard_local(fine_layout, coarse_layout)
    coarse_groups = coarse_groups or Groups.current()
    fine_model = build_target()
    writer = ModelWriter(fine_model, selection.fine, Groups.current(), local=local)
    _prolong_stream(_reader(coarse_module, selection.coarse, coarse_groups, local), before.params, writer, selection,
                    prolongation, correction_scale)
    if state == "reset":
        return Staged(fine_model, selection.fine, local)
    if state == "keep":
        return Staged(fine_model, selection.fine, local, moments=dict(before.moments), step=before.step)
    staged = Staged(fine_model, selection.fine, local, step=optimizer_step(optimizer))
    for key, kept in before.moments.items():
        staged.moments[key] = Snapshot(snapshot_group(local))
        _map_back_stream(_reader(coarse_module, selection.coarse, coarse_groups, local, optimizer, key), kept,
                         staged.moments[key], selection, DEGREE[key])
    return staged


def prolonged_change_norm(coarse_module: torch.nn.Module, before: FineSnapshot, selection: LayerSelection, *,
                          fine_layout: Layout, coarse_layout: Layout, prolongation: Prolongation = "correction",
                          coarse_groups: Optional[Groups] = None) -> float:
    """``|P (theta_H - R theta_h)|``: the global norm, in fine units, of the change that
    :func:`prolong` would add to ``before`` at ``correction_scale`` 1 (read-only; collective).
    Streamed as ``prolong`` streams, one parameter at a time; shards of a tensor-parallel tensor
    summed over the coarse group, everything else counted once."""
    local = shard_local(fine_layout, coarse_layout)
    groups = coarse_groups or Groups.current()
    reader = _reader(coarse_module, selection.coarse, groups, local)
    plan, kept = parameter_plan(selection.fine), before.params
    sums = torch.zeros(2, dtype=torch.float64)  # [split over TP, whole]

    def add(values: dict[str, torch.Tensor], prefix: str = "") -> None:
        for name, t in values.items():
            split = local and groups.tp_size > 1 and partition_dim(plan.rule(prefix + name)[1]) is not None
            sums[0 if split else 1] += t.double().square().sum().cpu()

    for name in reader.model_names:
        add(coarse_change(kept.read_model([name]), reader.read_model([name]), selection, 1.0, layer=False))
    for name in reader.layer_names:
        for j, _, received in _received_changes(reader, kept, selection, prolongation, 1.0, name):
            if received:
                add({name: sum(change[name] * w for change, w in received)}, layer_prefix(selection.fine, j))
    if local and groups.tp_size > 1:
        split = sums[:1].to(next(coarse_module.parameters()).device)
        dist.all_reduce(split, group=groups.tp_group)
        sums[0] = split.item()
    return float(sums.sum()) ** 0.5


def carry(module: torch.nn.Module, cfg: ModelConfig, *, build_target: Callable[[], torch.nn.Module],
          optimizer=None, keys: Sequence[str] = ()) -> Staged:
    """The same level's model again (same layout), for a new phase; with ``keys``, its optimizer
    state too."""
    groups = Groups.current()
    model = build_target()
    copy_stream(_reader(module, cfg, groups, True), ModelWriter(model, cfg, groups, local=True), cfg.num_layers)
    staged = Staged(model, cfg, True, step=optimizer_step(optimizer) if keys else 0)
    for key in keys:
        staged.moments[key] = Snapshot(snapshot_group(True))
        copy_stream(_reader(module, cfg, groups, True, optimizer, key), staged.moments[key], cfg.num_layers)
    return staged


def snapshot_fine(module: torch.nn.Module, selection: LayerSelection, *, fine_layout: Layout, coarse_layout: Layout,
                  optimizer=None, keys: Sequence[str] = (), keep: Storage = "memory",
                  keep_dir: Optional[str] = None) -> FineSnapshot:
    """The snapshot ``restrict`` keeps, taken again from a fine model in ``fine_layout`` (a resumed
    run's checkpoint of the phase before the coarse one)."""
    check_layouts(selection.fine, selection.coarse, fine_layout, coarse_layout, what="model")
    local = shard_local(fine_layout, coarse_layout)
    cfg, groups = selection.fine, Groups.current()
    before = FineSnapshot(_snapshot("params", local, keep, keep_dir), step=optimizer_step(optimizer) if keys else 0)
    copy_stream(_reader(module, cfg, groups, local), before.params, cfg.num_layers)
    for key in keys:
        before.moments[key] = _snapshot(key, local, keep, keep_dir)
        copy_stream(_reader(module, cfg, groups, local, optimizer, key), before.moments[key], cfg.num_layers)
    return before


def reshard_tensors(values: dict[str, torch.Tensor], cfg: ModelConfig, *, source: Groups,
                    target: Groups) -> dict[str, torch.Tensor]:
    """Per-parameter tensors (a gradient, the coherence vector) held as this rank's shards of the
    ``source`` layout, as its shards of the ``target`` layout: gathered over ``source``'s
    tensor-parallel group where the sizes differ (collective), then split again."""
    if source.tp_size == target.tp_size:
        return values
    plan = parameter_plan(cfg)
    out = {}
    for name, t in values.items():
        rule = plan.rule(name)[1]
        if partition_dim(rule) is not None and source.tp_size > 1:
            shards = [torch.empty_like(t) for _ in range(source.tp_size)]
            dist.all_gather(shards, t.contiguous(), group=source.tp_group)
            t = unshard(shards, rule)
        out[name] = shard(t, rule, target.tp_rank, target.tp_size).contiguous()
    return out


def _restrict_stream(reader, writer, selection: LayerSelection, *, tee, degree: int = 1) -> None:
    """Copy the shared parameters and restrict the selected layers, one parameter at a time; every
    fine tensor also goes into ``tee`` (the snapshot)."""
    for name in reader.model_names:
        value = reader.read_model([name])
        tee.write_model(value)
        writer.write_model({n: t.clone() for n, t in value.items()})  # the writer adopts what it is given
    coarse_of = {j: i for i, j in enumerate(selection.layers)}
    for j in range(selection.fine.num_layers):
        for name in reader.layer_names:
            value = reader.read_layer(j, [name])
            tee.write_layer(j, value)
            if j in coarse_of:
                writer.write_layer(coarse_of[j], restrict_layer(value, selection, degree=degree))


def _prolong_stream(coarse_reader, before, writer, selection: LayerSelection, prolongation: Prolongation,
                    correction_scale: float) -> None:
    """``before`` plus the prolonged coarse change, one parameter at a time; a coarse layer's change
    is kept only while a fine layer still needs it."""
    for name in coarse_reader.model_names:
        fine = before.read_model([name])
        change = coarse_change(fine, coarse_reader.read_model([name]), selection, correction_scale, layer=False)
        writer.write_model(add_change(fine, [(change, 1.0)]))
    for name in coarse_reader.layer_names:
        for j, fine, received in _received_changes(coarse_reader, before, selection, prolongation, correction_scale,
                                                   name):
            writer.write_layer(j, add_change(before.read_layer(j, [name]) if fine is None else fine, received))


def _received_changes(coarse_reader, before, selection: LayerSelection, prolongation: Prolongation,
                      correction_scale: float, name: str):
    """For the layer parameter ``name``, fine layer by fine layer: ``(j, fine, received)``, where
    ``received`` is the ``(change, weight)`` of every coarse layer whose change fine layer ``j``
    receives, and ``fine`` its value in ``before`` where that was read to restrict a coarse layer's
    start (None otherwise). A coarse layer's change is kept only while a fine layer still needs it."""
    sources = prolongation_sources(selection, prolongation)
    changes, fine_of = {}, {}
    for j, needs in enumerate(sources):
        for i, _ in needs:
            if i not in changes:
                k = selection.layers[i]
                fine_of[k] = before.read_layer(k, [name])
                start = restrict_layer(fine_of[k], selection)
                changes[i] = coarse_change(start, coarse_reader.read_layer(i, [name]), selection, correction_scale,
                                           layer=True)
        yield j, fine_of.pop(j, None), [(changes[i], w) for i, w in needs]
        later = {i for rest in sources[j + 1:] for i, _ in rest}
        changes = {i: c for i, c in changes.items() if i in later}


def _map_back_stream(coarse_reader, kept, writer, selection: LayerSelection, degree: int) -> None:
    """Optimizer state after a coarse phase: the coarse state of the shared parameters and of the
    selected layers (scaled back), the kept fine state of the other layers."""
    for name in coarse_reader.model_names:
        writer.write_model(coarse_reader.read_model([name]))
    coarse_of = {j: i for i, j in enumerate(selection.layers)}
    for j in range(selection.fine.num_layers):
        for name in coarse_reader.layer_names:
            if j in coarse_of:
                writer.write_layer(j, unrestrict_layer(coarse_reader.read_layer(coarse_of[j], [name]), selection,
                                                       degree=degree))
            else:
                writer.write_layer(j, kept.read_layer(j, [name]))
