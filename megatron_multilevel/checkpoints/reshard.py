"""Reshard a run to another layout (tensor- or pipeline-parallel size, number of ranks, ZeRO stage), so that
training continues there as if nothing had changed.

The latest checkpoint and those a resume still needs (the pre-coalescing checkpoints of coarsened
levels) are consolidated; their optimizer state (Adam's moments and step count, SGD's momentum) is
read in the layout it was written in, each checkpoint loaded the way the trainer loads it and read
as full tensors through the same readers the transitions use. Both are then written again by
DeepSpeed from the target's ranks, laid out as the new config says (its ZeRO stages included),
with the run's position, counters, level maps and learning-rate schedule. The global batch stays
what it was (``train_batch_size``), so the run continues on the same samples. Before reporting
success, each new checkpoint is loaded the way the trainer loads it: its logits are compared with
the consolidated model's and its optimizer state with the source's, which it must equal exactly.
Memory: the consolidation holds full tensors of the weights and the state in one process.
"""

import copy
import functools
import os
import shutil
from typing import Optional

import torch.distributed as dist

from megatron_multilevel.checkpoints import verify
from megatron_multilevel.checkpoints.deepspeed_reader import merge_tensor_parallel, open_checkpoint, rank_state_dicts
from megatron_multilevel.checkpoints.full import prepare_output
from megatron_multilevel.config import RunConfig, config_to_dict, load_config
from megatron_multilevel.parallel.coherence import FILE as COHERENCE_FILE
from megatron_multilevel.parallel.spawn import run_ranks
from megatron_multilevel.parallel.staging import copy_stream, optimizer_step, write_optimizer_state
from megatron_multilevel.parallel.streams import Groups, ModelReader, ModelWriter, TensorsReader, TensorsWriter
from megatron_multilevel.training import checkpoint
from megatron_multilevel.training.checkpoint import checkpoint_dir, read_latest, state_of
from megatron_multilevel.training.engines import LevelEngines
from megatron_multilevel.records import METRICS_FILE
from megatron_multilevel.training.schedule import build_phases


def _copy_extra(source: str, target: str) -> None:
    """The files a checkpoint keeps beside DeepSpeed's in a layout-free form (the ODE strategy's
    coherence vector, full tensors): copied as they are."""
    if dist.get_rank() == 0 and os.path.exists(os.path.join(source, COHERENCE_FILE)):
        shutil.copy(os.path.join(source, COHERENCE_FILE), os.path.join(target, COHERENCE_FILE))


def _engine_at(levels: LevelEngines, phase):
    return levels.engine(levels.build_empty_model(phase.level), phase.level, phase.lr.peak, phase.lr_factor)


def _read_state(engine, model_cfg, keys) -> dict:
    """The optimizer state ``keys`` of a live engine as full tensors (on every rank)."""
    state = {}
    for key in keys:
        collected = TensorsWriter(model_cfg)
        copy_stream(ModelReader(engine.module, model_cfg, Groups.current(), optimizer=engine.optimizer,
                                state_key=key), collected, model_cfg.num_layers)
        state[key] = collected.tensors
    return state


def state_worker(rank, world, config_dict, src, items):
    """One rank's part of reading the optimizer state of checkpoints of the run ``src``, in the
    layout they were written in (``run_ranks`` runs it on every rank of that layout).

    ``items`` are ``(tag, sidecar state)``. Each checkpoint is loaded the way the trainer loads it;
    rank 0 returns, per item, ``{"moments": {key: {name: full tensor}}, "step": n}`` (no moments
    for an optimizer that has not stepped: a fresh one is the same)."""
    cfg = load_config(config_dict)
    levels = LevelEngines(cfg, world)
    phases = build_phases(cfg)
    out = []
    for tag, state in items:
        phase = phases[state_of({"state": state}).phase]
        engine = _engine_at(levels, phase)
        checkpoint.load(engine, src, tag, restore_rng=False)
        step = optimizer_step(engine.optimizer)
        moments = _read_state(engine, levels.models[phase.level], levels.optimizer_state_keys()) if step else {}
        out.append({"moments": moments, "step": step})
    return out if rank == 0 else None


def _state_difference(expected: dict, found: dict) -> float:
    """The largest absolute difference between two optimizer states of the same keys and names."""
    assert expected.keys() == found.keys(), (sorted(expected), sorted(found))
    worst = 0.0
    for key, tensors in expected.items():
        assert tensors.keys() == found[key].keys(), key
        for name, t in tensors.items():
            worst = max(worst, (t.float() - found[key][name].float()).abs().max().item())
    return worst


def rank_worker(rank, world, config_dict, out, items, tokens):
    """One rank's part of writing checkpoints into the run directory ``out`` in the layout of the
    run config ``config_dict`` (``run_ranks`` runs it on every rank).

    Each of ``items`` (a dict: full ``tensors``, the sidecar's ``state`` and other entries ``meta``,
    the source checkpoint's ``path`` whose layout-free files are copied along, ``latest``, and
    optionally the optimizer's full-tensor ``moments`` and ``step``) is saved with that optimizer
    state (a fresh optimizer without one) and the learning-rate schedule at its step. Every
    checkpoint is then loaded the way the trainer loads it. Rank 0 returns ``{"logits": ...}``, the
    latest's logits on ``tokens`` gathered over the vocabulary shards (``None`` without a latest
    item), and ``{"state": {tag: (step, largest difference)}}``, each loaded optimizer state
    against the one given."""

    cfg = load_config(config_dict)
    levels = LevelEngines(cfg, world)
    phases = build_phases(cfg)
    result = {"logits": None, "state": {}}
    for item in items:
        state = state_of({"state": item["state"]})
        phase = phases[state.phase]
        model_cfg = levels.models[phase.level]
        model = levels.build_empty_model(phase.level)
        copy_stream(TensorsReader(item["tensors"], model_cfg), ModelWriter(model, model_cfg, Groups.current()),
                     model_cfg.num_layers)
        engine = levels.engine(model, phase.level, phase.lr.peak, phase.lr_factor)
        moments = item.get("moments") or {}
        if moments:
            write_optimizer_state(engine, model_cfg, {k: TensorsReader(v, model_cfg) for k, v in moments.items()},
                                  item["step"])
        engine.lr_scheduler.last_epoch = state.step - 1
        engine.lr_scheduler.step()  # the schedule continues where the run stood
        checkpoint.save(engine, out, state, meta=item["meta"], extra=functools.partial(_copy_extra, item["path"]))
        tag = checkpoint.tag_of(state.phase, state.step)
        fresh = _engine_at(levels, phase)
        checkpoint.load(fresh, out, tag)
        if moments:
            loaded = _read_state(fresh, model_cfg, tuple(moments))
            result["state"][tag] = (optimizer_step(fresh.optimizer), _state_difference(moments, loaded))
        if item["latest"]:
            result["logits"] = verify.gathered_logits(fresh.module, model_cfg, tokens)
    return result if rank == 0 else None


def target_config(sidecar: dict, out: str, *, target_tp: Optional[int], num_gpus: Optional[int],
                  zero_stage: Optional[int], target_pp: Optional[int] = None) -> tuple[RunConfig, int]:
    """The run config of the resharded run, and its number of ranks: the source's, with every level
    at ``target_tp``, over ``target_pp`` stages (split evenly) and at ZeRO stage ``zero_stage`` where
    given, on ``num_gpus`` ranks (by default the source's number where every level's TP x PP size
    divides it, else the largest of those), with the source's global batch."""
    source = load_config(sidecar["config"])
    config = copy.deepcopy(sidecar["config"])
    if target_pp is not None:
        stages = {"pipeline_model_parallel_size": target_pp, "num_layers_in_first_pipeline_stage": None,
                  "num_layers_in_last_pipeline_stage": None}
        config["parallel"] = {**config.get("parallel", {}), **stages}
        for level in config.get("multilevel", {}).get("levels", []):
            level.update({k: None for k in stages})
    if target_tp is not None:
        config["parallel"] = {**config.get("parallel", {}), "tensor_model_parallel_size": target_tp}
        for level in config.get("multilevel", {}).get("levels", []):
            level["tensor_model_parallel_size"] = None
        if config.get("multilevel", {}).get("ode"):  # the ODE strategy's coarse models too
            config["multilevel"]["ode"]["coarse_tensor_model_parallel_size"] = None
    if zero_stage is not None:
        config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": zero_stage}
        ml = config.get("multilevel", {})
        overrides = [level.get("deepspeed") or {} for level in ml.get("levels") or []]
        overrides.append((ml.get("ode") or {}).get("coarse_deepspeed") or {})
        for ds in overrides:
            (ds.get("zero_optimization") or {}).pop("stage", None)
    # the same samples per step on any number of ranks: the source's global batch, set outright
    config["train_batch_size"] = LevelEngines(source, sidecar["world_size"]).global_batch
    config.pop("train_micro_batch_size_per_gpu", None)
    config.setdefault("training", {})["output_dir"] = os.path.abspath(out)
    what = " ".join(f"--{k} {v}" for k, v in (("target-tp", target_tp), ("target-pp", target_pp),
                                                ("zero-stage", zero_stage)) if v is not None)
    try:
        parsed = load_config(config)
    except ValueError as e:
        raise ValueError(f"{what}: {e}" if what else str(e)) from None
    sizes = [tp * split.size for tp, split in zip(parsed.level_tp_sizes(), parsed.level_pipelines())]
    if num_gpus is None:
        num_gpus = sidecar["world_size"] if all(sidecar["world_size"] % n == 0 for n in sizes) else max(sizes)
    try:
        LevelEngines(parsed, num_gpus)  # every level's TP size and batch fit the ranks
    except ValueError as e:
        raise ValueError(f"--num-gpus {num_gpus}: {e}") from None
    return parsed, num_gpus


def reshard(src: str, out: str, *, target_tp: Optional[int] = None, num_gpus: Optional[int] = None,
            zero_stage: Optional[int] = None, overwrite: bool = False, target_pp: Optional[int] = None) -> None:
    found = read_latest(src)
    if found is None:
        raise ValueError(f"{src} is not a run directory with checkpoints (reshard continues a run; "
                         f"a consolidated checkpoint holds no training state)")
    if num_gpus is not None and num_gpus < 1:
        raise ValueError(f"--num-gpus must be a positive integer, got {num_gpus}")
    latest_tag, sidecar = found
    parsed, world = target_config(sidecar, out, target_tp=target_tp, num_gpus=num_gpus, zero_stage=zero_stage,
                                  target_pp=target_pp)
    config = config_to_dict(parsed)
    prepare_output(out, overwrite, src)
    state = state_of(sidecar)
    tags = [t for _, t in sorted(state.open_levels.items())] + [latest_tag]
    items = []
    for tag in tags:
        ckpt = open_checkpoint(os.path.join(checkpoint_dir(src), tag))
        tensors = merge_tensor_parallel(rank_state_dicts(ckpt), ckpt.model)
        meta = {k: v for k, v in ckpt.sidecar.items() if k in ("model", "level_maps", "config_phases", "strategy",
                                                                "selection")}
        meta["config"] = config
        items.append({"tensors": tensors, "state": ckpt.sidecar["state"], "meta": meta, "latest": tag == latest_tag,
                      "model": ckpt.model, "path": ckpt.path})
    optimizer = run_ranks(state_worker, sidecar["world_size"], sidecar["config"], os.path.abspath(src),
                          [(tag, item["state"]) for tag, item in zip(tags, items)],
                          tensor_model_parallel_size=ckpt.config.level_tp_sizes()[0])[0]  # the latest's: the source's
    for item, read in zip(items, optimizer):
        item.update(read)
    latest = items[-1]
    tokens = verify.fixed_tokens(latest["model"])
    step = verify.forward_step(latest["meta"])  # an explicit ODE coarse model's, which the trainer's model takes
    full_logits = verify.logits_full(latest["tensors"], latest["model"], tokens, step=step)
    os.makedirs(out, exist_ok=True)
    payload = [{k: v for k, v in item.items() if k != "model"} for item in items]
    tp = parsed.level_tp_sizes()[0]
    written = run_ranks(rank_worker, world, config, os.path.abspath(out), payload, tokens,
                        tensor_model_parallel_size=tp)[0]
    pp = parsed.level_pipelines()[0].size
    layout = f"TP={tp}{f', PP={pp}' * (pp > 1)}, {world} rank(s)"
    for tag, item in zip(tags, items):
        if not item["moments"]:
            continue
        step, difference = written["state"][tag]
        if difference != 0.0 or step != item["step"]:
            raise RuntimeError(f"the resharded checkpoint {tag} holds another optimizer state than the source "
                               f"(largest difference {difference:.3g}, step {step} for {item['step']})")
        print(f"{tag}: optimizer state {', '.join(item['moments'])} at step {step}: the source's, exactly")
    verify.finish_run(out, parsed, [("consolidated (TP=1)", f"resharded, loaded as the trainer does ({layout})",
                                     full_logits, written["logits"])], "the resharded checkpoint's logits differ")
    if os.path.exists(os.path.join(src, METRICS_FILE)):  # the run's history continues in the new directory
        shutil.copy(os.path.join(src, METRICS_FILE), os.path.join(out, METRICS_FILE))
    print(f"wrote {out}: {len(tags)} checkpoint(s) at {layout}; continue with\n"
          f"  launch/pretrain_vcycle.sh {os.path.join(out, 'config.json')} --num_gpus {world}")
