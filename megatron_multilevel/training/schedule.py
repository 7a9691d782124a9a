"""The phases of a run and the learning rate within each.

Training from scratch is one phase. A K-level V-cycle is ``2K - 1`` phases: each finer level
trains ``steps_before`` (the paper's ``E_a``) and is coalesced into the next, the coarsest level
trains, then every level is de-coalesced back in turn and trains ``steps_after``. A ``grow``
cycle is the way up only: the coarsest level from scratch, then each finer one. AdamW and the
learning-rate schedule restart at every phase (the paper's choice).
"""

import math
from dataclasses import dataclass

from megatron_multilevel.config import LRConfig, RunConfig


@dataclass(frozen=True)
class Phase:
    index: int
    level: int
    steps: int
    lr: LRConfig
    name: str  # "scratch", "before" (then coalesced), "coarsest", "after" (de-coalesced into)


def build_phases(cfg: RunConfig) -> list[Phase]:
    ml = cfg.multilevel
    if not ml.enabled:
        return [Phase(0, 0, cfg.training.train_steps, cfg.training.lr, "scratch")]
    k = ml.num_levels
    specs = []
    if ml.cycle == "v":
        specs += [(level, ml.levels[level].steps_before, ml.levels[level].lr_before, "before") for level in range(k - 1)]
    specs.append((k - 1, ml.levels[k - 1].steps_before, ml.levels[k - 1].lr_before, "coarsest"))
    for level in reversed(range(k - 1)):
        lv = ml.levels[level]
        specs.append((level, lv.steps_after, lv.lr_after or lv.lr_before, "after"))
    return [Phase(i, *spec) for i, spec in enumerate(specs)]


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
