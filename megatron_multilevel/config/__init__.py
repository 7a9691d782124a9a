"""Run configuration: one JSON file that is a valid DeepSpeed config plus our own blocks.

One module per block (``model``, ``multilevel`` and its ``ode``, ``data``, ``training``,
``parallel``), the DeepSpeed side (``deepspeed``, ``optimizers``), strict parsing (``parsing``),
and the run with its cross-block checks and ``load_config`` (``run``). Every public name is
importable from here. Nothing in this package imports ``training/`` or ``parallel/``.
"""

from megatron_multilevel.config.data import DataConfig
from megatron_multilevel.config.deepspeed import (
    DEEPSPEED_KEYS,
    OPTIMIZER_STATE_KEYS,
    STATE_DEGREE,
    STATE_OPTIMIZERS,
    ZERO_STAGES,
    carries_optimizer_state,
    check_deepspeed_keys,
    deep_merge,
    optimizer_state_keys,
)
from megatron_multilevel.config.model import (
    TP_SPLIT_SIZES,
    ModelConfig,
    check_model_parallel,
    coarse_model_config,
    undivided_size,
    valid_tp_sizes,
)
from megatron_multilevel.config.multilevel import (
    COALESCE_ONLY_KEYS,
    STRATEGIES,
    WIDTH_GROWTHS,
    LevelConfig,
    MultilevelConfig,
    VisitConfig,
)
from megatron_multilevel.config.muon import (
    AUX_ADAM_STATE_KEYS,
    MUON_STATE_KEYS,
    check_muon,
    is_muon,
    muon_defaults,
    muon_parameter,
    parameter_state_keys,
)
from megatron_multilevel.config.ode import RESIDUAL_SCALES, OdeConfig
from megatron_multilevel.config.optimizers import check_optimizer, check_optimizers
from megatron_multilevel.config.parallel import (
    ParallelConfig,
    check_sequence_parallel_supported,
    resolve_sequence_parallel,
)
from megatron_multilevel.config.parsing import check_alpha, check_positive, parse_dataclass, to_dict
from megatron_multilevel.config.run import OUR_KEYS, RunConfig, config_to_dict, load_config, match_optimizer_rate
from megatron_multilevel.config.training import LRConfig, PhaseSpec, TrainingConfig

__all__ = [
    "DataConfig", "DEEPSPEED_KEYS", "OPTIMIZER_STATE_KEYS", "STATE_DEGREE", "STATE_OPTIMIZERS", "ZERO_STAGES",
    "carries_optimizer_state", "check_deepspeed_keys", "deep_merge", "optimizer_state_keys",
    "TP_SPLIT_SIZES", "ModelConfig", "check_model_parallel", "coarse_model_config", "undivided_size",
    "valid_tp_sizes", "COALESCE_ONLY_KEYS", "STRATEGIES", "WIDTH_GROWTHS", "LevelConfig", "MultilevelConfig",
    "VisitConfig", "AUX_ADAM_STATE_KEYS", "MUON_STATE_KEYS", "check_muon", "is_muon", "muon_defaults",
    "muon_parameter", "parameter_state_keys",
    "RESIDUAL_SCALES", "OdeConfig", "check_optimizer", "check_optimizers", "ParallelConfig",
    "check_sequence_parallel_supported", "resolve_sequence_parallel", "check_alpha", "check_positive",
    "parse_dataclass", "to_dict", "OUR_KEYS", "RunConfig", "config_to_dict", "load_config", "match_optimizer_rate",
    "LRConfig", "PhaseSpec", "TrainingConfig",
]
