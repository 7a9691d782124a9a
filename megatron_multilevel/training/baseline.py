"""The baseline of a multilevel run (``--with-baseline``): the fine model trained from scratch on
the same data and seed with the same training FLOPs, in ``<run>/baseline``, and what the
multilevel run saved against it.

The saving is the savings benchmark's, at equal quality (``study/baseline.py``, called by the entry
point once the baseline has run): the training FLOPs and wall-clock seconds (training and
transitions) the run needs to first reach the validation loss the baseline ends at, against what
the baseline needs to reach it; or, when the run never reaches it, how far above it the run ends.
The baseline runs in the same processes as
the run, after it, and like it resumes after a kill; a finished baseline of the same config is
reused.
"""

import dataclasses
import gc
import json
import os
import shutil

import torch.distributed as dist

from megatron_multilevel.config import RunConfig, config_to_dict, deep_merge, load_config, match_optimizer_rate
from megatron_multilevel.records import SUMMARY
from megatron_multilevel.training.schedule import build_phases, fine_equivalent_steps

BASELINE_DIR = "baseline"


def baseline_config(cfg: RunConfig) -> RunConfig:
    """The baseline of the multilevel run ``cfg``: multilevel disabled; the fine level's
    tensor-parallel size and DeepSpeed overrides; as many steps as spend the run's training FLOPs;
    ``training.output_dir`` ``<run>/baseline``.

    Its learning rate is a from-scratch schedule made of the run's own: the fine level's first
    peak, the warm-up of the run's first phase (the one that starts from random weights, at
    whatever level: an F-cycle's fine phases come after growth and need none) and the decay of the
    run's last fine phase (the anneal it ends with: an ODE run's fine phases in the cycles are
    constant)."""
    if not cfg.multilevel.enabled:
        raise ValueError("--with-baseline compares a multilevel run with training from scratch, and "
                         "multilevel.enabled is false; drop --with-baseline")
    phases = build_phases(cfg)
    steps = max(1, round(fine_equivalent_steps(cfg, phases)))  # the run's FLOPs in fine steps
    fine = [p.lr for p in phases if p.level == 0 and p.steps] or [cfg.training.lr]
    first = next((p.lr for p in phases if p.steps), fine[0])
    lr = dataclasses.replace(fine[0], warmup_steps=first.warmup_steps, decay=fine[-1].decay,
                             min_ratio=fine[-1].min_ratio)
    levels = cfg.multilevel.levels
    data = deep_merge(config_to_dict(cfg), levels[0].deepspeed if levels else {})
    data["multilevel"] = {"enabled": False}
    data["parallel"] = {"tensor_model_parallel_size": cfg.level_tp_sizes()[0]}
    data["training"].update(train_steps=steps, lr=dataclasses.asdict(lr),
                            output_dir=os.path.join(cfg.training.output_dir, BASELINE_DIR))
    match_optimizer_rate(data, lr.peak)
    return load_config(data)


def _state(cfg: RunConfig) -> str:
    """``finished`` (a summary and this very config), ``started`` (this config, no summary: the
    trainer resumes it), ``other`` (a run of another config, or of none) or ``none``."""
    run_dir = cfg.training.output_dir
    if not os.path.isdir(run_dir):
        return "none"
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return "other"
    if saved != json.loads(json.dumps(config_to_dict(cfg))):
        return "other"
    return "finished" if os.path.isfile(os.path.join(run_dir, SUMMARY)) else "started"


def run_baseline(cfg: RunConfig, base: RunConfig) -> None:
    """Train (or resume, or reuse) the baseline ``base`` of the finished run ``cfg`` on every rank
    (the comparison is the study's: ``study/baseline.py``)."""
    from megatron_multilevel.training.trainer import Trainer

    rank, base_dir = dist.get_rank(), base.training.output_dir
    decision = [_state(base) if rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)  # one decision, whatever each rank's file system shows
    state = decision[0]
    if rank == 0 and state == "finished":
        print(f"baseline: reusing the finished baseline in {base_dir}", flush=True)
    elif rank == 0:
        if state == "other":
            print(f"baseline: {base_dir} holds a run of another config; removing it", flush=True)
            shutil.rmtree(base_dir)
        print(f"baseline: training the fine model from scratch for {base.training.train_steps} steps (the run's "
              f"training FLOPs) in {base_dir}", flush=True)
    dist.barrier()
    if state != "finished":
        gc.collect()  # the run's engines
        Trainer(base).run()
