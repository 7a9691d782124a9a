"""What a cycle needs of the run it drives: the levels' engines, the data, the run's state and
metrics, and the batch and loss of any step.

The trainer builds one :class:`RunContext` and hands it to the cycle of its strategy
(``coalesce_cycle.CoalesceCycle`` or ``ode_cycle.OdeCycle``): both read and write the run through
it, and neither reaches into the trainer.
"""

import os
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from megatron_multilevel.config import RunConfig
from megatron_multilevel.data.datasets import Batch, Data, micro_batches, sample_indices
from megatron_multilevel.level_maps import LevelMap
from megatron_multilevel.models import language_model_loss
from megatron_multilevel.training.checkpoint import RunState
from megatron_multilevel.training.engines import LevelEngines
from megatron_multilevel.training.metrics import Metrics
from megatron_multilevel.training.schedule import Phase


def device() -> torch.device:
    """Where this rank computes: its GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class RunContext:
    """One run: its config and phases, the engines of its levels, and, once it has started, its
    state, metrics, data and level maps."""

    cfg: RunConfig
    phases: list[Phase]
    levels: LevelEngines
    state: Optional[RunState] = None
    """Where the run is (set when it starts or resumes)."""
    metrics: Optional[Metrics] = None
    """Console lines and metric records (set when it starts or resumes)."""
    data: Optional[Data] = None
    """The training and validation splits (set once the run has started)."""
    level_maps: list[LevelMap] = field(default_factory=list)
    """The coalescing maps between the levels (the checkpoint's, on resume)."""

    @property
    def run_dir(self) -> str:
        return self.cfg.training.output_dir

    @property
    def seq(self) -> int:
        return self.cfg.data.seq_length

    @property
    def tokens_per_step(self) -> int:
        return self.levels.global_batch * self.seq

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def engine(self, model: torch.nn.Module, phase: Phase):
        """A DeepSpeed engine of ``model`` for ``phase`` (its level's layout, a fresh optimizer, the
        phase's learning-rate schedule)."""
        return self.levels.engine(model, phase.level, phase.lr.peak, phase.lr_factor)

    def batch(self, dataset, level: int, step: int, micro: int) -> Batch:
        """Micro-batch ``micro`` of global step ``step`` of ``dataset``, this rank's part at ``level``."""
        from megatron.core import parallel_state

        indices = sample_indices(
            step, micro, global_batch=self.levels.global_batch, micro_batch=self.levels.micro_batch(level),
            dp_rank=parallel_state.get_data_parallel_rank(), accumulation=self.levels.accumulation,
        )
        return micro_batches(dataset, self.cfg.model.kind, indices).to(device())

    def loss(self, level: int, batch: Batch, model) -> torch.Tensor:
        """The language-model loss of ``model`` (an engine or a module) of ``level`` on ``batch``."""
        return language_model_loss(
            model, self.levels.models[level], batch.tokens, batch.labels, batch.loss_mask,
            padding_mask=batch.padding_mask, tokentype_ids=batch.tokentype_ids,
        )

    def keep_dir(self, level: int) -> str:
        """Where a kept fine model of ``level`` lives with ``keep_fine = "disk"``."""
        return os.path.join(self.run_dir, "snapshots", f"level{level}")


@dataclass
class Transition:
    """What a cycle's transition into the next phase did."""

    engine: object
    """The next phase's DeepSpeed engine."""
    what: str
    """What was done, for the console."""
    extra_flops: float = 0.0
    """FLOPs it spent beyond the phases' steps (the ODE strategy's coherence and line search)."""
    row: dict = field(default_factory=dict)
    """Fields it adds to the next phase's summary row."""


class PhaseHook(Protocol):
    """What a cycle adds to the steps of one phase (MSG's layer mask): the trainer calls ``at``
    before every step and every evaluation, and ``finish`` when the phase has trained its steps."""

    def at(self, step: int) -> object:
        """Set up for step ``step`` (0-based) of the phase."""

    def finish(self, step: int) -> None:
        """The phase ended after ``step`` steps."""
