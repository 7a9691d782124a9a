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
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megatron_multilevel.config import LevelConfig, LRConfig, MultilevelConfig, OdeConfig, RunConfig
from megatron_multilevel.cycles import Arrival, arrivals


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
    phases = _ode_phases(ml.ode) if ml.strategy == "ode" else _cycle_phases(ml)
    return _continued(phases) if ml.lr_schedule == "continue" else phases


def _continued(phases: list[Phase]) -> list[Phase]:
    """``phases`` on one learning-rate schedule over all their steps: the warm-up of the first
    phase that trains, one decay to the end of the last."""
    trained = [p for p in phases if p.steps]
    assert trained, "a multilevel run trains"
    first = trained[0].lr
    for p in trained[1:]:
        if (p.lr.decay, p.lr.min_ratio) != (first.decay, first.min_ratio):
            raise ValueError(
                f"multilevel.lr_schedule = \"continue\" runs one schedule over the whole run, so every phase "
                f"needs the same lr decay and min_ratio: the first phase (level {trained[0].level}) has "
                f"decay {first.decay!r}, min_ratio {first.min_ratio}; phase {p.index} ({p.name}, level "
                f"{p.level}) has decay {p.lr.decay!r}, min_ratio {p.lr.min_ratio}. Make them equal, or use "
                f"lr_schedule \"restart\" (valid choices: restart, continue)"
            )
    total, before, out = sum(p.steps for p in phases), 0, []
    for p in phases:
        out.append(dataclasses.replace(p, run_schedule=(before, total, first)))
        before += p.steps
    return out


def _cycle_phases(ml: MultilevelConfig) -> list[Phase]:
    walk = ml.walk()
    coarsest = ml.num_levels - 1
    phases = []
    for i, (level, arrival) in enumerate(zip(walk, arrivals(walk))):
        following = walk[i + 1] if i + 1 < len(walk) else None
        name = "coarsest" if level == coarsest else "before" if following == level + 1 else "after"
        visit = walk[:i].count(level)
        steps, lr = _visit_schedule(ml.levels[level], name, visit)
        phases.append(Phase(i, level, steps, lr, name, visit=visit, arrival=arrival))
    return phases


def _ode_phases(ode: OdeConfig) -> list[Phase]:
    """``pre``, ``coarse``, ``post`` per cycle, then ``final``; empty fine phases only where the
    model must be at the fine level."""
    specs = []  # (level, steps, lr, name, cycle, parity)
    for c in range(ode.cycles):
        if ode.pre_steps or not specs or specs[-1][0] == 1:
            specs.append((0, ode.pre_steps, ode.fine_lr, "pre", c, None))
        specs.append((1, ode.coarse_steps, ode.coarse_lr, "coarse", c, ode.parity(c)))
        if ode.post_steps:
            specs.append((0, ode.post_steps, ode.fine_lr, "post", c, None))
    if ode.final_steps or specs[-1][0] == 1:
        specs.append((0, ode.final_steps, ode.final_lr or ode.fine_lr, "final", None, None))
    phases = []
    for i, (level, steps, lr, name, cycle, parity) in enumerate(specs):
        visit = sum(1 for p in phases if p.level == level)
        previous = phases[-1].level if phases else None
        arrival = ("fresh" if previous is None else "restrict" if level > previous else
                   "prolong" if level < previous else "continue")
        phases.append(Phase(i, level, steps, lr, name, visit=visit, arrival=arrival, cycle=cycle, parity=parity))
    return phases


def _visit_schedule(lv: LevelConfig, name: str, visit: int) -> tuple[int, LRConfig]:
    """Steps and schedule of ``visit`` of a level, a phase called ``name``."""
    if lv.visits is not None:
        return lv.visits[visit].steps, lv.visits[visit].lr
    if name == "after":
        return lv.steps_after, lv.lr_after or lv.lr_before
    return lv.steps_before, lv.lr_before


def lr_factor(step: int, total: int, lr: LRConfig) -> float:
    """Multiplier of ``lr.peak`` at ``step`` (0-based) of a phase of ``total`` steps."""
    if lr.warmup_steps and step < lr.warmup_steps:
        return (step + 1) / lr.warmup_steps
    if lr.decay == "constant":
        return 1.0
    span = max(1, total - lr.warmup_steps)
    progress = min(1.0, (step - lr.warmup_steps) / span)
    if lr.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr.min_ratio + (1.0 - lr.min_ratio) * shape


def schedule_signature(phases: list[Phase]) -> list[dict]:
    """What a resumed run's schedule must match, as checkpoints record it: level and steps of
    every phase (and the ODE coarse parity)."""
    return [{"level": p.level, "steps": p.steps, **({} if p.parity is None else {"parity": p.parity})}
            for p in phases]
