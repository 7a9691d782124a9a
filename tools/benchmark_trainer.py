"""Throughput of the trainer against a bare Megatron-Core + DeepSpeed loop, and transition cost.

    python tools/benchmark_trainer.py                      # the tiny CPU GPT, 1 rank
    python tools/benchmark_trainer.py --procs 2 --steps 40
    python tools/benchmark_trainer.py --config configs/gpt_base.json --steps 200   # on a GPU node

In one run, alternating (bare, trainer, bare, trainer, ...), it times the same model, batch,
layout and DeepSpeed config: a bare loop (Megatron GPTModel, deepspeed.initialize, batches read
from the same Megatron dataset, forward/backward/step) and our trainer training from scratch
(eval and checkpoints excluded, as its own counters do). It prints median tokens/s of each with
the spread, their ratio, and, from a short V-cycle of the same config, the share of the run's
time that transitions take.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def bare_loop(cfg, steps: int, warmup: int) -> float:
    """Tokens/s of a plain loop over the same data; collective over all ranks."""
    import deepspeed
    import torch
    from megatron.core import parallel_state as ps

    from megatron_multilevel.data.datasets import build_data, micro_batches, sample_indices
    from megatron_multilevel.distributed import set_tensor_model_parallel_size
    from megatron_multilevel.models import build_model, language_model_loss
    from megatron_multilevel.parallel.mpu import mpu
    from megatron_multilevel.training.engines import LevelEngines

    levels = LevelEngines(cfg, torch.distributed.get_world_size())
    set_tensor_model_parallel_size(levels.tp_sizes[0], seed=cfg.training.seed)
    model = build_model(cfg.model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=levels.ds_config(0, cfg.training.lr.peak), mpu=mpu)
    data = build_data(cfg, train_samples=(steps + warmup) * levels.global_batch, valid_samples=levels.global_batch)
    tokens = levels.global_batch * cfg.data.seq_length
    start = None
    for step in range(steps + warmup):
        if step == warmup:
            start = time.perf_counter()
        for micro in range(levels.accumulation):
            idx = sample_indices(step, micro, global_batch=levels.global_batch, micro_batch=levels.micro_batch(0),
                                 dp_rank=ps.get_data_parallel_rank(), accumulation=levels.accumulation)
            b = micro_batches(data.train, cfg.model.kind, idx)
            loss = language_model_loss(engine, cfg.model, b.tokens, b.labels, b.loss_mask,
                                       padding_mask=b.padding_mask, tokentype_ids=b.tokentype_ids)
            engine.backward(loss)
            engine.step()
        loss.item()  # wait for the step, as the trainer's logging does
    return steps * tokens / (time.perf_counter() - start)


def trainer_run(cfg, out_dir: str) -> dict:
    from megatron_multilevel.training.trainer import Trainer

    cfg.training.output_dir = out_dir
    return Trainer(cfg).run()["totals"]


def worker(rank, world, args, out):
    import copy

    from megatron_multilevel.config import load_config

    base = load_config(args.config)
    scratch = copy.deepcopy(base)
    scratch.multilevel.enabled = False
    scratch.training.train_steps = args.steps + args.warmup
    scratch.training.eval_interval = 10**9
    scratch.training.eval_batches = 1
    scratch.training.save_interval = 0
    scratch.training.log_interval = 10**9
    results = {"bare": [], "trainer": []}
    for r in range(args.repeats):
        results["bare"].append(bare_loop(scratch, args.steps, args.warmup))
        totals = trainer_run(copy.deepcopy(scratch), f"{out}/scratch{r}")
        # the trainer's own count of training seconds: every step, warm-up ones included
        results["trainer"].append(totals["tokens"] / totals["train_seconds"])
    vcycle = copy.deepcopy(base)
    vcycle.training.eval_batches = 1
    vcycle.training.save_interval = 0
    results["vcycle"] = trainer_run(vcycle, f"{out}/vcycle")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_tiny_cpu.json"))
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from megatron_multilevel.config import load_config
    from megatron_multilevel.parallel.spawn import run_ranks

    tp = load_config(args.config).level_tp_sizes()[0]
    with tempfile.TemporaryDirectory() as out:
        try:
            results = run_ranks(worker, args.procs, args, out, tensor_model_parallel_size=tp)[0]
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    bare, ours = results["bare"], results["trainer"]
    spread = lambda xs: f"{statistics.median(xs):,.0f} tok/s (min {min(xs):,.0f}, max {max(xs):,.0f})"  # noqa: E731
    print(f"config {os.path.relpath(args.config, ROOT)}, {args.procs} rank(s), {args.steps} timed steps x {args.repeats} "
          f"repeats, alternating")
    print(f"| loop | tokens/s |\n|---|---|\n| bare Megatron-Core + DeepSpeed | {spread(bare)} |\n| trainer | {spread(ours)} |")
    print(f"trainer / bare: {statistics.median(ours) / statistics.median(bare):.3f}")
    v = results["vcycle"]
    print(f"V-cycle of the same config: transitions {v['transition_seconds']:.2f} s of "
          f"{v['wall_seconds']:.1f} s training + transitions ({v['transition_seconds'] / v['wall_seconds']:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
