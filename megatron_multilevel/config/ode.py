"""The ``multilevel.ode`` block: the multilevel ODE strategy (Lauga et al. 2025)."""

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_multilevel.config.deepspeed import check_deepspeed_keys
from megatron_multilevel.config.parsing import check_positive
from megatron_multilevel.config.training import LRConfig, PhaseSpec

RESIDUAL_SCALES = (1, 2)


@dataclass
class OdeConfig:
    """The multilevel ODE strategy (Lauga et al. 2025): a coarse model of every other layer, taking
    Euler steps twice as long, trained between fine phases; its change is written back."""

    coarse: Literal["alternate", "even", "odd"] = "alternate"
    """Which fine layers each coarse model keeps: ``even`` (0, 2, 4, ...), ``odd`` (1, 3, 5, ...), or
    ``alternate``: even in the first cycle, odd in the second, and so on."""
    residual_scale: int = 2
    """The coarse step size ``h``, 1 or 2: a coarse layer's residual-branch outputs (attention
    output projection and second FFN linear, weight and bias) count ``h`` times, as ``parametrisation``
    says."""
    parametrisation: Literal["folded", "explicit"] = "folded"
    """Where the coarse step ``h`` goes. ``folded``: the residual-branch outputs' weights and biases
    are multiplied by ``h`` on restriction and their change is divided by it when written back.
    ``explicit``: they are copied and written back unscaled, and the coarse model's forward pass
    multiplies each attention and MLP block's output (bias included) by ``h``. From the same fine
    model both coarse models compute the same function; at ``h`` 2 their gradients, and so their
    training, differ."""
    prolongation: Literal["correction", "constant", "linear"] = "correction"
    """How the coarse change ``end - start`` is written back: ``correction`` adds each coarse layer's
    change to its own fine layer (and the shared parameters' to theirs), the other layers untouched;
    ``constant`` also adds it to the skipped layer of the same pair (``2i`` and ``2i + 1``);
    ``linear`` gives each skipped layer the mean of its two neighbours' changes (the one at an end)."""
    coherence: Literal["none", "first_order"] = "none"
    """``first_order``: the MG/OPT tau correction. At restriction, on the first coarse batch,
    ``v = P^T grad L_fine(theta) - grad L_coarse(R theta)`` is computed and added to every coarse
    gradient of that coarse phase, so that the coarse gradient at the restricted point is the fine
    gradient restricted by the adjoint of the prolongation (``P^T``: residual-branch gradients
    divided by ``residual_scale`` where parameters are multiplied by it, ``folded``, and copied,
    ``explicit``; a pair's or neighbours' gradients summed as ``prolongation`` spreads the change),
    and a descent direction there is one of the fine loss once prolonged. Its passes count in FLOPs."""
    coherence_batches: int = 1
    """With ``first_order`` coherence: how many training batches ``v`` is averaged over (the coarse
    phase's first ones; no more than ``coarse_steps``). Built on one batch, the constant term is as
    wrong on the next as the minibatch noise between them; each batch costs a fine and a coarse
    gradient pass, counted in FLOPs."""
    coherence_max_ratio: Optional[float] = 1.0
    """With ``first_order`` coherence: the gate. At each restriction the coarse model's coherence
    ``rho = |v| / |P^T grad L_fine|`` is measured; above this ratio the coarse model is not a useful
    first-order model of the fine one there (``v`` cancels its own gradient, and the corrected
    objective descends along ``-v`` without bound), so the phase trains the coarse loss alone and
    says so. ``v``'s gradient passes are spent (and counted) either way. Null: no gate, the term
    always installed."""
    trust_radius: Optional[float] = None
    """A bound on the written-back change in fine units: where ``|P (theta_H_end - theta_H_start)|``
    times ``correction_scale`` exceeds it, the change is scaled down to it (before the line search,
    if any). Null: no bound. A knob for studying the coherence term, not a measured default."""
    correction_scale: float = 1.0
    """Step size on the written-back change."""
    line_search: bool = False
    """Backtracking on one fine batch (the first one after the coarse phase): while the fine loss with
    the change written back is above the loss before the coarse phase, halve the change (3 times at
    most, then drop it). Its forward passes count in FLOPs."""
    optimizer_state: Literal["reset", "keep", "map"] = "reset"
    """At every phase: a fresh optimizer (``reset``); the fine optimizer's state carried over and
    kept across each coarse phase, the coarse one fresh (``keep``); or ``keep`` plus the state of the
    selected layers and shared parameters carried into the coarse optimizer and back (``map``)."""
    pre_steps: int = 10
    """Fine steps before each coarse phase (pre-smoothing)."""
    coarse_steps: int = 10
    """Steps of each coarse phase."""
    post_steps: int = 10
    """Fine steps after each coarse phase (post-smoothing)."""
    cycles: int = 1
    """Number of (pre, coarse, post) cycles."""
    final_steps: int = 0
    """Fine steps after the last cycle."""
    fine_lr: LRConfig = field(default_factory=LRConfig)
    """Schedule of every pre- and post-smoothing phase."""
    coarse_lr: LRConfig = field(default_factory=LRConfig)
    """Schedule of every coarse phase."""
    final_lr: Optional[LRConfig] = None
    """Schedule of the final fine phase; null means ``fine_lr``."""
    first_lr: Optional[LRConfig] = None
    """Schedule of the run's first phase that trains (the first pre-smoothing, or with ``pre_steps`` 0
    the first coarse phase), e.g. ``fine_lr`` with a warm-up that the later phases do not repeat;
    null means that phase's own."""
    coarse_tensor_model_parallel_size: Optional[int] = None
    """Tensor-parallel size of the coarse models (data parallelism takes the other ranks); null means
    ``parallel.tensor_model_parallel_size``."""
    coarse_deepspeed: dict = field(default_factory=dict)
    """DeepSpeed keys overridden for the coarse models (deep-merged), e.g. ``{"zero_optimization": {"stage": 3}}``."""

    def __post_init__(self):
        if self.coarse_tensor_model_parallel_size is not None:
            check_positive("multilevel.ode.coarse_tensor_model_parallel_size", self.coarse_tensor_model_parallel_size)
        check_deepspeed_keys(self.coarse_deepspeed, "multilevel.ode.coarse_deepspeed")
        if self.residual_scale not in RESIDUAL_SCALES:
            raise ValueError(
                f"multilevel.ode.residual_scale: invalid value {self.residual_scale!r}; "
                f"valid choices are {list(RESIDUAL_SCALES)}"
            )
        if self.correction_scale <= 0:
            raise ValueError(f"multilevel.ode.correction_scale must be positive, got {self.correction_scale}")
        for name in ("pre_steps", "post_steps", "final_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"multilevel.ode.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("coarse_steps", "cycles", "coherence_batches"):
            check_positive(f"multilevel.ode.{name}", getattr(self, name))
        for name in ("coherence_max_ratio", "trust_radius"):
            value = getattr(self, name)
            if value is not None and value <= 0:  # a number or null: the parser checked its type
                raise ValueError(f"multilevel.ode.{name} must be a positive number or null, got {value!r}")
        if self.coherence == "first_order" and not self.line_search:
            raise ValueError("multilevel.ode.coherence = \"first_order\" needs multilevel.ode.line_search = true: "
                             "unguarded, the constant term can drive the coarse model along -v and the written-back "
                             "change raise the fine loss (MG/OPT's convergence rests on that search); set "
                             "line_search true, or coherence \"none\"")
        if self.coherence_batches > self.coarse_steps:
            raise ValueError(f"multilevel.ode.coherence_batches ({self.coherence_batches}) must not exceed "
                             f"multilevel.ode.coarse_steps ({self.coarse_steps}): it averages the coarse "
                             f"phase's batches")

    def phase_specs(self) -> list[PhaseSpec]:
        """``pre``, ``coarse``, ``post`` per cycle, then ``final``; empty fine phases only where the
        model must be at the fine level (at the start, between two coarse phases, at the end)."""
        specs: list[PhaseSpec] = []
        for c in range(self.cycles):
            if self.pre_steps or not specs or specs[-1].level == 1:
                specs.append(PhaseSpec(0, self.pre_steps, self.fine_lr, "pre", c))
            specs.append(PhaseSpec(1, self.coarse_steps, self.coarse_lr, "coarse", c, self.parity(c)))
            if self.post_steps:
                specs.append(PhaseSpec(0, self.post_steps, self.fine_lr, "post", c))
        if self.final_steps or specs[-1].level == 1:
            specs.append(PhaseSpec(0, self.final_steps, self.final_lr or self.fine_lr, "final"))
        first = next((i for i, spec in enumerate(specs) if spec.steps), None)
        if self.first_lr is not None and first is not None:
            specs[first] = specs[first]._replace(lr=self.first_lr)
        return specs

    def parity(self, cycle: int) -> int:
        """The layers the coarse model of ``cycle`` keeps: 0 even, 1 odd."""
        if self.coarse == "alternate":
            return cycle % 2
        return 0 if self.coarse == "even" else 1
