"""The ``training`` block and the learning-rate schedule of a phase (``LRConfig``, used by every block
that schedules steps)."""

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional

from megatron_multilevel.config.optimizers import MAX_LR
from megatron_multilevel.config.parsing import check_positive

@dataclass
class LRConfig:
    """A learning-rate schedule for one phase of training (AdamW restarts at every phase)."""

    peak: float = 1e-3
    """Peak learning rate, reached after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to ``peak``."""
    decay: Literal["cosine", "linear", "1-sqrt", "constant"] = "cosine"
    """Decay from ``peak`` to ``peak * min_ratio`` over the rest of the phase (or its last
    ``decay_fraction``): half a cosine, a straight line, or ``1 - sqrt(progress)`` (the cooldown
    shape Hägele et al., 2024, found best for warmup-stable-decay schedules)."""
    min_ratio: float = 0.1
    """Final learning rate as a fraction of ``peak``."""
    decay_fraction: float = 1.0
    """The share of the steps after warm-up that the decay takes, at the end; before it the rate
    stays at ``peak`` (1: the decay starts right after warm-up; below 1: warm-up, stable, decay,
    as MiniCPM and DeepSeek schedule pretraining: a WSD schedule, usually with ``min_ratio`` 0).
    Ignored by ``constant``."""

    def __post_init__(self):
        if not 0 < self.peak <= MAX_LR:
            raise ValueError(f"lr.peak must be in (0, {MAX_LR:g}], got {self.peak}")
        if self.warmup_steps < 0:
            raise ValueError(f"lr.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"lr.min_ratio must be in [0, 1], got {self.min_ratio}")
        if isinstance(self.decay_fraction, bool) or not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"lr.decay_fraction must be in (0, 1], got {self.decay_fraction!r}")

    def decay_steps(self, total: int) -> int:
        """How many steps of a schedule of ``total`` steps the decay takes: the last
        ``decay_fraction`` of those after warm-up (at least one)."""
        return max(1, round(self.decay_fraction * max(1, total - self.warmup_steps)))

    def decay_start(self, total: int) -> int:
        """The step (0-based) of a schedule of ``total`` steps after which the rate decays; before
        it, after warm-up, the rate is the peak."""
        return self.warmup_steps + max(1, total - self.warmup_steps) - self.decay_steps(total)


class PhaseSpec(NamedTuple):
    """What the config says of one phase of a multilevel run: the level it trains, for how many
    steps, on which schedule; its name; with the ODE strategy its cycle and coarse parity."""

    level: int
    steps: int
    lr: LRConfig
    name: str
    cycle: Optional[int] = None
    parity: Optional[int] = None


@dataclass
class TrainingConfig:
    """The training loop."""

    seed: int = 1234
    """Seed of initialisation, data order and noise."""
    output_dir: str = "runs/default"
    """Run directory: checkpoints, metrics, TensorBoard events, summary."""
    train_steps: int = 600
    """Steps of the fine model when ``multilevel.enabled`` is false (training from scratch)."""
    lr: LRConfig = field(default_factory=LRConfig)
    """Schedule when ``multilevel.enabled`` is false."""
    steps_scale: float = 1.0
    """Every phase's steps and warm-up (and MSG's mask, LiGO's operator steps, the ODE strategy's
    coherence batches) times this, in (0, 1], rounded up: a short run of any config, for a first try
    or a smoke test (``training.steps_scale=0.1``). Applied as the config is read
    (``config/scale.py``): the config a run records holds the scaled steps, and 1 here."""
    log_interval: int = 10
    """Steps between console lines and metric records."""
    eval_interval: int = 50
    """Steps between validation losses (and at the end of every phase)."""
    eval_batches: int = 8
    """Global batches of the held-out split per validation."""
    save_interval: int = 100
    """Steps between checkpoints (a checkpoint is also saved at every transition); 0: only those."""
    keep_checkpoints: int = 2
    """Periodic checkpoints kept besides the ones a resume may still need."""
    stop_grace_seconds: float = 0.0
    """On SIGTERM or SIGINT a run finishes its step, saves a checkpoint and exits with status 75
    (``training/stop.py``); if that takes longer than this, it exits at once instead, the last
    complete checkpoint kept (set it below the scheduler's grace period, e.g. SLURM's KillWait).
    0: no limit of its own."""

    transition_check: Literal["error", "warn", "off"] = "error"
    """At every transition, the loss on one fixed held-out batch (the validation split's first
    global batch) just before, just after and after ``transition_check_steps`` steps: in the metrics
    (``transition`` records), the next phase's summary row and one progress line
    (``training/transition_check.py``). A transition that preserves the function (a growth whose
    model computes the smaller one) and moves that loss by more than ``transition_check_tolerance``
    stops the run with one line (``error``) or says so (``warn``); ``off``: no check."""
    transition_check_steps: int = 10
    """The steps after a transition at which the check batch's loss is measured again."""
    transition_check_tolerance: float = 1e-3
    """The largest move (nats) of a function-preserving transition's check loss: float rounding
    in fp32 is orders of magnitude below it; bf16 runs may need about 1e-2."""

    def __post_init__(self):
        check_steps_scale(self.steps_scale)
        for name in ("train_steps", "log_interval", "eval_interval", "eval_batches", "transition_check_steps"):
            check_positive(f"training.{name}", getattr(self, name))
        if not self.stop_grace_seconds >= 0:
            raise ValueError(f"training.stop_grace_seconds must be >= 0 (0: no limit), got {self.stop_grace_seconds}")
        if isinstance(self.transition_check_tolerance, bool) or not self.transition_check_tolerance > 0:
            raise ValueError(f"training.transition_check_tolerance must be a number > 0, got "
                             f"{self.transition_check_tolerance!r}")
        if self.save_interval < 0 or self.keep_checkpoints < 1:
            raise ValueError("training.save_interval must be >= 0 and training.keep_checkpoints >= 1")


def check_steps_scale(value) -> None:
    """Raise a ValueError naming ``training.steps_scale`` unless ``value`` is a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"training.steps_scale must be a number in (0, 1] (1: the config's own steps; 0.1: a tenth "
                         f"of them), got {value!r}")
