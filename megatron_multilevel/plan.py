"""The declarative per-parameter plan: what each dimension of each Megatron parameter means.

Every dimension is one of:
- a unit dimension the operators act on, on the ``out`` side (coalescing averages partners,
  de-coalescing copies) or the ``in`` side (coalescing sums partners, de-coalescing splits
  evenly): ``hidden``, ``qkv`` (Megatron's fused per-query-group ``[q | k | v]`` rows), ``heads``
  (the attention output, a group's heads adjacent), ``ffn``, ``ffn_glu`` (SwiGLU's stacked
  ``[gate; up]``);
- or a dimension that is never coalesced: ``vocab``, ``positions``, ``tokentypes``, ``classes``.

Per-layer parameters (``decoder.layers.N.`` for GPT, ``encoder.layers.N.`` for BERT) are averaged
across the layers of a depth group. ``residual`` marks the outputs of a residual branch (scaled
under ODE depth scaling); ``tied_output_norm`` marks the norm right before a tied output layer
(doubled on coalescing, halved on de-coalescing, which keeps width de-coalescing exact).

Names cover both Megatron's local layer spec and the Transformer Engine spec (whose norms are
fused into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight`` / ``layer_norm_bias``).
"""

import re
from dataclasses import dataclass
from typing import Optional

from megatron_multilevel.config import ModelConfig

UNIT_KINDS = ("hidden", "qkv", "heads", "ffn", "ffn_glu")
KEPT_KINDS = ("vocab", "positions", "tokentypes", "classes")


@dataclass(frozen=True)
class Dim:
    kind: str
    side: Optional[str] = None  # "out" | "in" for unit kinds, None for kept kinds

    def __post_init__(self):
        assert (self.kind in UNIT_KINDS and self.side in ("out", "in")) or (
            self.kind in KEPT_KINDS and self.side is None
        ), self


@dataclass(frozen=True)
class ParamRule:
    dims: tuple[Dim, ...]
    residual: bool = False
    tied_output_norm: bool = False


def _out(kind):
    return Dim(kind, "out")


def _in(kind):
    return Dim(kind, "in")


VOCAB, POSITIONS, TOKENTYPES, CLASSES = (Dim(k) for k in KEPT_KINDS)

LAYER_PATTERN = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.+)$")


# Transformer Engine fuses the pre-attention / pre-MLP norms into the next linear layer.
TE_NORM_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def layer_rules(cfg: ModelConfig) -> dict[str, ParamRule]:
    """Rules for the parameters of one transformer layer, by name inside the layer.

    Holds both namings of the norms (local and Transformer Engine spec)."""
    ffn_out = _out("ffn_glu" if cfg.gated else "ffn")
    norm = ParamRule((_out("hidden"),))
    rules = {
        "input_layernorm.weight": norm,
        "pre_mlp_layernorm.weight": norm,
        "self_attention.linear_qkv.layer_norm_weight": norm,
        "mlp.linear_fc1.layer_norm_weight": norm,
        "self_attention.linear_qkv.weight": ParamRule((_out("qkv"), _in("hidden"))),
        "self_attention.linear_proj.weight": ParamRule((_out("hidden"), _in("heads")), residual=True),
        "mlp.linear_fc1.weight": ParamRule((ffn_out, _in("hidden"))),
        "mlp.linear_fc2.weight": ParamRule((_out("hidden"), _in("ffn")), residual=True),
    }
    if cfg.normalization == "LayerNorm":
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            rules[f"{name}.bias"] = norm
        rules["self_attention.linear_qkv.layer_norm_bias"] = norm
        rules["mlp.linear_fc1.layer_norm_bias"] = norm
    if cfg.add_bias_linear:
        rules["self_attention.linear_qkv.bias"] = ParamRule((_out("qkv"),))
        rules["self_attention.linear_proj.bias"] = ParamRule((_out("hidden"),), residual=True)
        rules["mlp.linear_fc1.bias"] = ParamRule((ffn_out,))
        rules["mlp.linear_fc2.bias"] = ParamRule((_out("hidden"),), residual=True)
    return rules


def model_rules(cfg: ModelConfig) -> dict[str, ParamRule]:
    """Rules for the parameters outside the transformer layers."""
    tied = cfg.share_embeddings_and_output_weights
    hidden_vec = (_out("hidden"),)
    # The norm right before the output layer: GPT's final norm, BERT's LM-head norm.
    head_norm = "decoder.final_layernorm" if cfg.kind == "gpt" else "lm_head.layer_norm"
    stack = "decoder" if cfg.kind == "gpt" else "encoder"
    norm_names = [f"{stack}.final_layernorm"]
    rules = {"embedding.word_embeddings.weight": ParamRule((VOCAB, _out("hidden")))}
    if cfg.position_embedding_type == "learned_absolute":
        rules["embedding.position_embeddings.weight"] = ParamRule((POSITIONS, _out("hidden")))
    if not tied:
        rules["output_layer.weight"] = ParamRule((VOCAB, _in("hidden")))
    if cfg.kind == "bert":
        norm_names.append("lm_head.layer_norm")
        rules["lm_head.dense.weight"] = ParamRule((_out("hidden"), _in("hidden")))
        rules["lm_head.dense.bias"] = ParamRule(hidden_vec)
        rules["output_layer.bias"] = ParamRule((VOCAB,))
        if cfg.num_tokentypes:
            rules["embedding.tokentype_embeddings.weight"] = ParamRule((TOKENTYPES, _out("hidden")))
        if cfg.add_binary_head:
            rules["pooler.dense.weight"] = ParamRule((_out("hidden"), _in("hidden")))
            rules["pooler.dense.bias"] = ParamRule(hidden_vec)
            rules["binary_head.weight"] = ParamRule((CLASSES, _in("hidden")))
            rules["binary_head.bias"] = ParamRule((CLASSES,))
    suffixes = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    for name in norm_names:
        for suffix in suffixes:
            rules[f"{name}.{suffix}"] = ParamRule(
                hidden_vec, tied_output_norm=tied and name == head_norm
            )
    return rules


@dataclass(frozen=True)
class ParameterPlan:
    """Rules for every parameter of one model config."""

    layer: dict[str, ParamRule]
    model: dict[str, ParamRule]

    def rule(self, name: str) -> tuple[Optional[int], ParamRule]:
        """``(layer index or None, rule)`` for a full parameter name; ValueError if unknown."""
        match = LAYER_PATTERN.match(name)
        if match:
            layer, local = int(match.group(2)), match.group(3)
            if local in self.layer:
                return layer, self.layer[local]
        elif name in self.model:
            return None, self.model[name]
        raise ValueError(
            f"parameter {name!r} is not in the multilevel plan for this model; known names are "
            f"{sorted(self.model)} and '<decoder|encoder>.layers.N.' + {sorted(self.layer)}"
        )


def parameter_plan(cfg: ModelConfig) -> ParameterPlan:
    return ParameterPlan(layer=layer_rules(cfg), model=model_rules(cfg))


def is_metadata(name: str) -> bool:
    """State-dict entries that are not parameters (Megatron/TE ``_extra_state``)."""
    return name.endswith("._extra_state")


def layer_param_names(cfg: ModelConfig, *, te: bool) -> frozenset[str]:
    """The exact parameter names of one layer under the local (``te=False``) or TE spec."""
    names = set()
    for name in layer_rules(cfg):
        is_te_name = any(name.startswith(t) for t in TE_NORM_NAMES.values())
        is_local_name = any(name.startswith(t) for t in TE_NORM_NAMES)
        if (te and not is_local_name) or (not te and not is_te_name):
            names.add(name)
    return frozenset(names)


def layer_prefix(cfg: ModelConfig, layer: int) -> str:
    return f"{'decoder' if cfg.kind == 'gpt' else 'encoder'}.layers.{layer}."
