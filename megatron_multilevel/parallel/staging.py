"""What every transition hands over: the layouts of the two levels, the fine model kept for the way
back, the new level's staged model and optimizer state, and the plain copy between them.

``coarsen`` / ``prolong`` (``transition.py``, the coalescing strategy), ``restrict`` / ``prolong`` /
``carry`` (``ode_transition.py``, the ODE strategy) and the checkpoint resharder share these. A
transition is handed a builder of its target model (``build_target``): it calls it after its readers
have captured the source layout's groups, since building switches the tensor-parallel size.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_multilevel.config import ZERO_STAGES, ModelConfig, undivided_size, valid_tp_sizes
from megatron_multilevel.config.pipeline import PipelineSplit
from megatron_multilevel.parallel.snapshot import Snapshot
from megatron_multilevel.parallel.streams import Groups, ModelWriter, vocab_slabs
from megatron_multilevel.parallel.zero import inner_torch_optimizer, materialize_optimizer_state


@dataclass(frozen=True)
class Layout:
    """How one level is laid out over the ranks (data parallelism takes the rest)."""

    tensor_model_parallel_size: int = 1
    zero_stage: int = 0
    pipeline: PipelineSplit = PipelineSplit()
    """The pipeline stages (one: no pipeline parallelism)."""

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


def check_layouts(fine_cfg: ModelConfig, coarse_cfg: ModelConfig, fine_layout: Layout, coarse_layout: Layout,
                  *, what: str = "level") -> None:
    """Raise ``ValueError`` if either model cannot be laid out in its layout on this world."""
    world = dist.get_world_size()
    fine_layout.check(fine_cfg, world, f"fine {what} layout")
    coarse_layout.check(coarse_cfg, world, f"coarse {what} layout")


@dataclass
class FineSnapshot:
    """The fine model as it was just before coalescing or restriction (and its optimizer state, if
    that is carried)."""

    params: Snapshot
    moments: dict[str, Snapshot] = field(default_factory=dict)
    step: int = 0


@dataclass
class Staged:
    """A level's model with its parameters in place, and optimizer state to load after initialize."""

    model: torch.nn.Module
    cfg: ModelConfig
    local: bool
    moments: dict[str, Snapshot] = field(default_factory=dict)
    step: int = 0


def optimizer_step(optimizer) -> int:
    """The optimizer's step count (Adam's and AdamW's ``step`` state; 0 for SGD, which keeps none,
    and without an optimizer): what mapped moments are bias-corrected with after a transition."""
    if optimizer is None:
        return 0
    steps = [int(s["step"]) for s in inner_torch_optimizer(optimizer).state.values() if "step" in s]
    return max(steps, default=0)


def snapshot_group(local: bool):
    """The group a snapshot is partitioned over: on the fast (shard-local) path the data-parallel
    ranks that hold the same shard; otherwise all ranks (full tensors)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group() if local else None


def load_moments(engine, staged: Staged) -> None:
    """Load staged optimizer moments (Adam's, or SGD's momentum) into a freshly initialised
    DeepSpeed engine (ZeRO 0-3)."""
    if staged.moments:
        write_optimizer_state(engine, staged.cfg, staged.moments, staged.step, local=staged.local)


def write_optimizer_state(engine, cfg: ModelConfig, readers: dict, step: int, *, local: bool = False) -> None:
    """Write the optimizer state read from ``readers`` (a reader per state key: ``exp_avg``,
    ``exp_avg_sq`` or ``momentum_buffer``, of the parameters that keep it; full tensors, or with
    ``local`` this rank's shards) into a freshly initialised DeepSpeed engine (ZeRO 0-3) of a model
    of ``cfg``, with Adam's step count ``step``."""
    materialize_optimizer_state(engine.optimizer, tuple(readers))
    for key, reader in readers.items():
        writer = ModelWriter(engine.module, cfg, Groups.current(), local=local, optimizer=engine.optimizer,
                             state_key=key)
        copy_stream(reader, writer, cfg.num_layers, cfg=cfg)
    if "exp_avg" not in readers:
        return  # SGD's momentum has no step count
    # Adam's bias correction continues from the step count the moments were built over (Muon's
    # momentum has none: only its auxiliary Adam's states).
    for state in inner_torch_optimizer(engine.optimizer).state.values():
        if "exp_avg" in state:
            state["step"] = torch.tensor(float(step))


def copy_stream(reader, writer, num_layers: int, *, cfg: Optional[ModelConfig] = None) -> None:
    """Copy parameter by parameter; with ``cfg`` (the model's), the vocabulary slab by slab."""
    for name in reader.model_names:
        for rows in [None] if cfg is None else vocab_slabs(reader, name, cfg):
            writer.write_model(reader.read_model([name], rows), rows)
    for i in range(num_layers):
        for name in reader.layer_names:
            writer.write_layer(i, reader.read_layer(i, [name]))
