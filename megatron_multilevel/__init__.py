"""Multi-level (V-cycle) pretraining of Megatron-Core GPT and BERT models with DeepSpeed.

The public API: configs, model builders, level maps and the three operators of
Zou, Zhang & Deng (ICLR 2024): coalescing, de-coalescing and interpolation; and the ODE strategy's
layer selection, restriction and prolongation (Lauga et al., 2025).
"""

from megatron_multilevel.config import (
    ModelConfig,
    MultilevelConfig,
    OdeConfig,
    ParallelConfig,
    RunConfig,
    coarse_model_config,
    config_to_dict,
    load_config,
)
from megatron_multilevel.cpu_shims import apply_cpu_shims
from megatron_multilevel.distributed import init_distributed, set_seed
from megatron_multilevel.level_maps import Grouping, LayerSelection, LevelMap, make_level_map, make_level_maps
from megatron_multilevel.models import (
    build_model,
    load_parameters,
    model_logits,
    parameter_state_dict,
)
from megatron_multilevel.operators import (
    coalesce,
    coalesce_layers,
    correct_model,
    decoalesce,
    decoalesce_layer,
    interpolate,
)
from megatron_multilevel.ode_operators import prolong, prolongation_sources, restrict, restrict_gradient, restrict_layer
from megatron_multilevel.plan import ParameterPlan, parameter_plan

__all__ = [
    "ModelConfig",
    "MultilevelConfig",
    "OdeConfig",
    "ParallelConfig",
    "RunConfig",
    "coarse_model_config",
    "config_to_dict",
    "load_config",
    "apply_cpu_shims",
    "init_distributed",
    "set_seed",
    "Grouping",
    "LevelMap",
    "make_level_map",
    "make_level_maps",
    "build_model",
    "load_parameters",
    "model_logits",
    "parameter_state_dict",
    "coalesce",
    "coalesce_layers",
    "decoalesce",
    "decoalesce_layer",
    "interpolate",
    "correct_model",
    "LayerSelection",
    "restrict",
    "restrict_gradient",
    "prolong",
    "restrict_layer",
    "prolongation_sources",
    "ParameterPlan",
    "parameter_plan",
]
