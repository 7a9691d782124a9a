"""The ``multilevel`` block: the method, the operators' settings and the shape of the cycle over the
levels, with each level's schedule (``levels``) or the ODE strategy's block (``ode``)."""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_multilevel.config.deepspeed import check_deepspeed_keys
from megatron_multilevel.config.ode import OdeConfig
from megatron_multilevel.config.parsing import check_alpha, check_choice
from megatron_multilevel.config.training import LRConfig, PhaseSpec
from megatron_multilevel.cycles import arrivals, visit_order

STRATEGIES = ("coalesce", "ode")
WIDTH_GROWTHS = ("fpi", "aki")
# MultilevelConfig keys that only the coalesce strategy reads (keep_fine and enabled serve both).
COALESCE_ONLY_KEYS = ("num_levels", "coalesce_width", "coalesce_depth", "width_pairing", "depth_pairing",
                      "depth_scaling", "alpha", "interpolation", "cycle", "levels", "optimizer_state",
                      "perturbation_std", "growth_mask_steps", "growth_operator", "ligo_steps", "ligo_lr",
                      "width_growth", "grown_moments")
GROWTH_OPERATORS = ("copy", "ligo", "random")
GROWN_MOMENTS = ("map", "zero")


@dataclass
class VisitConfig:
    """The steps and schedule of one visit of a level in the cycle."""

    steps: int = 0
    """Steps trained in this visit."""
    lr: LRConfig = field(default_factory=LRConfig)
    """Schedule of those steps."""

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"multilevel.levels[*].visits[*].steps must be >= 0, got {self.steps}")


@dataclass
class LevelConfig:
    """One level of the cycle (level 0 is the fine model)."""

    steps_before: int = 0
    """Steps of every visit of this level that ends by coalescing it (the paper's ``E_a``), and
    of every visit of the coarsest level."""
    lr_before: LRConfig = field(default_factory=LRConfig)
    """Schedule of the steps before coalescing (and of the coarsest level)."""
    steps_after: int = 0
    """Steps of every visit that ends by de-coalescing into the finer level, or ends the run
    (0 for the coarsest level)."""
    lr_after: Optional[LRConfig] = None
    """Schedule of the steps after de-coalescing; null means ``lr_before``."""
    visits: Optional[list[VisitConfig]] = None
    """Steps and schedule of each visit of this level, in the order the cycle makes them, instead
    of the rule above; one entry per visit (a W-cycle visits a level several times). Null: the rule."""
    alpha: Optional[float] = None
    """Interpolation weight when this level is rebuilt from the next; null means
    ``multilevel.alpha``."""
    tensor_model_parallel_size: Optional[int] = None
    """Tensor-parallel size at this level; null means ``parallel.tensor_model_parallel_size``."""
    pipeline_model_parallel_size: Optional[int] = None
    """Pipeline stages at this level; null means ``parallel.pipeline_model_parallel_size``."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on this level's first stage where its split is uneven (null: an even share; level 0
    defaults to ``parallel.num_layers_in_first_pipeline_stage``)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on this level's last stage where its split is uneven (as the first stage's)."""
    deepspeed: dict = field(default_factory=dict)
    """DeepSpeed keys overridden at this level (deep-merged), e.g. ``{"zero_optimization": {"stage": 3}}``."""

    def __post_init__(self):
        if self.steps_before < 0 or self.steps_after < 0:
            raise ValueError("multilevel.levels[*].steps_before and steps_after must be >= 0")
        if self.alpha is not None:
            check_alpha(self.alpha, "multilevel.levels[*].alpha")
        check_deepspeed_keys(self.deepspeed, "multilevel.levels[*].deepspeed")

    def visit_schedule(self, name: str, visit: int) -> tuple[int, LRConfig]:
        """Steps and schedule of ``visit`` (0-based) of this level, a phase called ``name``."""
        if self.visits is not None:
            return self.visits[visit].steps, self.visits[visit].lr
        if name == "after":
            return self.steps_after, self.lr_after or self.lr_before
        return self.steps_before, self.lr_before


@dataclass
class MultilevelConfig:
    """The operators and the shape of the cycle over the levels."""

    enabled: bool = False
    """Run the cycle; false trains the fine model from scratch (the baseline)."""
    strategy: Literal["coalesce", "ode"] = "coalesce"
    """The multilevel method: ``coalesce`` (Zou et al.: coalesce, de-coalesce, interpolate; the keys
    below) or ``ode`` (Lauga et al.: every other layer, the change written back; the ``ode`` block)."""
    ode: Optional[OdeConfig] = None
    """The ODE strategy's settings (only with ``strategy = "ode"``; null there means the defaults)."""
    num_levels: int = 2
    """Number of levels of the cycle, the fine model included (2 or more)."""
    coalesce_width: bool = True
    """Halve hidden size, heads, query groups and FFN width at each level."""
    coalesce_depth: bool = True
    """Halve the number of layers at each level."""
    width_pairing: Literal["halves", "adjacent"] = "halves"
    """Which units are grouped: ``j`` with ``j + n/2`` (the paper's ``[I/2, I/2]``), or ``2i`` with
    ``2i+1``. Made local to each tensor-parallel shard when TP > 1."""
    depth_pairing: Literal["adjacent", "halves"] = "adjacent"
    """Which layers are averaged: ``(2i, 2i+1)`` (the paper) or ``(i, i + L/2)``."""
    depth_scaling: Literal["none", "ode", "identity"] = "none"
    """``ode``: treat each layer as an Euler step, so coalescing doubles and de-coalescing halves the
    residual-branch outputs (attention and FFN output projections). ``identity``: coalesce as
    ``ode`` (a coarse layer's residual branch is the sum of its pair's); de-coalescing copies the
    coarse layer into the first layer of its pair and makes the second the identity (its residual
    outputs zero, the rest copied): the de-coalesced model computes exactly the coarse model's
    function (function-preserving growth, as Net2Net's deeper networks)."""
    alpha: float = 0.5
    """Interpolation weight of the de-coalesced model: ``(1 - alpha) * before + alpha * decoalesced``
    (with ``interpolation = "correction"``: the step size of the coarse correction)."""
    interpolation: Literal["blend", "correction"] = "blend"
    """How a return to a finer level meets the model kept from before coalescing: ``blend`` (the
    paper) takes ``(1 - alpha) * before + alpha * decoalesce(coarse)``; ``correction`` (the coarse-grid
    correction of multigrid's full approximation scheme) adds the coarse model's change over its
    visit, de-coalesced, to the model before: ``before + alpha * (decoalesce(coarse) -
    decoalesce(coalesce(before)))``, so the fine model keeps what coalescing averages away (the
    differences between the layers of a pair, between paired units) and a coarse visit that
    changes nothing returns it exactly. Optimizer moments mapped back are blended either way.
    Growing a level (nothing before it) is the same in both."""
    cycle: Literal["v", "w", "f", "grow"] = "v"
    """The walk over the levels (0 = fine). ``v``: the V-cycle, coalesce down from the fine model,
    then back up (levels 0 1 0; 3 levels: 0 1 2 1 0). ``w``: the W-cycle (gamma 2): every level
    but the coarsest trains three times, with a W-cycle of the coarser levels between each
    (0 1 0 1 0; 3 levels: 0 1 2 1 2 1 0 1 2 1 2 1 0). ``f``: the F-cycle (full multigrid): the
    coarsest level from a fresh initialisation, then each finer level in turn is grown into and a
    V-cycle runs from it (1 0 1 0; 3 levels: 2 1 2 1 0 1 2 1 0). The first arrival at a level has
    no model before coalescing to interpolate with, so it de-coalesces with alpha 1 (plus
    ``perturbation_std`` noise) whatever ``alpha`` says, and AdamW starts afresh (with
    ``optimizer_state = "map"``: from the coarse moments, de-coalesced); every later return
    interpolates. ``grow``: only the way up, from a freshly initialised coarsest model
    (growth methods such as progressive stacking: depth only, ``depth_pairing = "halves"``,
    alpha 1)."""
    levels: list[LevelConfig] = field(default_factory=list)
    """Schedule per level, finest first; exactly ``num_levels`` entries when enabled."""
    optimizer_state: Literal["reset", "map"] = "reset"
    """At a transition, start the optimizer afresh (the paper) or map its state through the
    operators (coalesced on the way down; de-coalesced and interpolated like the weights on the way
    up, or only de-coalesced when a level is grown): AdamW's or Adam's moments, SGD's momentum (the
    same optimizer at every level)."""
    perturbation_std: float = 0.0
    """Standard deviation of Gaussian noise added to every weight after de-coalescing and
    interpolation, relative to that weight's own standard deviation (breaks the symmetry of
    copied units; interpolation and dropout also do)."""
    growth_mask_steps: int = 0
    """Masked structural growth (MSG, Yao et al., ICLR 2024): after a level is grown (the first
    arrival at it in an F- or grow cycle), the layers growth added (the second of every depth
    group) mix their output with their input, ``h + m (layer(h) - h)``, ``m`` ramping linearly from
    0 to 1 over this many steps: the grown model computes exactly the smaller one at growth, and
    the new layers enter gradually. 0: no mask. Depth growth only, and within the grown level's
    visit (the mask is not in the weights: a checkpoint written during the ramp computes the
    masked function in the trainer only)."""
    growth_operator: Literal["copy", "ligo", "random"] = "copy"
    """How a level is grown in depth (the first arrival at it in an F- or grow cycle): ``copy``, the
    de-coalescing (each coarse layer copied into its depth group, as ``depth_scaling`` says);
    ``random``, the first layer of every depth group a copy and the layer growth adds (the second)
    freshly initialised as Megatron-Core initialises a layer, its residual outputs zero under
    ``depth_scaling = "identity"`` (then the grown model computes the smaller one), as Bu's
    zero/one-layer expansion (ICML 2026) starts new layers; depth only, ``depth_scaling`` ``none``
    or ``identity``, and with ``optimizer_state = "map"`` it needs ``grown_moments = "zero"``;
    ``ligo``, LiGO's learned depth operator (Wang et al., ICLR 2023): every grown layer a linear
    combination of the coarse layers, one coefficient per (grown layer, coarse layer, parameter of
    the layer), started at the copy and trained for ``ligo_steps`` steps on the training batches
    with the weights fixed, then the grown model trains as usual. Its steps count in FLOPs.
    Width, where it grows too, is de-coalesced, not learned."""
    grown_moments: Literal["map", "zero"] = "map"
    """With ``optimizer_state = "map"``, the optimizer state of the layers depth growth adds (the
    second of every depth group): the state of the layer they copy, de-coalesced (``map``), or zero
    (``zero``: fresh moments, as MSG and Bu's expansion start new layers, and the asymmetric reset
    that SPARKLING uses to break the symmetry of copies; the step count is the run's, so Adam's
    bias correction stays that of the carried layers). The layers growth keeps carry theirs either
    way."""
    ligo_steps: int = 100
    """Steps that LiGO's depth operator is trained for (the paper's 100)."""
    ligo_lr: float = 1e-3
    """Adam's learning rate for LiGO's depth operator."""
    width_growth: Literal["fpi", "aki"] = "fpi"
    """How a level grown in width (the first arrival at it in an F- or grow cycle) is initialised:
    ``fpi``, bert2BERT's function-preserving initialisation, which is width de-coalescing (every new
    unit a copy of its partner, the weights that read the pair split between them); ``aki``,
    bert2BERT's advanced knowledge initialisation: in every layer, the new units' own weights (the
    rows that write them) are the next layer's de-coalesced ones (the top layer's its own), the rest
    as ``fpi`` (``operators.decoalesce_tensor_aki``); not function-preserving. Returns that
    interpolate always de-coalesce by ``fpi``. ``aki`` needs ``coalesce_width`` and a cycle that grows
    a level."""
    keep_fine: Literal["memory", "cpu", "disk"] = "memory"
    """Where the fine model is kept for interpolation while coarser levels train: sharded on the
    device, in host memory, or on disk under the run directory."""
    lr_schedule: Literal["restart", "continue"] = "restart"
    """``restart``: every phase runs its own schedule, warm-up and decay over its own steps (the
    paper's choice). ``continue``: the run follows one schedule over all its steps, as training
    from scratch does: the first phase's warm-up, then one decay to the end of the last phase; each
    phase keeps its own peak (a coarse level's learning-rate factor), and the warm-up of a later
    phase becomes a re-warm-up, a linear ramp to where the run's schedule stands. Every phase must
    then name the same ``decay`` and ``min_ratio``. Both strategies."""
    growth_in_decay: bool = False
    """With one schedule over the run (``lr_schedule: "continue"``) that decays over its last
    ``decay_fraction`` (WSD), a growth that comes after the decay has started is refused unless
    this is true: the grown model would train only at a decaying rate (Bu's expansion comes before
    the decay)."""

    def __post_init__(self):
        if self.strategy == "ode":
            self._check_ode_keys()
            return
        if self.ode is not None:
            raise ValueError(
                "multilevel.ode is the ODE strategy's block; set multilevel.strategy = \"ode\" to use it, "
                f"or remove it (multilevel.strategy is {self.strategy!r}; valid choices are {list(STRATEGIES)})"
            )
        if self.num_levels < 2:
            raise ValueError(f"multilevel.num_levels must be >= 2, got {self.num_levels}")
        if not (self.coalesce_width or self.coalesce_depth):
            raise ValueError("multilevel: coalesce_width and coalesce_depth cannot both be false")
        check_alpha(self.alpha, "multilevel.alpha")
        if self.perturbation_std < 0:
            raise ValueError(f"multilevel.perturbation_std must be >= 0, got {self.perturbation_std}")
        if self.enabled:
            if len(self.levels) != self.num_levels:
                raise ValueError(
                    f"multilevel.levels has {len(self.levels)} entries; multilevel.num_levels = "
                    f"{self.num_levels} needs one per level, finest first"
                )
            if self.levels[-1].steps_after:
                raise ValueError("multilevel.levels[-1].steps_after must be 0: the coarsest level trains steps_before")
            self._check_visits()
            self._check_growth_before_decay()
            self._check_growth_mask()
            self._check_growth_operator()
            self._check_grown_moments()
            if self.cycle == "grow":
                for i, level in enumerate(self.levels[:-1]):
                    if level.steps_before:
                        raise ValueError(f"multilevel.levels[{i}].steps_before must be 0 with cycle 'grow'")
                    if self.alpha_of(i) != 1.0:
                        raise ValueError(
                            f"multilevel: cycle 'grow' has no model before coalescing to interpolate with; "
                            f"level {i} needs alpha 1.0, not {self.alpha_of(i)}"
                        )
        self._check_width_growth()

    def _check_width_growth(self) -> None:
        if self.width_growth not in WIDTH_GROWTHS:
            raise ValueError(f"multilevel.width_growth: invalid value {self.width_growth!r}; valid choices are "
                             f"{list(WIDTH_GROWTHS)}")
        if self.width_growth == "fpi":
            return
        if not self.coalesce_width:
            raise ValueError("multilevel.width_growth 'aki' initialises the units a level grown in width adds; it "
                             "needs coalesce_width true (valid choices are ['fpi', 'aki'], 'fpi' without width)")
        if self.enabled and not self.grown_levels():
            raise ValueError(f"multilevel.width_growth 'aki': cycle {self.cycle!r} grows no level (only the first "
                             f"arrival at a level of cycle 'f' or 'grow' does; a return interpolates and de-coalesces "
                             f"by 'fpi'); valid choices are {list(WIDTH_GROWTHS)}, set it to 'fpi'")

    def _check_growth_mask(self) -> None:
        n = self.growth_mask_steps
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"multilevel.growth_mask_steps must be a non-negative integer, got {n!r}")
        if not n:
            return
        if self.coalesce_width or not self.coalesce_depth:
            raise ValueError("multilevel.growth_mask_steps masks the layers that depth growth adds; it needs "
                             "coalesce_depth true and coalesce_width false")
        if self.depth_scaling == "ode":
            raise ValueError("multilevel.growth_mask_steps: depth_scaling 'ode' halves the kept layers' residual "
                             "branches, so the masked model would not compute the smaller one; valid choices are "
                             "['none', 'identity']")
        grown = self.grown_specs()
        if not grown:
            raise ValueError(f"multilevel.growth_mask_steps: cycle {self.cycle!r} grows no level (only the first "
                             f"arrival at a level of cycle 'f' or 'grow' does); set it to 0")
        for spec in grown:
            if spec.steps < n:
                raise ValueError(
                    f"multilevel.growth_mask_steps ({n}) is longer than the {spec.steps} steps of level "
                    f"{spec.level}'s visit after growth: the mask must reach 1 before the model leaves the level"
                )

    def grown_specs(self) -> list[PhaseSpec]:
        """The phases that start at a level a transition grows (the first arrival at it in an F- or
        grow cycle)."""
        return [spec for spec, how in zip(self.phase_specs(), arrivals(self.walk())) if how == "grow"]

    def _check_growth_before_decay(self) -> None:
        """A growth inside the run's decay (WSD under one schedule) is refused unless asked for."""
        if self.lr_schedule != "continue" or self.growth_in_decay:
            return
        specs, start = self.phase_specs(), 0
        trained = [spec for spec in specs if spec.steps]
        if not trained or trained[0].lr.decay_fraction >= 1.0 or trained[0].lr.decay == "constant":
            return
        lr, total = trained[0].lr, sum(spec.steps for spec in specs)
        decay_start = lr.decay_start(total)
        for spec, how in zip(specs, arrivals(self.walk())):
            if how == "grow" and start > decay_start:
                raise ValueError(
                    f"multilevel: level {spec.level} is grown at step {start} of {total}, after the decay of the "
                    f"run's schedule has started (step {decay_start}: lr.decay_fraction {lr.decay_fraction}); grow "
                    f"before it (shorten the smaller levels' steps or the decay), or set "
                    f"multilevel.growth_in_decay = true")
            start += spec.steps

    def grown_levels(self) -> list[int]:
        """The levels that a transition grows."""
        return [spec.level for spec in self.grown_specs()]

    def _check_growth_operator(self) -> None:
        if self.growth_operator not in GROWTH_OPERATORS:
            raise ValueError(f"multilevel.growth_operator: invalid value {self.growth_operator!r}; "
                             f"valid choices are {list(GROWTH_OPERATORS)}")
        if self.growth_operator == "copy":
            return
        if self.growth_operator == "random":
            self._check_random_growth()
            return
        n = self.ligo_steps
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"multilevel.ligo_steps must be a positive integer, got {n!r}")
        if not self.ligo_lr > 0:
            raise ValueError(f"multilevel.ligo_lr must be positive, got {self.ligo_lr!r}")
        if not self.coalesce_depth:
            raise ValueError("multilevel.growth_operator 'ligo' learns a depth operator; it needs coalesce_depth true")
        if self.growth_mask_steps:
            raise ValueError("multilevel.growth_operator 'ligo' and growth_mask_steps (MSG) both decide what the "
                             "grown layers start from; use one of them")
        if not self.grown_levels():
            raise ValueError(f"multilevel.growth_operator 'ligo': cycle {self.cycle!r} grows no level (only the "
                             f"first arrival at a level of cycle 'f' or 'grow' does); valid choices for it: 'copy'")

    def _check_random_growth(self) -> None:
        if self.coalesce_width or not self.coalesce_depth:
            raise ValueError("multilevel.growth_operator 'random' initialises the layers depth growth adds; it needs "
                             "coalesce_depth true and coalesce_width false")
        if self.depth_scaling == "ode":
            raise ValueError("multilevel.growth_operator 'random': depth_scaling 'ode' halves the copied layers' "
                             "residual branches; valid choices are ['none', 'identity']")
        if not self.grown_levels():
            raise ValueError(f"multilevel.growth_operator 'random': cycle {self.cycle!r} grows no level (only the "
                             f"first arrival at a level of cycle 'f' or 'grow' does); valid choices for it: 'copy'")
        if self.optimizer_state == "map" and self.grown_moments != "zero":
            raise ValueError("multilevel.growth_operator 'random' starts the layers growth adds afresh, and their "
                             "optimizer state too: set multilevel.grown_moments to 'zero' (valid choices are "
                             f"{list(GROWN_MOMENTS)})")

    def _check_grown_moments(self) -> None:
        check_choice("multilevel.grown_moments", self.grown_moments, GROWN_MOMENTS)
        if self.grown_moments == "map":
            return
        if self.optimizer_state != "map":
            raise ValueError("multilevel.grown_moments 'zero' sets the moments that optimizer_state 'map' carries "
                             f"into the layers growth adds; with optimizer_state {self.optimizer_state!r} every "
                             "moment starts afresh: set optimizer_state to 'map' or grown_moments to 'map'")
        if self.coalesce_width or not self.coalesce_depth or not self.grown_levels():
            raise ValueError("multilevel.grown_moments 'zero' needs a cycle that grows a level in depth only "
                             "(cycle 'f' or 'grow', coalesce_depth true, coalesce_width false)")

    def _check_ode_keys(self) -> None:
        defaults = MultilevelConfig()
        given = [k for k in COALESCE_ONLY_KEYS if getattr(self, k) != getattr(defaults, k)]
        if given:
            raise ValueError(
                f"multilevel: {', '.join(given)} belong(s) to the coalesce strategy and mean nothing with "
                f"strategy 'ode'; remove them and set the ODE cycle in multilevel.ode (valid keys "
                f"{sorted(f.name for f in dataclasses.fields(OdeConfig))})"
            )
        if self.ode is None:
            self.ode = OdeConfig()

    def _check_visits(self) -> None:
        visits = self.walk()
        for i, level in enumerate(self.levels):
            if level.visits is not None and len(level.visits) != visits.count(i):
                raise ValueError(
                    f"multilevel.levels[{i}].visits has {len(level.visits)} entries; cycle {self.cycle!r} over "
                    f"{self.num_levels} levels visits level {i} {visits.count(i)} time(s), one entry per visit"
                )
        coarsest = self.levels[-1]
        if coarsest.visits is None and coarsest.steps_before <= 0:
            raise ValueError("multilevel.levels[-1].steps_before must be positive")
        for j, visit in enumerate(coarsest.visits or []):
            if visit.steps <= 0:
                raise ValueError(f"multilevel.levels[-1].visits[{j}].steps must be positive: every visit of the "
                                 f"coarsest level trains")

    def walk(self) -> list[int]:
        """The level of every visit of the cycle, in order."""
        return visit_order(self.cycle, self.num_levels)

    def phase_specs(self) -> list[PhaseSpec]:
        """Level, steps, schedule and name of every phase. The ODE strategy: its block's. A cycle:
        one phase per visit of ``walk``; a visit that ends by coalescing (``before``) and every visit
        of the coarsest level (``coarsest``) train the level's ``steps_before``, every other
        (``after``) its ``steps_after``; ``levels[i].visits`` replaces the rule."""
        if self.strategy == "ode":
            return self.ode.phase_specs()
        walk, coarsest, specs = self.walk(), self.num_levels - 1, []
        for i, level in enumerate(walk):
            following = walk[i + 1] if i + 1 < len(walk) else None
            name = "coarsest" if level == coarsest else "before" if following == level + 1 else "after"
            specs.append(PhaseSpec(level, *self.levels[level].visit_schedule(name, walk[:i].count(level)), name))
        return specs

    def alpha_of(self, level: int) -> float:
        """Interpolation weight when ``level`` is rebuilt from ``level + 1``."""
        alpha = self.levels[level].alpha
        return self.alpha if alpha is None else alpha
