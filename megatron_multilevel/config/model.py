"""The ``model`` block: the fine model's shape and architecture, the coarser levels' shapes, and
which tensor-parallel sizes can split them."""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

from megatron_multilevel.config.parsing import check_positive

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
    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    """FP8 training of the linear layers (Megatron-Core's ``fp8``, Transformer Engine's delayed
    scaling): ``e4m3`` everywhere, or ``hybrid`` (e4m3 forward, e5m2 gradients); needs the
    Transformer Engine layers on a GPU. Every level trains in it. Transitions carry weights and
    optimizer state only: each new level's layers (coalesced, de-coalesced or grown) start their
    FP8 scaling state (amax history, scales) afresh, as a new model does, since the ranges it
    recorded belong to the tensors the transition replaced; a resumed run continues its own."""
    depth_mup_base_layers: Optional[int] = None
    """Depth-muP (off: None): the depth at which this parametrisation is the standard one. A model of
    ``L`` layers multiplies each residual branch's output by ``(base / L) ** depth_mup_exponent``
    and trains its transformer layers' parameters at ``(base / L) ** (1 - depth_mup_exponent)``
    times the learning rate (Adam's rule), so that one learning rate serves every depth: the small
    and the full model of a growth, every level of a cycle."""
    depth_mup_exponent: float = 1.0
    """Depth-muP's exponent: 1 (CompleteP, Dey et al. 2025: branches times ``base / L``, the layers'
    rate unchanged) to 0.5 (Depth-muP, Yang et al. 2023: branches and rate times ``sqrt(base / L)``)."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_sequence_length"):
            check_positive(f"model.{name}", getattr(self, name))
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
            check_positive(f"model.{name}", getattr(self, name))
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        for name in ("init_method_std", "layernorm_epsilon", "rotary_base"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.kind == "gpt" and (self.num_tokentypes or self.add_binary_head):
            raise ValueError("model.num_tokentypes and model.add_binary_head are BERT-only")
        if self.add_binary_head and self.num_tokentypes < 2:
            raise ValueError("model.add_binary_head needs model.num_tokentypes >= 2")
        if self.depth_mup_base_layers is not None:
            check_positive("model.depth_mup_base_layers", self.depth_mup_base_layers)
        if not 0.5 <= self.depth_mup_exponent <= 1.0:
            raise ValueError(f"model.depth_mup_exponent must be in [0.5, 1] (0.5: Depth-muP, 1: CompleteP), "
                             f"got {self.depth_mup_exponent}")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def branch_multiplier(self) -> float:
        """What each residual branch's output is multiplied by (1 without depth-muP)."""
        if self.depth_mup_base_layers is None:
            return 1.0
        return (self.depth_mup_base_layers / self.num_layers) ** self.depth_mup_exponent

    @property
    def layer_lr_factor(self) -> float:
        """The transformer layers' learning rate over the rest's (1 without depth-muP)."""
        if self.depth_mup_base_layers is None:
            return 1.0
        return (self.depth_mup_base_layers / self.num_layers) ** (1.0 - self.depth_mup_exponent)


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



# The sizes tensor parallelism splits (each must be divisible by the TP size).
TP_SPLIT_SIZES = ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")


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
