"""A resumed run's config against the one its checkpoint was written by: what would change the
trajectory is refused (one line naming the keys) unless the user says ``--allow-config-change``;
then each change is recorded in ``<run>/config_changes.jsonl`` with the step it took effect, and
``<run>/config.json`` becomes the config that runs from there on."""

import json
import os
import re

from megatron_multilevel.config.parsing import flatten

# Keys that do not change what the run computes: where it writes, how often it logs, evaluates and
# saves, how long a stop may take, how transitions are checked, where the data cache is; the layout
# (tensor-parallel size, ZeRO stage, micro-batches: the global batch is compared on its own, a
# layout the checkpoint cannot be loaded in is refused by the layout check); DeepSpeed's monitors
# and profilers.
NEUTRAL = ("training.output_dir", "training.log_interval", "training.eval_interval", "training.eval_batches",
           "training.save_interval", "training.keep_checkpoints", "training.stop_grace_seconds",
           "training.transition_check", "training.transition_check_steps", "training.transition_check_tolerance",
           "data.cache_dir",
           "data.num_workers", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "parallel.",
           "zero_optimization.", "activation_checkpointing.", "steps_per_print", "wall_clock_breakdown",
           "tensorboard.", "wandb.", "csv_monitor.", "comet.", "flops_profiler.")
CHANGES = "config_changes.jsonl"


def trajectory_changes(saved: dict, ours: dict) -> dict[str, tuple]:
    """``key: (saved value, our value)`` for every key of both configs (``config_to_dict``) that
    differs and changes the trajectory. A key only one has is an option the other's code did not
    know (its default keeps the earlier behaviour) or a list of another length (the schedule's
    check names those)."""
    before, after = flatten(saved), flatten(ours)
    return {key: (before[key], after[key]) for key in sorted(set(before) & set(after))
            if before[key] != after[key] and not _neutral(key)}


def _neutral(key: str) -> bool:
    # a level's own layout and DeepSpeed block (multilevel.levels.<i>.tensor_model_parallel_size,
    # multilevel.levels.<i>.deepspeed.zero_optimization.stage) read as the run's
    key = re.sub(r"^multilevel\.levels\.\d+\.(deepspeed\.)?", "", key)
    key = {"tensor_model_parallel_size": "parallel.", "sequence_parallel": "parallel."}.get(key, key)
    return any(key == n or (n.endswith(".") and key.startswith(n)) for n in NEUTRAL)


def describe(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, (old, new) in changes.items())


def record(run_dir: str, changes: dict[str, tuple], *, global_step: int, tag: str, config: dict) -> None:
    """Append the changes (and the step they take effect) to ``config_changes.jsonl``, and make
    ``config.json`` the config that runs from now on (rank 0)."""
    with open(os.path.join(run_dir, CHANGES), "a") as f:
        f.write(json.dumps({"global_step": global_step, "resumed_from": tag,
                            "changes": {k: {"before": old, "after": new} for k, (old, new) in changes.items()}}) + "\n")
    path = os.path.join(run_dir, "config.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(config, f, indent=1)
    os.replace(f"{path}.tmp", path)
