"""Reshard a run to another tensor-parallel size, so that training continues in the new layout.

The latest checkpoint and those a resume still needs (the pre-coalescing checkpoints of coarsened
levels) are consolidated, then written again by DeepSpeed from ``N`` ranks laid out as the new
config says (its ZeRO stages included), with the run's position, counters and level maps. Adam
restarts from zero moments; the learning-rate schedule continues at its step. Before reporting
success, each new checkpoint is loaded the way the trainer loads it and its logits are compared
with the consolidated model's.
"""

import copy
import functools
import os
import shutil

import torch.distributed as dist


from megatron_multilevel.checkpoints import verify
from megatron_multilevel.checkpoints.deepspeed_reader import merge_tensor_parallel, open_checkpoint, rank_state_dicts
from megatron_multilevel.checkpoints.full import prepare_output
from megatron_multilevel.config import config_to_dict, load_config
from megatron_multilevel.parallel.coherence import FILE as COHERENCE_FILE
from megatron_multilevel.parallel.spawn import run_ranks
from megatron_multilevel.parallel.staging import copy_stream
from megatron_multilevel.parallel.streams import Groups, ModelWriter, TensorsReader
from megatron_multilevel.training import checkpoint
from megatron_multilevel.training.checkpoint import checkpoint_dir, read_latest, state_of
from megatron_multilevel.training.engines import LevelEngines
from megatron_multilevel.training.metrics import METRICS_FILE
from megatron_multilevel.training.schedule import build_phases


def _copy_extra(source: str, target: str) -> None:
    """The files a checkpoint keeps beside DeepSpeed's in a layout-free form (the ODE strategy's
    coherence vector, full tensors): copied as they are."""
    if dist.get_rank() == 0 and os.path.exists(os.path.join(source, COHERENCE_FILE)):
        shutil.copy(os.path.join(source, COHERENCE_FILE), os.path.join(target, COHERENCE_FILE))


def rank_worker(rank, world, config_dict, out, items, tokens):
    """One rank's part of writing checkpoints into the run directory ``out`` in the layout of the
    run config ``config_dict`` (``run_ranks`` runs it on every rank).

    Each of ``items`` (a dict: full ``tensors``, the sidecar's ``state`` and other entries ``meta``,
    the source checkpoint's ``path`` whose layout-free files are copied along, and ``latest``) is
    saved with a fresh optimizer and the learning-rate schedule at its step. The latest is then
    loaded the way the trainer loads it; its logits on ``tokens``, gathered over the vocabulary
    shards, are returned (``None`` without a latest item)."""

    cfg = load_config(config_dict)
    levels = LevelEngines(cfg, world)
    phases = build_phases(cfg)
    logits = None
    for item in items:
        state = state_of({"state": item["state"]})
        phase = phases[state.phase]
        model_cfg = levels.models[phase.level]
        model = levels.build_empty_model(phase.level)
        copy_stream(TensorsReader(item["tensors"], model_cfg), ModelWriter(model, model_cfg, Groups.current()),
                     model_cfg.num_layers)
        engine = levels.engine(model, phase.level, phase.lr.peak, phase.lr_factor)
        engine.lr_scheduler.last_epoch = state.step - 1
        engine.lr_scheduler.step()  # the schedule continues where the run stood
        checkpoint.save(engine, out, state, meta=item["meta"], extra=functools.partial(_copy_extra, item["path"]))
        if item["latest"]:
            fresh = levels.engine(levels.build_empty_model(phase.level), phase.level, phase.lr.peak, phase.lr_factor)
            checkpoint.load(fresh, out, checkpoint.tag_of(state.phase, state.step))
            logits = verify.gathered_logits(fresh.module, model_cfg, tokens)
    return logits


def reshard(src: str, out: str, *, target_tp: int, overwrite: bool = False) -> None:
    found = read_latest(src)
    if found is None:
        raise ValueError(f"{src} is not a run directory with checkpoints (reshard continues a run; "
                         f"a consolidated checkpoint holds no training state)")
    latest_tag, sidecar = found
    config = copy.deepcopy(sidecar["config"])
    config["parallel"] = {**config.get("parallel", {}), "tensor_model_parallel_size": target_tp}
    for level in config.get("multilevel", {}).get("levels", []):
        level["tensor_model_parallel_size"] = None
    if config.get("multilevel", {}).get("ode"):  # the ODE strategy's coarse models too
        config["multilevel"]["ode"]["coarse_tensor_model_parallel_size"] = None
    config.setdefault("training", {})["output_dir"] = os.path.abspath(out)
    try:
        parsed = load_config(config)
    except ValueError as e:
        raise ValueError(f"--target-tp {target_tp}: {e}") from None
    prepare_output(out, overwrite, src)
    state = state_of(sidecar)
    tags = [t for _, t in sorted(state.open_levels.items())] + [latest_tag]
    items = []
    for tag in tags:
        ckpt = open_checkpoint(os.path.join(checkpoint_dir(src), tag))
        tensors = merge_tensor_parallel(rank_state_dicts(ckpt), ckpt.model)
        meta = {k: v for k, v in ckpt.sidecar.items() if k in ("model", "level_maps", "config_phases", "strategy",
                                                                "selection")}
        meta["config"] = config_to_dict(parsed)
        items.append({"tensors": tensors, "state": ckpt.sidecar["state"], "meta": meta, "latest": tag == latest_tag,
                      "model": ckpt.model, "path": ckpt.path})
    latest = items[-1]
    tokens = verify.fixed_tokens(latest["model"])
    step = verify.forward_step(latest["meta"])  # an explicit ODE coarse model's, which the trainer's model takes
    full_logits = verify.logits_full(latest["tensors"], latest["model"], tokens, step=step)
    os.makedirs(out, exist_ok=True)
    payload = [{k: v for k, v in item.items() if k != "model"} for item in items]
    logits = run_ranks(rank_worker, target_tp, config_to_dict(parsed), os.path.abspath(out), payload, tokens,
                       tensor_model_parallel_size=parsed.level_tp_sizes()[0])[0]
    verify.finish_run(out, parsed, [("consolidated (TP=1)", f"resharded, loaded as the trainer does (TP={target_tp})",
                                     full_logits, logits)], "the resharded checkpoint's logits differ")
    if os.path.exists(os.path.join(src, METRICS_FILE)):  # the run's history continues in the new directory
        shutil.copy(os.path.join(src, METRICS_FILE), os.path.join(out, METRICS_FILE))
    print(f"wrote {out}: {len(tags)} checkpoint(s) at TP={target_tp}; continue with\n"
          f"  launch/pretrain_vcycle.sh {os.path.join(out, 'config.json')} --num_gpus {target_tp}")
