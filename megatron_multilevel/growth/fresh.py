"""Fresh layers for a level grown in depth (``multilevel.growth_operator = "random"``): the layers
growth adds start from a new initialisation instead of copies of the smaller model's, as the
zero/one-layer expansion of Bu (ICML 2026, "Scaling depth capacity via zero/one-layer model
expansion") initialises them; with ``depth_scaling = "identity"`` their residual branches' output
weights are zero, so that the grown model computes exactly the smaller one.

Pure: the noise comes from the caller, drawn for the full tensor and cut to what the caller holds
(``parallel/streams.ModelWriter.full_tensor_noise``), so that every layout builds the same layer.
"""

import math
from typing import Callable, Mapping

import torch

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.plan import is_metadata, layer_rules

Noise = Callable[[str, torch.Size], torch.Tensor]
"""Standard normal noise for one parameter of the layer (its name inside the layer, its shape)."""


def is_norm(name: str) -> bool:
    """A normalisation's parameter (local spec ``*_layernorm.*``, Transformer Engine ``*.layer_norm_*``)."""
    return "layernorm" in name or "layer_norm" in name


def fresh_layer(template: Mapping[str, torch.Tensor], cfg: ModelConfig, noise: Noise, *,
                zero_residual: bool) -> dict[str, torch.Tensor]:
    """Parameters of one transformer layer of the grown model ``cfg``, freshly initialised as
    Megatron-Core initialises them, with the names, shapes and dtypes of ``template`` (only those
    are read): norms' weights 1 and biases 0; other biases 0; the residual branches' output weights
    (attention's ``linear_proj``, the MLP's ``linear_fc2``) normal with ``init_method_std / sqrt(2 *
    num_layers)`` (Megatron-Core's ``output_layer_init_method``), or 0 with ``zero_residual``; every
    other weight normal with ``init_method_std``."""
    rules = layer_rules(cfg)
    out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    out = {}
    for name, t in template.items():
        if is_metadata(name):
            continue
        if is_norm(name):
            value = torch.ones_like(t) if name.endswith("weight") else torch.zeros_like(t)
        elif name.endswith("bias") or (zero_residual and rules[name].residual):
            value = torch.zeros_like(t)
        else:
            std = out_std if rules[name].residual else cfg.init_method_std
            value = (noise(name, t.shape) * std).to(dtype=t.dtype, device=t.device)
        out[name] = value
    return out
