"""The phases of a run and the learning rate within each.

The ODE strategy (``multilevel.strategy = "ode"``) is its own list: per cycle a fine ``pre`` phase,
a ``coarse`` phase of every other layer (level 1) and a fine ``post`` phase, then a ``final`` fine
phase. A fine phase with no steps is left out unless the model must pass through the fine level
there (at the start, between two coarse phases, at the end).

Training from scratch is one phase. Otherwise every visit of a level in the cycle
(``MultilevelConfig.walk``) is a phase. A K-level V-cycle is ``2K - 1`` phases: each finer level
trains ``steps_before`` (the paper's ``E_a``) and is coalesced into the next, the coarsest level
trains, then every level is de-coalesced back in turn and trains ``steps_after``. A ``grow``
cycle is the way up only: the coarsest level from scratch, then each finer one. W- and
F-cycles use the same rule: a visit that ends by coalescing trains ``steps_before``, the
coarsest level always does, every other visit trains ``steps_after``; ``levels[i].visits``
replaces the rule. AdamW restarts at every phase unless ``optimizer_state = "map"`` carries its
moments; the learning-rate schedule restarts at every phase (the paper's choice) or, with
``multilevel.lr_schedule = "continue"``, runs once over the whole run (``Phase.lr_factor``).

The config says each phase's level, steps and schedule (``MultilevelConfig.phase_specs``, checked
when it is read); ``cycles.py`` says how each is reached; this module makes them ``Phase`` objects
and holds the learning rate within each.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megatron_multilevel.config import LRConfig, RunConfig
from megatron_multilevel.cycles import Arrival, arrivals, ode_arrivals
from megatron_multilevel.flops import flops_per_token


@dataclass(frozen=True)
class Phase:
    """One visit of a level: what it trains, for how long, and how the model gets there."""

    index: int
    level: int
    steps: int
    lr: LRConfig
    name: str
    """``scratch``, ``before`` (ends by coalescing), ``coarsest`` or ``after`` (ends by de-coalescing,
    or ends the run); with the ODE strategy ``pre``, ``coarse``, ``post`` or ``final``."""
    visit: int
    """How many earlier phases trained this level."""
    arrival: Arrival
    """How the model gets here: initialised (or loaded), by coalescing the finer level, by
    de-coalescing the coarser one and interpolating with this level's model from before it was
    coalesced, or by de-coalescing with nothing to interpolate with (growing, alpha 1); with the
    ODE strategy by restriction, by prolongation (the coarse change written back), or by carrying
    the same level's model over into a new phase (``continue``)."""
    cycle: Optional[int] = None
    """ODE strategy: the cycle the phase belongs to (None for the final phase)."""
    parity: Optional[int] = None
    """ODE strategy, coarse phases: the fine layers the coarse model keeps (0 even, 1 odd)."""
    run_schedule: Optional[tuple[int, int, LRConfig]] = None
    """With ``multilevel.lr_schedule = "continue"``: the steps of the run before this phase, the
    steps of the whole run and the run's schedule (its peak unused); None: the phase's own."""

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr.peak`` at ``step`` (0-based) of this phase."""
        if self.run_schedule is None:
            return lr_factor(step, self.steps, self.lr)
        before, total, run = self.run_schedule
        factor = lr_factor(before + step, total, run)
        if before and self.lr.warmup_steps and step < self.lr.warmup_steps:
            factor *= (step + 1) / self.lr.warmup_steps  # a re-warm-up to where the run stands
        return factor


def build_phases(cfg: RunConfig) -> list[Phase]:
    ml = cfg.multilevel
    if not ml.enabled:
        return [Phase(0, 0, cfg.training.train_steps, cfg.training.lr, "scratch", visit=0, arrival="fresh")]
    specs = ml.phase_specs()
    levels = [spec.level for spec in specs]
    how = ode_arrivals(levels) if ml.strategy == "ode" else arrivals(ml.walk())
    phases = [Phase(i, spec.level, spec.steps, spec.lr, spec.name, visit=levels[:i].count(spec.level), arrival=arrival,
                    cycle=spec.cycle, parity=spec.parity)
              for i, (spec, arrival) in enumerate(zip(specs, how))]
    return _continued(phases) if ml.lr_schedule == "continue" else phases


def _continued(phases: list[Phase]) -> list[Phase]:
    """``phases`` on one learning-rate schedule over all their steps: the warm-up of the first
    phase that trains, one decay to the end of the last (every phase has its decay and min_ratio:
    ``RunConfig`` checks it)."""
    trained = [p for p in phases if p.steps]
    assert trained, "a multilevel run trains"
    first = trained[0].lr
    assert all((p.lr.decay, p.lr.min_ratio, p.lr.decay_fraction) == (first.decay, first.min_ratio, first.decay_fraction)
               for p in trained), phases
    total, before, out = sum(p.steps for p in phases), 0, []
    for p in phases:
        out.append(dataclasses.replace(p, run_schedule=(before, total, first)))
        before += p.steps
    return out


def lr_factor(step: int, total: int, lr: LRConfig) -> float:
    """Multiplier of ``lr.peak`` at ``step`` (0-based) of a phase of ``total`` steps."""
    if lr.warmup_steps and step < lr.warmup_steps:
        return (step + 1) / lr.warmup_steps
    if lr.decay == "constant":
        return 1.0
    progress = min(1.0, max(0, step - lr.decay_start(total)) / lr.decay_steps(total))  # before it: the peak
    if lr.decay == "linear":
        shape = 1.0 - progress
    elif lr.decay == "1-sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr.min_ratio + (1.0 - lr.min_ratio) * shape


def fine_equivalent_steps(cfg: RunConfig, phases: list[Phase]) -> float:
    """The run's training FLOPs in steps of the full model: every phase's steps at its level's cost
    (every level trains the same tokens per step; a run from scratch: its steps)."""
    models, seq = cfg.level_models(), cfg.data.seq_length
    return sum(p.steps * flops_per_token(models[p.level], seq) for p in phases) / flops_per_token(models[0], seq)


def schedule_signature(phases: list[Phase]) -> list[dict]:
    """What a resumed run's schedule must match, as checkpoints record it: level and steps of
    every phase (and the ODE coarse parity)."""
    return [{"level": p.level, "steps": p.steps, **({} if p.parity is None else {"parity": p.parity})}
            for p in phases]
