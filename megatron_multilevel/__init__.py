"""Multi-level (V-cycle) pretraining of Megatron-Core GPT and BERT models with DeepSpeed.

The public API: configs, model builders, level maps and the three operators of
Zou, Zhang & Deng (ICLR 2024): coalescing, de-coalescing and interpolation.
"""

from megatron_multilevel.config import (
    ModelConfig,
    MultilevelConfig,
    ParallelConfig,
    RunConfig,
    coarse_model_config,
    config_to_dict,
    load_config,
)
from megatron_multilevel.cpu_shims import apply_cpu_shims
from megatron_multilevel.distributed import init_distributed, set_seed
from megatron_multilevel.level_maps import Grouping, LevelMap, make_level_map, make_level_maps
from megatron_multilevel.models import (
    build_model,
    load_parameters,
    model_logits,
    parameter_state_dict,
)
from megatron_multilevel.operators import (
    coalesce,
    coalesce_layers,
    decoalesce,
    decoalesce_layer,
    interpolate,
)
from megatron_multilevel.plan import ParameterPlan, parameter_plan

__all__ = [
    "ModelConfig",
    "MultilevelConfig",
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
    "ParameterPlan",
    "parameter_plan",
]
