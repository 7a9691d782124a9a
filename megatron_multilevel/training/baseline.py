"""The baseline of a multilevel run (``--with-baseline``): the fine model trained from scratch on
the same data and seed with the same training FLOPs, in ``<run>/baseline``, and what the
multilevel run saved against it; and its control (``<run>/control``, unless ``--no-control``):
the first coarse level's model alone from scratch on the same FLOPs, which says whether the full
model is yet the right model at this budget (where the control does as well as the baseline, a
saving shows only that the full model was not needed).

The saving is the savings benchmark's, at equal quality (``study/baseline.py``, called by the entry
point once the baseline has run): the training FLOPs and wall-clock seconds (training and
transitions) the run needs to first reach the validation loss the baseline ends at, against what
the baseline needs to reach it; or, when the run never reaches it, how far above it the run ends.
Both run in the same processes as the run, after it, and like it resume after a kill; a finished
one of the same config is reused.
"""

import dataclasses
import gc
import json
import os
import shutil

import torch.distributed as dist

from megatron_multilevel.config import RunConfig, config_to_dict, deep_merge, load_config, match_optimizer_rate
from megatron_multilevel.flops import flops_per_token
from megatron_multilevel.records import SUMMARY
from megatron_multilevel.training.schedule import build_phases, fine_equivalent_steps

BASELINE_DIR = "baseline"
CONTROL_DIR = "control"


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


def control_config(cfg: RunConfig, base: RunConfig) -> RunConfig:
    """The control of the multilevel run ``cfg`` whose baseline is ``base``: level 1's model
    (the first coarse one) alone from scratch, with as many steps as spend the baseline's training
    FLOPs, the same share of them warming up and the baseline's decay; level 1's first peak rate,
    tensor-parallel size and DeepSpeed overrides; ``training.output_dir`` ``<run>/control``."""
    models, seq = cfg.level_models(), cfg.data.seq_length
    assert len(models) > 1, "a multilevel run has a coarse level"
    steps = max(1, round(base.training.train_steps * flops_per_token(models[0], seq)
                         / flops_per_token(models[1], seq)))
    peak = next((p.lr.peak for p in build_phases(cfg) if p.level == 1 and p.steps), base.training.lr.peak)
    warmup = round(base.training.lr.warmup_steps * steps / base.training.train_steps)
    lr = dataclasses.replace(base.training.lr, peak=peak, warmup_steps=warmup)
    data = deep_merge(config_to_dict(cfg), cfg.level_deepspeed(1))
    data["model"] = dataclasses.asdict(models[1])
    data["multilevel"] = {"enabled": False}
    data["parallel"] = {"tensor_model_parallel_size": cfg.level_tp_sizes()[1]}
    data["training"].update(train_steps=steps, lr=dataclasses.asdict(lr),
                            output_dir=os.path.join(cfg.training.output_dir, CONTROL_DIR))
    match_optimizer_rate(data, peak)
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


def run_reference(ref: RunConfig, name: str, about: str, stop=None) -> None:
    """Train (or resume, or reuse) the reference run ``ref`` (the baseline or the control, ``name``;
    ``about`` says what it trains) on every rank, after the multilevel run (the comparison is the
    study's: ``study/baseline.py``); ``stop``: the process's signal handler (``Trainer``)."""
    from megatron_multilevel.training.trainer import Trainer

    rank, ref_dir = dist.get_rank(), ref.training.output_dir
    decision = [_state(ref) if rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)  # one decision, whatever each rank's file system shows
    state = decision[0]
    if rank == 0 and state == "finished":
        print(f"{name}: reusing the finished {name} in {ref_dir}", flush=True)
    elif rank == 0:
        if state == "other":
            print(f"{name}: {ref_dir} holds a run of another config; removing it", flush=True)
            shutil.rmtree(ref_dir)
        print(f"{name}: training {about} for {ref.training.train_steps} steps (the run's training FLOPs) in "
              f"{ref_dir}", flush=True)
    dist.barrier()
    if state != "finished":
        gc.collect()  # the run's engines
        Trainer(ref, stop).run()
