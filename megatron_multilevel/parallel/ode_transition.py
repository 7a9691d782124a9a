"""The ODE strategy's transitions on live, distributed models.

``restrict`` builds the coarse model (every other layer, residual-branch outputs scaled) from the
fine one, and keeps the fine model as it was (with its optimizer state when that is kept or
mapped) in a :class:`~megatron_multilevel.parallel.transition.FineSnapshot`, as ``coarsen`` does.
``prolong`` builds the fine model again: the snapshot plus the prolonged coarse change, the coarse
start being recomputed from the snapshot (what the restriction wrote). ``carry`` builds the same
level's model again for a new phase. Each returns a model ready for ``deepspeed.initialize`` and
optimizer state staged for :func:`~megatron_multilevel.parallel.transition.load_moments`.

The layer selection maps every tensor on its own, so each rank maps its own tensor-parallel shards
with no communication, at any TP size; under ZeRO-3 parameters are gathered over the data-parallel
ranks one at a time and partitioned again on writing. Snapshots are partitioned over the
data-parallel ranks that hold the same shards.
"""

from typing import Literal, Optional, Sequence

import torch

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.ode_operators import (
    Prolongation,
    add_change,
    coarse_change,
    prolongation_sources,
    restrict_layer,
    unrestrict_layer,
)
from megatron_multilevel.parallel.streams import Groups, ModelReader, ModelWriter, Snapshot, Storage
from megatron_multilevel.parallel.transition import (
    FineSnapshot,
    Layout,
    Staged,
    _adam_step,
    _build_target,
    _copy_stream,
    _snapshot_group,
)

OptimizerState = Literal["reset", "keep", "map"]
# Adam's second moment is a squared gradient: the residual scale acts on it squared.
DEGREE = {"exp_avg": 1, "exp_avg_sq": 2, "momentum_buffer": 1}


def _snapshot(kind: str, keep: Storage, keep_dir: Optional[str]) -> Snapshot:
    return Snapshot(_snapshot_group(True), storage=keep, directory=None if keep_dir is None else f"{keep_dir}/{kind}")


def _reader(module, cfg: ModelConfig, optimizer=None, key=None) -> ModelReader:
    return ModelReader(module, cfg, Groups.current(), local=True, optimizer=optimizer, state_key=key)


def restrict(fine_module: torch.nn.Module, selection: LayerSelection, *, layout: Layout,
             ds_config: Optional[dict] = None, optimizer=None, keys: Sequence[str] = (),
             map_state: bool = False, keep: Storage = "memory", keep_dir: Optional[str] = None
             ) -> tuple[Staged, FineSnapshot]:
    """Build the coarse model of ``selection`` from the fine model; keep the fine model.

    ``keys`` name the optimizer state (of ``optimizer``, the fine engine's) kept in the snapshot;
    with ``map_state`` it is also restricted and staged for the coarse optimizer.
    """
    before = FineSnapshot(_snapshot("params", keep, keep_dir), step=_adam_step(optimizer) if keys else 0)
    coarse_model = _build_target(selection.coarse, layout, ds_config)
    writer = ModelWriter(coarse_model, selection.coarse, Groups.current(), local=True)
    _restrict_stream(_reader(fine_module, selection.fine), writer, selection, tee=before.params)
    staged = Staged(coarse_model, selection.coarse, True, step=before.step)
    for key in keys:
        before.moments[key] = _snapshot(key, keep, keep_dir)
        reader = _reader(fine_module, selection.fine, optimizer, key)
        if map_state:
            staged.moments[key] = Snapshot(_snapshot_group(True))
            _restrict_stream(reader, staged.moments[key], selection, tee=before.moments[key], degree=DEGREE[key])
        else:
            _copy_stream(reader, before.moments[key], selection.fine.num_layers)
    return staged, before


def prolong(coarse_module: torch.nn.Module, before: FineSnapshot, selection: LayerSelection, *, layout: Layout,
            prolongation: Prolongation = "correction", correction_scale: float = 1.0,
            ds_config: Optional[dict] = None, optimizer=None, state: OptimizerState = "reset") -> Staged:
    """Build the fine model again: ``before`` plus the prolonged change of the coarse model.

    ``state``: no optimizer state (``reset``), the fine state kept in ``before`` (``keep``), or that
    state with the selected layers' and shared parameters' taken back from the coarse optimizer
    ``optimizer`` (``map``).
    """
    fine_model = _build_target(selection.fine, layout, ds_config)
    writer = ModelWriter(fine_model, selection.fine, Groups.current(), local=True)
    _prolong_stream(_reader(coarse_module, selection.coarse), before.params, writer, selection, prolongation,
                    correction_scale)
    if state == "reset":
        return Staged(fine_model, selection.fine, True)
    if state == "keep":
        return Staged(fine_model, selection.fine, True, moments=dict(before.moments), step=before.step)
    staged = Staged(fine_model, selection.fine, True, step=_adam_step(optimizer))
    for key, kept in before.moments.items():
        staged.moments[key] = Snapshot(_snapshot_group(True))
        _map_back_stream(_reader(coarse_module, selection.coarse, optimizer, key), kept, staged.moments[key],
                         selection, DEGREE[key])
    return staged


def carry(module: torch.nn.Module, cfg: ModelConfig, *, layout: Layout, ds_config: Optional[dict] = None,
          optimizer=None, keys: Sequence[str] = ()) -> Staged:
    """The same level's model again, for a new phase; with ``keys``, its optimizer state too."""
    model = _build_target(cfg, layout, ds_config)
    _copy_stream(_reader(module, cfg), ModelWriter(model, cfg, Groups.current(), local=True), cfg.num_layers)
    staged = Staged(model, cfg, True, step=_adam_step(optimizer) if keys else 0)
    for key in keys:
        staged.moments[key] = Snapshot(_snapshot_group(True))
        _copy_stream(_reader(module, cfg, optimizer, key), staged.moments[key], cfg.num_layers)
    return staged


def snapshot_fine(module: torch.nn.Module, cfg: ModelConfig, *, optimizer=None, keys: Sequence[str] = (),
                  keep: Storage = "memory", keep_dir: Optional[str] = None) -> FineSnapshot:
    """The snapshot ``restrict`` keeps, taken again from a fine model (a resumed run's checkpoint
    of the phase before the coarse one)."""
    before = FineSnapshot(_snapshot("params", keep, keep_dir), step=_adam_step(optimizer) if keys else 0)
    _copy_stream(_reader(module, cfg), before.params, cfg.num_layers)
    for key in keys:
        before.moments[key] = _snapshot(key, keep, keep_dir)
        _copy_stream(_reader(module, cfg, optimizer, key), before.moments[key], cfg.num_layers)
    return before


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
    sources = prolongation_sources(selection, prolongation)
    for name in coarse_reader.layer_names:
        changes, fine_of = {}, {}
        for j, needs in enumerate(sources):
            for i, _ in needs:
                if i not in changes:
                    k = selection.layers[i]
                    fine_of[k] = before.read_layer(k, [name])
                    start = restrict_layer(fine_of[k], selection)
                    changes[i] = coarse_change(start, coarse_reader.read_layer(i, [name]), selection,
                                               correction_scale, layer=True)
            fine = fine_of.pop(j) if j in fine_of else before.read_layer(j, [name])
            writer.write_layer(j, add_change(fine, [(changes[i], w) for i, w in needs]))
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
