"""Start a run from given weights (e.g. a model imported with ``from-hf``).

The weights are written as the run's first checkpoint (phase 0, step 0: the fine model, a fresh
optimizer, the schedule at its start) in the layout the config asks for, with the sidecar the
trainer writes, for the number of ranks the run will have (``num_gpus``: ZeRO partitions follow
it); launching the config then resumes from it, so the V-cycle (or the baseline) starts
from these weights instead of a random initialisation. Like every conversion, the checkpoint is
loaded the way the trainer loads it and its logits compared with the source's before success.
"""

import dataclasses
import json
import os
from typing import Optional

from megatron_multilevel.checkpoints import verify
from megatron_multilevel.checkpoints.convert import load_source
from megatron_multilevel.checkpoints.full import prepare_output
from megatron_multilevel.checkpoints.reshard import rank_worker
from megatron_multilevel.config import config_to_dict, load_config
from megatron_multilevel.level_maps import run_level_maps
from megatron_multilevel.parallel.spawn import run_ranks
from megatron_multilevel.training.checkpoint import RunState
from megatron_multilevel.training.engines import LevelEngines
from megatron_multilevel.training.schedule import build_phases, schedule_signature


def init_run(src: str, config_path: str, out: str, *, num_gpus: Optional[int] = None, overwrite: bool = False) -> None:
    with open(config_path) as f:
        config = json.load(f)
    config.setdefault("training", {})["output_dir"] = os.path.abspath(out)
    cfg = load_config(config)
    tp = cfg.level_tp_sizes()[0]
    world = tp if num_gpus is None else num_gpus
    try:
        LevelEngines(cfg, world)  # every level's TP size and the batch fit the ranks
    except ValueError as e:
        raise ValueError(f"--num-gpus {world}: {e}") from None
    if cfg.multilevel.enabled and cfg.multilevel.strategy != "coalesce":
        raise ValueError(f"init-run starts runs of multilevel.strategy 'coalesce' or the baseline; "
                         f"got {cfg.multilevel.strategy!r}")
    phases = build_phases(cfg)
    if phases[0].level != 0:
        raise ValueError(f"the config's first phase trains level {phases[0].level}; init-run starts from the fine "
                         f"model (level 0), so multilevel.cycle must begin there (not 'f' or 'grow')")
    source = load_source(src)
    ours = dataclasses.asdict(cfg.model)
    theirs = dataclasses.asdict(source.model)
    if ours != theirs:
        diff = sorted(k for k in ours if ours[k] != theirs.get(k))
        raise ValueError("the config's model differs from the checkpoint's: "
                         + ", ".join(f"model.{k} = {ours[k]!r}, the checkpoint has {theirs.get(k)!r}" for k in diff))
    prepare_output(out, overwrite, src)
    meta = {"model": ours, "level_maps": [m.to_json() for m in run_level_maps(cfg)], "config": config_to_dict(cfg),
            "config_phases": schedule_signature(phases)}
    item = {"tensors": source.plain_tensors(), "state": dataclasses.asdict(RunState()), "meta": meta, "latest": True,
            "path": os.path.abspath(src)}
    tokens = verify.fixed_tokens(source.model)
    os.makedirs(out, exist_ok=True)
    logits = run_ranks(rank_worker, world, config_to_dict(cfg), os.path.abspath(out), [item], tokens,
                       tensor_model_parallel_size=tp)[0]["logits"]
    verify.finish_run(out, cfg, [("source", f"the run's first checkpoint, loaded as the trainer does (TP={tp}, {world} rank(s))",
                                  verify.logits_full(source.tensors, source.model, tokens, step=source.step),
                                  logits)],
                      "the run's first checkpoint computes other logits than the source")
    print(f"wrote {out}: phase 0, step 0 holds the source's weights; train with\n"
          f"  launch/pretrain_vcycle.sh {os.path.join(out, 'config.json')}" + (f" --num_gpus {world}" if world > 1 else ""))
