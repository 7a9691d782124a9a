"""Run configuration: one JSON file that is a valid DeepSpeed config plus our own blocks.

DeepSpeed reads the file as it is and ignores the top-level keys it does not know
(``model``, ``multilevel``, ...). We read our blocks into strict dataclasses and check every
other top-level key against DeepSpeed's own keys, because DeepSpeed would silently ignore a
typo such as ``"zero_optimisation"``.
"""

import copy
import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_multilevel.config_parsing import parse_dataclass, to_dict
from megatron_multilevel.optimizers import check_optimizers

# Top-level keys of a DeepSpeed 0.19 config (runtime/config.py and the feature configs it reads).
DEEPSPEED_KEYS = frozenset(
    {
        "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "checkpoint",
        "comet", "comms_logger", "communication_data_type", "compile", "compression_training",
        "csv_monitor", "curriculum_learning", "data_efficiency", "data_types",
        "dataloader_drop_last", "disable_allgather", "dump_state", "eigenvalue", "elasticity",
        "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_clipping",
        "gradient_predivide_factor", "hybrid_engine", "memory_breakdown", "monitor_config",
        "nebula", "optimizer", "pipeline", "prescale_gradients", "progressive_layer_drop",
        "quantize_training", "scheduler", "seq_parallel_communication_data_type",
        "sparse_attention", "sparse_gradients", "steps_per_print", "tensorboard",
        "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
        "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "zero_optimization", "gradient_allreduce_op",
        "use_data_before_expert_parallelism", "disable_python_gc", "log_level",
    }
)


@dataclass
class ModelConfig:
    """Shape and architecture of a Megatron-Core GPT or BERT model (the finest level)."""

    kind: Literal["gpt", "bert"] = "gpt"
    """Causal LM (``GPTModel``) or masked LM (``BertModel``)."""
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; null means multi-head attention."""
    kv_channels: Optional[int] = None
    """Head size; null means ``hidden_size // num_attention_heads``. Kept across levels."""
    ffn_hidden_size: Optional[int] = None
    """FFN width; null means ``4 * hidden_size``."""
    vocab_size: int = 4096
    """Vocabulary size (never coalesced)."""
    max_sequence_length: int = 128
    """Longest sequence; the size of learned position embeddings."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned absolute position embeddings or rotary embeddings."""
    rotary_base: int = 10000
    """RoPE base; used only with ``rope``."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embeddings."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Norm of every layer, the final norm and BERT's LM head."""
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """FFN activation: exact GELU, GELU's tanh approximation (GPT-2's), or SwiGLU (which stacks
    gate and up projections in ``linear_fc1``)."""
    add_bias_linear: bool = True
    """Biases on the linear layers of the transformer layers."""
    hidden_dropout: float = 0.0
    """Dropout after attention and FFN outputs and on embeddings."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation."""
    num_tokentypes: int = 0
    """BERT token-type (segment) embeddings; 0 disables them."""
    add_binary_head: bool = False
    """BERT pooler and next-sentence head."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer spec: Transformer Engine where installed and on GPU (``auto``), or Megatron's local one."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_sequence_length"):
            _check_positive(f"model.{name}", getattr(self, name))
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"model.hidden_size ({self.hidden_size}) is not divisible by "
                    f"model.num_attention_heads ({self.num_attention_heads}); set model.kv_channels"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_query_groups", "kv_channels", "ffn_hidden_size"):
            _check_positive(f"model.{name}", getattr(self, name))
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.kind == "gpt" and (self.num_tokentypes or self.add_binary_head):
            raise ValueError("model.num_tokentypes and model.add_binary_head are BERT-only")
        if self.add_binary_head and self.num_tokentypes < 2:
            raise ValueError("model.add_binary_head needs model.num_tokentypes >= 2")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"


def coarse_model_config(cfg: ModelConfig, *, width: bool, depth: bool) -> ModelConfig:
    """The next coarser level: half width (hidden, heads, query groups, FFN) and/or half depth.

    The head size ``kv_channels`` and the vocabulary are kept.
    """
    changes: dict[str, Any] = {}
    if width:
        for name in ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            value = getattr(cfg, name)
            if value % 2 or value < 2:
                raise ValueError(
                    f"model.{name} = {value} cannot be halved for width coalescing; "
                    f"use an even value or set multilevel.coalesce_width = false"
                )
            changes[name] = value // 2
    if depth:
        if cfg.num_layers % 2 or cfg.num_layers < 2:
            raise ValueError(
                f"model.num_layers = {cfg.num_layers} cannot be halved for depth coalescing; "
                f"use an even value or set multilevel.coalesce_depth = false"
            )
        changes["num_layers"] = cfg.num_layers // 2
    if not changes:
        raise ValueError("multilevel: coalesce_width and coalesce_depth cannot both be false")
    return dataclasses.replace(cfg, **changes)


@dataclass
class LRConfig:
    """A learning-rate schedule for one phase of training (AdamW restarts at every phase)."""

    peak: float = 1e-3
    """Peak learning rate, reached after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to ``peak``."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay from ``peak`` to ``peak * min_ratio`` over the rest of the phase."""
    min_ratio: float = 0.1
    """Final learning rate as a fraction of ``peak``."""

    def __post_init__(self):
        if self.peak <= 0:
            raise ValueError(f"lr.peak must be positive, got {self.peak}")
        if self.warmup_steps < 0:
            raise ValueError(f"lr.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"lr.min_ratio must be in [0, 1], got {self.min_ratio}")


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
    deepspeed: dict = field(default_factory=dict)
    """DeepSpeed keys overridden at this level (deep-merged), e.g. ``{"zero_optimization": {"stage": 3}}``."""

    def __post_init__(self):
        if self.steps_before < 0 or self.steps_after < 0:
            raise ValueError("multilevel.levels[*].steps_before and steps_after must be >= 0")
        if self.alpha is not None:
            check_alpha(self.alpha, "multilevel.levels[*].alpha")
        unknown = sorted(set(self.deepspeed) - DEEPSPEED_KEYS)
        if unknown:
            raise ValueError(
                f"multilevel.levels[*].deepspeed: unknown DeepSpeed key(s) {unknown}; "
                f"valid keys are {sorted(DEEPSPEED_KEYS)}"
            )


@dataclass
class OdeConfig:
    """The multilevel ODE strategy (Lauga et al. 2025): a coarse model of every other layer, taking
    Euler steps twice as long, trained between fine phases; its change is written back."""

    coarse: Literal["alternate", "even", "odd"] = "alternate"
    """Which fine layers each coarse model keeps: ``even`` (0, 2, 4, ...), ``odd`` (1, 3, 5, ...), or
    ``alternate``: even in the first cycle, odd in the second, and so on."""
    residual_scale: int = 2
    """The coarse step size, 1 or 2: the residual-branch outputs of a coarse layer (attention output
    projection and second FFN linear, weight and bias) are multiplied by it on restriction and their
    change is divided by it when written back."""
    prolongation: Literal["correction", "constant", "linear"] = "correction"
    """How the coarse change ``end - start`` is written back: ``correction`` adds each coarse layer's
    change to its own fine layer (and the shared parameters' to theirs), the other layers untouched;
    ``constant`` also adds it to the skipped layer of the same pair (``2i`` and ``2i + 1``);
    ``linear`` gives each skipped layer the mean of its two neighbours' changes (the one at an end)."""
    coherence: Literal["none", "first_order"] = "none"
    """``first_order``: the MG/OPT tau correction. At restriction, on the first coarse batch,
    ``v = R grad L_fine(theta) - grad L_coarse(R theta)`` is computed and added to every coarse
    gradient of that coarse phase, so that the coarse gradient at the restricted point is the
    restricted fine gradient (``R`` acts on gradients as on parameters). Its passes count in FLOPs."""
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
    coarse_tensor_model_parallel_size: Optional[int] = None
    """Tensor-parallel size of the coarse models (data parallelism takes the other ranks); null means
    ``parallel.tensor_model_parallel_size``."""
    coarse_deepspeed: dict = field(default_factory=dict)
    """DeepSpeed keys overridden for the coarse models (deep-merged), e.g. ``{"zero_optimization": {"stage": 3}}``."""

    def __post_init__(self):
        if self.coarse_tensor_model_parallel_size is not None:
            _check_positive("multilevel.ode.coarse_tensor_model_parallel_size", self.coarse_tensor_model_parallel_size)
        unknown = sorted(set(self.coarse_deepspeed) - DEEPSPEED_KEYS)
        if unknown:
            raise ValueError(
                f"multilevel.ode.coarse_deepspeed: unknown DeepSpeed key(s) {unknown}; "
                f"valid keys are {sorted(DEEPSPEED_KEYS)}"
            )
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
        for name in ("coarse_steps", "cycles"):
            _check_positive(f"multilevel.ode.{name}", getattr(self, name))

    def parity(self, cycle: int) -> int:
        """The layers the coarse model of ``cycle`` keeps: 0 even, 1 odd."""
        if self.coarse == "alternate":
            return cycle % 2
        return 0 if self.coarse == "even" else 1


RESIDUAL_SCALES = (1, 2)
STRATEGIES = ("coalesce", "ode")
# MultilevelConfig keys that only the coalesce strategy reads (keep_fine and enabled serve both).
COALESCE_ONLY_KEYS = ("num_levels", "coalesce_width", "coalesce_depth", "width_pairing", "depth_pairing",
                      "depth_scaling", "alpha", "interpolation", "cycle", "levels", "optimizer_state",
                      "perturbation_std")


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
            if self.cycle == "grow":
                for i, level in enumerate(self.levels[:-1]):
                    if level.steps_before:
                        raise ValueError(f"multilevel.levels[{i}].steps_before must be 0 with cycle 'grow'")
                    if self.alpha_of(i) != 1.0:
                        raise ValueError(
                            f"multilevel: cycle 'grow' has no model before coalescing to interpolate with; "
                            f"level {i} needs alpha 1.0, not {self.alpha_of(i)}"
                        )

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
        coarsest = self.num_levels - 1

        def v(level: int) -> list[int]:
            return [level] if level == coarsest else [level, *v(level + 1), level]

        def w(level: int) -> list[int]:
            return [level] if level == coarsest else [level, *w(level + 1), level, *w(level + 1), level]

        if self.cycle == "v":
            return v(0)
        if self.cycle == "w":
            return w(0)
        if self.cycle == "f":
            return [coarsest] + [visit for level in reversed(range(coarsest)) for visit in v(level)]
        return list(reversed(range(self.num_levels)))

    def alpha_of(self, level: int) -> float:
        """Interpolation weight when ``level`` is rebuilt from ``level + 1``."""
        alpha = self.levels[level].alpha
        return self.alpha if alpha is None else alpha


@dataclass
class DataConfig:
    """Training data: a Megatron indexed dataset, a weighted blend of them, or the embedded default corpus."""

    prefix: Optional[str] = None
    """Path prefix of a Megatron indexed dataset (``.bin``/``.idx``) made by
    ``tools/preprocess_data.py``; null (and no ``blend``) means the embedded corpus (the Python
    standard library's own source files, prepared once and cached)."""
    blend: Optional[list[Any]] = None
    """A weighted mixture of indexed datasets, written as Megatron's ``--data-path``: weight,
    prefix, weight, prefix, ... (``[0.3, "data/a", 0.7, "data/b"]``; weights are normalised).
    Each dataset is split by ``split`` on its own and sampled in proportion to its weight, through
    Megatron-Core's blended dataset builder. All tokenized with ``tokenizer_model``; not with ``prefix``."""
    tokenizer_model: Optional[str] = None
    """The tokenizer of ``prefix`` or ``blend`` (required with either): a SentencePiece model file,
    or a Hugging Face tokenizer directory (``tokenizer.json``, e.g. the one of a model imported with
    ``convert_checkpoint.py from-hf``)."""
    cache_dir: str = ".cache/megatron_multilevel"
    """Where the embedded corpus and Megatron's dataset indices are cached."""
    seq_length: int = 128
    """Tokens per training sequence."""
    split: str = "98,2,0"
    """Train, validation and test shares of the documents, by position in the dataset as in
    Megatron (the embedded corpus is stored in a random document order, so its held-out
    documents are a random sample)."""
    valid_seed: int = 0
    """Seed of the order (and, for BERT, the masking) of the validation samples. Independent of
    ``training.seed``, so that runs with different seeds, and every method of a comparison, are
    scored on the same validation samples."""
    masking_probability: float = 0.15
    """BERT: share of tokens masked."""
    short_sequence_probability: float = 0.1
    """BERT: probability of a shorter sequence."""
    num_workers: int = 0
    """Data-loader worker processes."""

    def __post_init__(self):
        _check_positive("data.seq_length", self.seq_length)
        if self.prefix is not None and self.blend is not None:
            raise ValueError("data.prefix and data.blend are exclusive: prefix is one dataset, blend a mixture")
        if self.blend is not None:
            self._check_blend()
            if self.tokenizer_model is None:
                raise ValueError("data.blend needs data.tokenizer_model, the tokenizer of every blended dataset")
        elif (self.prefix is None) != (self.tokenizer_model is None):
            raise ValueError("data.prefix and data.tokenizer_model go together (both set, or both null)")
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts):
            raise ValueError(f"data.split must be three comma-separated numbers, got {self.split!r}")
        if float(parts[1]) <= 0:
            raise ValueError("data.split needs a validation share (the second number) above 0")

    def _check_blend(self) -> None:
        form = "weight, prefix, weight, prefix, ... as Megatron's --data-path, e.g. [0.3, \"data/a\", 0.7, \"data/b\"]"
        items = self.blend
        if len(items) < 2 or len(items) % 2:
            raise ValueError(f"data.blend = {items!r}: expected {form}")
        for i in range(0, len(items), 2):
            weight, prefix = items[i], items[i + 1]
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise ValueError(f"data.blend[{i}] = {weight!r}: a weight must be a number above 0; expected {form}")
            if not isinstance(prefix, str) or not prefix:
                raise ValueError(f"data.blend[{i + 1}] = {prefix!r}: a dataset prefix must be a path; expected {form}")
        prefixes = items[1::2]
        repeated = sorted({p for p in prefixes if prefixes.count(p) > 1})
        if repeated:
            raise ValueError(f"data.blend lists {repeated} more than once; give each dataset one weight")

    def blend_pairs(self) -> Optional[list[tuple[float, str]]]:
        """``[(weight, prefix), ...]`` of ``blend`` (weights as given), or None."""
        if self.blend is None:
            return None
        return [(float(w), p) for w, p in zip(self.blend[0::2], self.blend[1::2])]


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

    def __post_init__(self):
        for name in ("train_steps", "log_interval", "eval_interval", "eval_batches"):
            _check_positive(f"training.{name}", getattr(self, name))
        if self.save_interval < 0 or self.keep_checkpoints < 1:
            raise ValueError("training.save_interval must be >= 0 and training.keep_checkpoints >= 1")


def check_alpha(alpha: float, name: str = "alpha") -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {alpha}")


@dataclass
class ParallelConfig:
    """Model-parallel layout (data parallelism fills the remaining ranks)."""

    tensor_model_parallel_size: int = 1
    """Megatron tensor-parallel size."""
    sequence_parallel: Optional[bool] = None
    """Megatron's sequence parallelism at every level whose TP size is above 1 (the activations
    outside the tensor-parallel regions split along the sequence: their memory falls by the TP
    size): null turns it on where CUDA is available, true wherever TP > 1, false nowhere."""

    def __post_init__(self):
        _check_positive("parallel.tensor_model_parallel_size", self.tensor_model_parallel_size)


@dataclass
class RunConfig:
    """A whole run: our blocks plus the DeepSpeed config they sit in."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The fine model."""
    multilevel: MultilevelConfig = field(default_factory=MultilevelConfig)
    """The multilevel method and its cycle."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor parallelism."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The training loop."""
    deepspeed: dict = field(default_factory=dict)
    """Every DeepSpeed key of the file, passed to ``deepspeed.initialize`` (per level overrides merged)."""

    def __post_init__(self):
        if self.data.seq_length > self.model.max_sequence_length:
            raise ValueError(
                f"data.seq_length = {self.data.seq_length} exceeds model.max_sequence_length = "
                f"{self.model.max_sequence_length}"
            )
        if self.multilevel.enabled and self.multilevel.strategy == "ode":
            self._check_ode()
        if "scheduler" in self.deepspeed:
            raise ValueError(
                "config: DeepSpeed's 'scheduler' is not used; the learning rate of every phase is "
                "set by training.lr and multilevel.levels[*].lr_before / lr_after"
            )
        for level, (cfg, tp) in enumerate(zip(self.level_models(), self.level_tp_sizes())):
            self._check_level_parallel(level, cfg, tp)
        self._check_sequence_parallel()
        self._check_width_symmetry()

    def _check_width_symmetry(self) -> None:
        """Warn when a level is grown in width with nothing to break the symmetry of the copies.

        De-coalescing in width copies each coarse unit into a pair with the same incoming and
        halved outgoing weights, so the two receive the same gradient and AdamW update. A level
        first reached by growing (an F-cycle's finer levels, every level of ``grow``) has no model
        from before coalescing to interpolate with; without dropout or ``perturbation_std`` noise
        its copies stay equal for the rest of the run, and it trains at the coarse width while
        paying for the fine one. Legal (a benchmark may want exactly that), hence a warning."""
        ml = self.multilevel
        if not (ml.enabled and ml.strategy == "coalesce" and ml.coalesce_width) or ml.perturbation_std > 0:
            return
        from megatron_multilevel.training.schedule import _cycle_phases  # it imports this module

        grown = sorted({phase.level for phase in _cycle_phases(ml) if phase.arrival == "grow"})
        if not grown or self.model.hidden_dropout > 0 or self.model.attention_dropout > 0:
            return
        warnings.warn(
            f"multilevel: cycle {ml.cycle!r} grows level(s) {grown} in width (multilevel.coalesce_width = true) "
            f"from a coarser level, and nothing breaks the symmetry of the copied units "
            f"(multilevel.perturbation_std = 0, model.hidden_dropout = model.attention_dropout = 0): "
            f"they stay equal and those levels train at half their width. Set multilevel.perturbation_std "
            f"(e.g. 0.01) or a dropout, or coalesce depth only (multilevel.coalesce_width = false)",
            UserWarning,
            stacklevel=2,
        )

    def _check_ode(self) -> None:
        ode = self.multilevel.ode
        layers = self.model.num_layers
        if layers % 2 or layers < 2:
            raise ValueError(
                f"model.num_layers = {layers}: the ODE strategy's coarse models keep every other layer "
                f"and need an even number of layers"
            )
        if ode.coarse_tensor_model_parallel_size is not None:
            coarse, key = self.level_models()[1], "multilevel.ode.coarse_tensor_model_parallel_size"
            try:
                check_model_parallel(coarse, ode.coarse_tensor_model_parallel_size, key=key)
            except ValueError as e:
                raise ValueError(f"{e} (the coarse models keep the fine width); valid values are "
                                 f"{valid_tp_sizes(coarse)}") from None
        coarse_where = "multilevel.ode.coarse_deepspeed (merged into the top-level DeepSpeed keys): "
        for level, where in ((0, ""), (1, coarse_where)):
            try:
                self._check_ode_deepspeed(self.level_deepspeed(level), coarse=level == 1)
            except ValueError as e:
                raise ValueError(f"{where}{e}") from None
        if ode.optimizer_state == "map":
            fine, coarse = (optimizer_state_keys(self.level_deepspeed(level)) for level in (0, 1))
            if fine != coarse:
                raise ValueError(
                    f"multilevel.ode.optimizer_state = 'map' carries the fine optimizer's state {list(fine)} into the "
                    f"coarse optimizer and back, and multilevel.ode.coarse_deepspeed gives the coarse models an "
                    f"optimizer with state {list(coarse)}; use the same optimizer at both levels, or "
                    f"optimizer_state 'keep' or 'reset'"
                )

    def _check_ode_deepspeed(self, ds: dict, *, coarse: bool) -> None:
        """The ODE strategy's checks of one level's DeepSpeed config (the file's keys, plus the coarse
        overrides for ``coarse``)."""
        state = self.multilevel.ode.optimizer_state
        optimizer = ds.get("optimizer", {"type": "AdamW"})
        kind = optimizer.get("type", "")
        if not carries_optimizer_state(kind):
            raise ValueError(
                f"optimizer.type = {kind!r}: the ODE strategy carries the state of "
                f"{list(OPTIMIZER_STATE_KEYS)}; valid choices are {list(STATE_OPTIMIZERS)}"
            )
        stage = ds.get("zero_optimization", {}).get("stage", 0)
        if stage not in ZERO_STAGES:
            raise ValueError(f"zero_optimization.stage = {stage!r}; valid choices are {list(ZERO_STAGES)}")
        if kind == "SGD" and stage and not ds.get("zero_allow_untested_optimizer"):
            raise ValueError(
                f"optimizer.type = 'SGD' with zero_optimization.stage = {stage}: DeepSpeed needs "
                f"\"zero_allow_untested_optimizer\": true for SGD under ZeRO"
            )
        low_precision = any(ds.get(k, {}).get("enabled") for k in ("bf16", "fp16"))
        # the coarse optimizer's state is read and written only when it is mapped
        carried = state == "map" or (state == "keep" and not coarse)
        if low_precision and not stage and carried:
            raise ValueError(
                f"multilevel.ode.optimizer_state = {state!r} with bf16/fp16 needs "
                f"zero_optimization.stage >= 1: without ZeRO, DeepSpeed's low-precision wrapper keeps the "
                f"optimizer state where the transitions cannot carry it"
            )
        if self.multilevel.ode.coherence == "first_order" and ds.get("fp16", {}).get("enabled"):
            raise ValueError("multilevel.ode.coherence = 'first_order' is not supported with fp16 (loss scaling); "
                             "use bf16 or fp32")

    def level_models(self) -> list[ModelConfig]:
        """The model config of every level, finest first (only the fine one without multilevel)."""
        models = [self.model]
        ml = self.multilevel
        if ml.enabled and ml.strategy == "ode":
            return [self.model, coarse_model_config(self.model, width=False, depth=True)]
        for _ in range(ml.num_levels - 1 if ml.enabled else 0):
            models.append(coarse_model_config(models[-1], width=ml.coalesce_width, depth=ml.coalesce_depth))
        return models

    def level_tp_sizes(self) -> list[int]:
        """The tensor-parallel size of every level."""
        default = self.parallel.tensor_model_parallel_size
        if not self.multilevel.enabled:
            return [default]
        if self.multilevel.strategy == "ode":
            return [default, self.multilevel.ode.coarse_tensor_model_parallel_size or default]
        return [lv.tensor_model_parallel_size or default for lv in self.multilevel.levels]

    def level_sequence_parallel(self) -> list[bool]:
        """Whether every level runs sequence-parallel (``parallel.sequence_parallel`` resolved at its TP size)."""
        from megatron_multilevel.parallel.sequence_parallel import resolve_sequence_parallel

        setting, kind = self.parallel.sequence_parallel, self.model.kind
        return [resolve_sequence_parallel(setting, tp, kind) for tp in self.level_tp_sizes()]

    def _check_sequence_parallel(self) -> None:
        from megatron_multilevel.parallel.sequence_parallel import check_sequence_parallel_supported

        for level, (tp, on) in enumerate(zip(self.level_tp_sizes(), self.level_sequence_parallel())):
            if not on:
                continue
            check_sequence_parallel_supported(self.model.kind)
            if self.data.seq_length % tp:
                raise ValueError(
                    f"level {level}: parallel.sequence_parallel splits each sequence over the "
                    f"{tp} tensor-parallel ranks, and data.seq_length = {self.data.seq_length} is not "
                    f"divisible by {tp}; set data.seq_length to a multiple of {tp}, or "
                    f"parallel.sequence_parallel to false (valid choices are [null, true, false])"
                )

    def level_deepspeed(self, level: int) -> dict:
        """The DeepSpeed keys of ``level``: the file's, with the level's overrides deep-merged."""
        ml = self.multilevel
        overrides = {}
        if ml.enabled and ml.strategy == "coalesce":
            overrides = ml.levels[level].deepspeed
        elif ml.enabled and level == 1:
            overrides = ml.ode.coarse_deepspeed
        return deep_merge(self.deepspeed, overrides)

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError``, naming the key, if a level's tensor-parallel size does not divide
        ``world_size``."""
        for level, (model, tp) in enumerate(zip(self.level_models(), self.level_tp_sizes())):
            if world_size % tp:
                valid = [d for d in valid_tp_sizes(model) if world_size % d == 0]
                raise ValueError(
                    f"level {level}: {self._tp_key(level)} = {tp} does not divide the world size {world_size}; "
                    f"valid values are {valid}"
                )

    def _tp_key(self, level: int) -> str:
        """The key that sets ``level``'s tensor-parallel size (as a ``dotted.key=value`` override
        writes it)."""
        ml = self.multilevel
        if ml.enabled and ml.strategy == "ode" and level == 1 and ml.ode.coarse_tensor_model_parallel_size:
            return "multilevel.ode.coarse_tensor_model_parallel_size"
        if ml.enabled and ml.strategy == "coalesce" and ml.levels[level].tensor_model_parallel_size:
            return f"multilevel.levels.{level}.tensor_model_parallel_size"
        return "parallel.tensor_model_parallel_size"

    def _own_tp_key(self, level: int) -> str:
        """The key that gives ``level`` a tensor-parallel size of its own."""
        ml = self.multilevel
        if level == 0 or not ml.enabled:
            return self._tp_key(0)
        if ml.strategy == "ode":
            return "multilevel.ode.coarse_tensor_model_parallel_size"
        return f"multilevel.levels.{level}.tensor_model_parallel_size"

    def _check_level_parallel(self, level: int, model: ModelConfig, tp: int) -> None:
        """Raise ``ValueError`` if ``level`` (model ``model``) cannot be split over ``tp`` ranks,
        naming the key to change and the sizes that would work.

        A coarse level has half the heads and FFN units of the level above it, so a size that
        splits the fine model may not split it; such a level then needs its own size, even where
        it inherits the size that is right for the fine model."""
        undivided = undivided_size(model, tp)
        if undivided is None:
            return
        key, own = self._tp_key(level), self._own_tp_key(level)
        name = undivided.split(" = ")[0]
        sizes = f"model.{undivided}" if level == 0 else (
            f"{undivided} at this level (model.{name} = {getattr(self.model, name)} at level 0)")
        setting = f"{key} = {tp}" if key == own else f"tensor_model_parallel_size = {tp} (from {key})"
        raise ValueError(
            f"level {level}: {setting} does not divide {sizes}; set {own} to one of {valid_tp_sizes(model)}"
        )


# The optimizer state the ODE strategy keeps or maps, by DeepSpeed optimizer type (lower case).
OPTIMIZER_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
                        "sgd": ("momentum_buffer",)}
# Their DeepSpeed spellings: the Adam types in any case, torch's SGD only as spelled.
STATE_OPTIMIZERS = ("Adam", "AdamW", "SGD")


def carries_optimizer_state(kind: str) -> bool:
    """Whether the transitions know the state of DeepSpeed's ``optimizer.type`` ``kind``."""
    return kind.lower() in ("adam", "adamw") or kind == "SGD"


OUR_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name != "deepspeed")


# The sizes tensor parallelism splits (each must be divisible by the TP size).
TP_SPLIT_SIZES = ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
ZERO_STAGES = (0, 1, 2, 3)


def undivided_size(model: ModelConfig, tp: int) -> Optional[str]:
    """The first size of ``model`` that ``tp`` tensor-parallel ranks cannot split, as
    ``"name = value"``; None if they can split them all."""
    for name in TP_SPLIT_SIZES:
        value = getattr(model, name)
        if value % tp:
            return f"{name} = {value}"
    return None


def check_model_parallel(model: ModelConfig, tp: int, *, key: str = "parallel.tensor_model_parallel_size") -> None:
    """Raise if ``model`` cannot be split over ``tp`` tensor-parallel ranks; ``key`` names the setting."""
    undivided = undivided_size(model, tp)
    if undivided is not None:
        raise ValueError(f"{key} = {tp} does not divide model.{undivided}")


def valid_tp_sizes(model: ModelConfig) -> list[int]:
    """Every tensor-parallel size ``model`` can be split over."""
    gcd = math.gcd(*(getattr(model, name) for name in TP_SPLIT_SIZES))
    return [d for d in range(1, gcd + 1) if gcd % d == 0]


def optimizer_state_keys(deepspeed: dict) -> tuple[str, ...]:
    """The optimizer state a transition can carry under a DeepSpeed config: Adam's moments, SGD's
    momentum (none without momentum)."""
    optimizer = deepspeed.get("optimizer", {"type": "AdamW"})
    kind = optimizer.get("type", "AdamW").lower()
    if kind == "sgd" and not optimizer.get("params", {}).get("momentum", 0.0):
        return ()
    return OPTIMIZER_STATE_KEYS[kind]


def deep_merge(base: dict, override: dict) -> dict:
    """A copy of ``base`` with ``override`` merged in, nested objects key by key."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_config(source: "str | os.PathLike | dict") -> RunConfig:
    """Parse a run config from a JSON file path or an already loaded dict."""
    if isinstance(source, dict):
        data = source
    else:
        with open(source) as f:
            data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError("config: the top level must be a JSON object")
    unknown = sorted(k for k in data if k not in OUR_KEYS and k not in DEEPSPEED_KEYS)
    if unknown:
        raise ValueError(
            f"config: unknown top-level key(s) {unknown}; valid keys are our blocks "
            f"{list(OUR_KEYS)} and DeepSpeed's {sorted(DEEPSPEED_KEYS)}"
        )
    ours = {k: v for k, v in data.items() if k in OUR_KEYS}
    ours["deepspeed"] = {k: v for k, v in data.items() if k in DEEPSPEED_KEYS}
    cfg = parse_dataclass(RunConfig, ours, "config")
    check_optimizers(cfg)
    return cfg


def config_to_dict(cfg: RunConfig) -> dict:
    """The run config as one JSON object again (DeepSpeed keys at the top level)."""
    data = to_dict(cfg)
    data.update(data.pop("deepspeed"))
    return data


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
