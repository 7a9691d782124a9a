"""The DeepSpeed side of a run config: its top-level keys, ZeRO stages, the optimizer state the
transitions carry, and the deep merge of a level's overrides.

DeepSpeed silently ignores a top-level key it does not know (``"zero_optimisation"``), so every
key of the file, and of every level's overrides, is checked against ``DEEPSPEED_KEYS``.
"""

import copy

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
ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed's monitors: the run's, fed its own records (``training/metrics.py``), not an engine's
# (each level's engine would start its own W&B run and log its own sample counts)
MONITOR_KEYS = ("tensorboard", "wandb", "csv_monitor", "comet")

# The optimizer state the transitions keep or map, by DeepSpeed optimizer type (lower case). Muon's
# is per parameter (``config.muon.parameter_state_keys``): its momentum for the layers' weight
# matrices, its auxiliary Adam's moments for the rest; a stream of one key moves the parameters
# that keep it.
OPTIMIZER_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
                        "sgd": ("momentum_buffer",), "muon": ("momentum_buffer", "exp_avg", "exp_avg_sq")}
# How each state scales when its parameter is rescaled: the states are in units of the gradient
# (first moments, momentum) or of the squared gradient (Adam's second moment), and where a
# parameter is multiplied by ``s`` its gradient is multiplied by ``1 / s`` (the chain rule). A
# transition that rescales a parameter (a residual branch's output under ``ode`` or ``identity``
# depth scaling, a depth multiplier that changes with the depth) multiplies each carried state by
# ``s ** degree``: Adam's step ``m / sqrt(v)`` is then the same in either parametrisation (eps
# aside), and the gradients added later are in the same units.
STATE_DEGREE = {"exp_avg": -1, "exp_avg_sq": -2, "momentum_buffer": -1}
# Their DeepSpeed spellings: the Adam types and Muon in any case, torch's SGD only as spelled.
STATE_OPTIMIZERS = ("Adam", "AdamW", "Muon", "SGD")


def check_deepspeed_keys(keys, where: str) -> None:
    """Raise a ValueError naming ``where`` if one of ``keys`` is not a DeepSpeed top-level key."""
    unknown = sorted(set(keys) - DEEPSPEED_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown DeepSpeed key(s) {unknown}; valid keys are {sorted(DEEPSPEED_KEYS)}")


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_batch_and_zero(deepspeed: dict, where: str = "") -> None:
    """The batch sizes and the ZeRO stage of a (merged) DeepSpeed config, checked before DeepSpeed
    sees them: it would stop with an assertion or a validation traceback after start-up."""
    for key in BATCH_KEYS:
        value = deepspeed.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{key}{where} must be a positive integer, got {value!r}")
    clipping = deepspeed.get("gradient_clipping")
    if clipping is not None and (isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or clipping < 0):
        raise ValueError(f"gradient_clipping{where} must be a number >= 0 (0: no clipping), got {clipping!r}")
    zero = deepspeed.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"zero_optimization{where} must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"zero_optimization.stage{where} = {stage!r}; valid choices are {list(ZERO_STAGES)}")


def carries_optimizer_state(kind: str) -> bool:
    """Whether the transitions know the state of DeepSpeed's ``optimizer.type`` ``kind``."""
    return kind.lower() in ("adam", "adamw", "muon") or kind == "SGD"


def optimizer_state_keys(deepspeed: dict) -> tuple[str, ...]:
    """The optimizer state a transition can carry under a DeepSpeed config: Adam's moments, SGD's
    momentum (none without momentum), Muon's momentum and its auxiliary Adam's moments."""
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
