"""Run configuration: one JSON file that is a valid DeepSpeed config plus our own blocks.

DeepSpeed reads the file as it is and ignores the top-level keys it does not know
(``model``, ``multilevel``, ...). We read our blocks into strict dataclasses and check every
other top-level key against DeepSpeed's own keys, because DeepSpeed would silently ignore a
typo such as ``"zero_optimisation"``.
"""

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_multilevel.config_parsing import parse_dataclass, to_dict

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
    activation: Literal["gelu", "swiglu"] = "gelu"
    """FFN activation; ``swiglu`` stacks gate and up projections in ``linear_fc1``."""
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
class MultilevelConfig:
    """The operators and the shape of the V-cycle."""

    enabled: bool = False
    """Run the V-cycle; false trains the fine model from scratch (the baseline)."""
    num_levels: int = 2
    """Number of levels of the V-cycle, the fine model included (2 or more)."""
    coalesce_width: bool = True
    """Halve hidden size, heads, query groups and FFN width at each level."""
    coalesce_depth: bool = True
    """Halve the number of layers at each level."""
    width_pairing: Literal["halves", "adjacent"] = "halves"
    """Which units are grouped: ``j`` with ``j + n/2`` (the paper's ``[I/2, I/2]``), or ``2i`` with
    ``2i+1``. Made local to each tensor-parallel shard when TP > 1."""
    depth_pairing: Literal["adjacent", "halves"] = "adjacent"
    """Which layers are averaged: ``(2i, 2i+1)`` (the paper) or ``(i, i + L/2)``."""
    depth_scaling: Literal["none", "ode"] = "none"
    """``ode``: treat each layer as an Euler step, so coalescing doubles and de-coalescing halves the
    residual-branch outputs (attention and FFN output projections)."""
    alpha: float = 0.5
    """Interpolation weight of the de-coalesced model: ``(1 - alpha) * before + alpha * decoalesced``."""

    def __post_init__(self):
        if self.num_levels < 2:
            raise ValueError(f"multilevel.num_levels must be >= 2, got {self.num_levels}")
        if not (self.coalesce_width or self.coalesce_depth):
            raise ValueError("multilevel: coalesce_width and coalesce_depth cannot both be false")
        check_alpha(self.alpha, "multilevel.alpha")


def check_alpha(alpha: float, name: str = "alpha") -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {alpha}")


@dataclass
class ParallelConfig:
    """Model-parallel layout (data parallelism fills the remaining ranks)."""

    tensor_model_parallel_size: int = 1
    """Megatron tensor-parallel size."""

    def __post_init__(self):
        _check_positive("parallel.tensor_model_parallel_size", self.tensor_model_parallel_size)


@dataclass
class RunConfig:
    """A whole run: our blocks plus the DeepSpeed config they sit in."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The fine model."""
    multilevel: MultilevelConfig = field(default_factory=MultilevelConfig)
    """The V-cycle."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor parallelism."""
    deepspeed: dict = field(default_factory=dict)
    """Every DeepSpeed key of the file, passed to ``deepspeed.initialize`` unchanged."""

    def __post_init__(self):
        check_model_parallel(self.model, self.parallel.tensor_model_parallel_size)


OUR_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name != "deepspeed")


def check_model_parallel(model: ModelConfig, tp: int) -> None:
    """Raise if ``model`` cannot be split over ``tp`` tensor-parallel ranks."""
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        value = getattr(model, name)
        if value % tp:
            raise ValueError(
                f"parallel.tensor_model_parallel_size = {tp} does not divide model.{name} = {value}"
            )


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
    return parse_dataclass(RunConfig, ours, "config")


def config_to_dict(cfg: RunConfig) -> dict:
    """The run config as one JSON object again (DeepSpeed keys at the top level)."""
    data = to_dict(cfg)
    data.update(data.pop("deepspeed"))
    return data


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
