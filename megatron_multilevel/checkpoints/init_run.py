"""Start a run from given weights (a model imported with ``from-hf``, a Megatron-Core ``torch_dist``
checkpoint, any checkpoint of this project).

The weights are written as the run's first checkpoint (phase 0, step 0: the model of the first
phase's level, which is the fine model of a cycle and the small model of a growth schedule; a fresh
optimizer, or a ``torch_dist`` source's optimizer state where it has one; the schedule at its
start) in the layout the config asks for, with the sidecar the
trainer writes, for the number of ranks the run will have (``num_gpus``: ZeRO partitions follow
it); launching the config then resumes from it, so the V-cycle (or the baseline) starts
from these weights instead of a random initialisation. Like every conversion, the checkpoint is
loaded the way the trainer loads it and its logits compared with the source's before success.
"""

import dataclasses
import os
from typing import Optional, Sequence

from megatron_multilevel.checkpoints import verify
from megatron_multilevel.checkpoints.convert import load_source
from megatron_multilevel.checkpoints.full import prepare_output
from megatron_multilevel.checkpoints.reshard import rank_worker
from megatron_multilevel.config import config_to_dict, load_config
from megatron_multilevel.config.parsing import apply_overrides, read_json_object
from megatron_multilevel.level_maps import run_level_maps
from megatron_multilevel.parallel.spawn import run_ranks
from megatron_multilevel.training.checkpoint import RunState
from megatron_multilevel.training.engines import LevelEngines
from megatron_multilevel.training.schedule import build_phases, schedule_signature


def init_run(src: str, config_path: str, out: str, *, num_gpus: Optional[int] = None, overwrite: bool = False,
             fresh_optimizer: bool = False, overrides: Sequence[str] = ()) -> None:
    config = apply_overrides(read_json_object(config_path), list(overrides))
    config.setdefault("training", {})["output_dir"] = os.path.abspath(out)
    cfg = load_config(config)
    tp, pp = cfg.level_tp_sizes()[0], cfg.level_pipelines()[0].size
    world = tp * pp if num_gpus is None else num_gpus
    try:
        levels = LevelEngines(cfg, world)  # every level's TP size and the batch fit the ranks
    except ValueError as e:
        raise ValueError(f"--num-gpus {world}: {e}") from None
    if cfg.multilevel.enabled and cfg.multilevel.strategy != "coalesce":
        raise ValueError(f"init-run starts runs of multilevel.strategy 'coalesce' or the baseline; "
                         f"got {cfg.multilevel.strategy!r}")
    phases = build_phases(cfg)
    level = phases[0].level
    first = cfg.level_models()[level]  # a growth schedule's small model, a cycle's fine one
    where = "the config's model" if level == 0 else (
        f"the model of the config's first level ({level}, {first.num_layers} x {first.hidden_size}: its "
        f"{cfg.multilevel.cycle!r} cycle starts from its smaller model; a checkpoint of the full model needs a "
        f"schedule that starts at level 0, such as a V-cycle or training from scratch)")
    try:
        source = load_source(src, first)
    except ValueError as e:
        raise ValueError(f"init-run builds the run's first phase, {where}: {e}") from None
    ours = dataclasses.asdict(first)
    theirs = dataclasses.asdict(source.model)
    if ours != theirs:
        diff = sorted(k for k in ours if ours[k] != theirs.get(k))
        raise ValueError(f"{where} differs from the checkpoint's: "
                         + ", ".join(f"model.{k} = {ours[k]!r}, the checkpoint has {theirs.get(k)!r}" for k in diff))
    moments = {} if fresh_optimizer else source.moments
    keys = levels.optimizer_state_keys()
    if moments and set(moments) != set(keys):
        print(f"{src}: its optimizer state ({', '.join(sorted(moments))}) is not the run's optimizer's "
              f"({', '.join(keys) or 'none'}): the run starts with a fresh one")
        moments = {}
    prepare_output(out, overwrite, src)
    meta = {"model": dataclasses.asdict(cfg.model), "level_maps": [m.to_json() for m in run_level_maps(cfg)],
            "config": config_to_dict(cfg), "config_phases": schedule_signature(phases)}
    item = {"tensors": source.plain_tensors(), "state": dataclasses.asdict(RunState()), "meta": meta, "latest": True,
            "path": os.path.abspath(src)}
    if moments:  # Adam's bias correction continues from the source's step
        item.update(moments=moments, step=source.optimizer_step)
    tokens = verify.fixed_tokens(source.model)
    os.makedirs(out, exist_ok=True)
    written = run_ranks(rank_worker, world, config_to_dict(cfg), os.path.abspath(out), [item], tokens,
                        tensor_model_parallel_size=cfg.level_tp_sizes()[level])[0]
    logits = written["logits"]
    for step, difference in written["state"].values():
        if difference != 0.0 or step != source.optimizer_step:
            raise RuntimeError(f"the run's first checkpoint holds another optimizer state than the source's "
                               f"(largest difference {difference:.3g}, step {step} for {source.optimizer_step})")
        print(f"optimizer state {', '.join(sorted(moments))} at step {step}: the source's, exactly")
    verify.finish_run(out, cfg, [("source", f"the run's first checkpoint, loaded as the trainer does (TP={tp}, {world} rank(s))",
                                  verify.logits_full(source.tensors, source.model, tokens, step=source.step),
                                  logits)],
                      "the run's first checkpoint computes other logits than the source")
    print(f"wrote {out}: phase 0, step 0 holds the source's weights (level {level}); train with\n"
          f"  launch/pretrain_vcycle.sh {os.path.join(out, 'config.json')}" + (f" --num_gpus {world}" if world > 1 else ""))
