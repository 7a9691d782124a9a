"""GPU validation: the checks that need a device, in one short run, with the figures that matter.

    bash tools/gpu_check.sh              # on one GPU: under 8 minutes
    bash tools/gpu_check.sh --dry-run    # small shapes on the CPU (what CI runs)

1. the environment (torch, CUDA device, Megatron-Core, DeepSpeed, Transformer Engine);
2. the operator and function-preservation tests on the device (NCCL, one process);
3. the max logit difference of a width de-coalescing (coarse model against the de-coalesced fine
   model, which computes the same function) in fp32 and bf16;
4. a short 2-level GPT V-cycle at GPT-Base shape (12 layers, hidden 768, 12 heads, sequences of
   1024) in bf16 through the launcher, with the Transformer Engine layer spec where installed:
   tokens/s and model FLOPs utilisation per level, transition seconds, peak memory;
5. with Transformer Engine: the same V-cycle in FP8 (``model.fp8 = "hybrid"``, each new level's FP8
   scaling state fresh): it trains to the end with finite losses, and each transition's jump on the
   check batch (``training/transition_check.py``) is printed beside the bf16 run's;
6. on two or more GPUs: the same V-cycle over two pipeline stages (Megatron-Core's 1F1B schedule
   under DeepSpeed with NCCL, ZeRO-1, bf16), whose final loss must land within 0.05 of the one-GPU run.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

# Dense bf16 peak of the device for the utilisation figure (H100/H200 SXM: 989 TFLOP/s).
DEFAULT_PEAK_TFLOPS = 989.0

GPU_MODEL = {"kind": "gpt", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 32768,
             "max_sequence_length": 1024}
DRY_MODEL = {"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512,
             "max_sequence_length": 32}


def say(text: str) -> None:
    print(text, flush=True)


def environment() -> dict:
    import importlib.metadata as md

    import torch

    from megatron_multilevel.models import transformer_engine_available

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "megatron-core": md.version("megatron-core"), "deepspeed": md.version("deepspeed"),
            "transformer_engine": transformer_engine_available()}
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    return info


def run_tests(dry_run: bool) -> int:
    """The operator tests on the device (on the CPU the full suite runs in CI instead)."""
    if dry_run:
        say("tests: skipped in a dry run (CI runs the whole suite on the CPU)")
        return 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_operators.py", "tests/test_function_preservation.py"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    say("tests: " + (result.stdout.strip().splitlines() or ["no output"])[-1])
    return result.returncode


def logit_differences(model: dict) -> dict:
    """Max |logits(coarse) - logits(de-coalesced fine)| of a width de-coalescing, fp32 and bf16."""
    import torch

    from megatron_multilevel.config import ModelConfig
    from megatron_multilevel.distributed import init_single_process, set_seed
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.models import build_model, load_parameters, model_logits, parameter_state_dict
    from megatron_multilevel.operators import decoalesce

    init_single_process()
    cfg = ModelConfig(**{**model, "transformer_impl": "local"})
    level_map = make_level_map(cfg, depth=False)
    set_seed(0)
    coarse = parameter_state_dict(build_model(level_map.coarse))
    fine = decoalesce(coarse, level_map)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokens = torch.randint(0, cfg.vocab_size, (2, min(cfg.max_sequence_length, 256)),
                           generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = []
        for c, sd in ((level_map.coarse, coarse), (cfg, fine)):
            net = build_model(c, params_dtype=dtype).to(device=device, dtype=dtype)
            load_parameters(net, {k: v.to(device=device, dtype=dtype) for k, v in sd.items()})
            net.eval()
            with torch.no_grad():
                logits.append(model_logits(net, c, tokens).float())
        name = "fp32" if dtype == torch.float32 else "bf16"
        out[name] = {"max_abs_diff": (logits[0] - logits[1]).abs().max().item(),
                     "max_abs_logit": logits[0].abs().max().item()}
    return out


def vcycle_config(model: dict, out_dir: str, dry_run: bool, parallel: Optional[dict] = None) -> dict:
    steps = (4, 8, 4) if dry_run else (20, 40, 20)
    return {
        "parallel": parallel or {},
        "train_micro_batch_size_per_gpu": 4 if dry_run else 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": dry_run}},
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": not dry_run},
        "model": model,
        "data": {"seq_length": model["max_sequence_length"], "cache_dir": os.path.join(ROOT, ".cache", "megatron_multilevel")},
        "training": {"output_dir": out_dir, "log_interval": 2 if dry_run else 5, "eval_interval": 1000,
                     "eval_batches": 2, "save_interval": 0},
        "multilevel": {"enabled": True, "num_levels": 2, "alpha": 0.5, "levels": [
            {"steps_before": steps[0], "lr_before": {"peak": 6e-4, "warmup_steps": 2},
             "steps_after": steps[2], "lr_after": {"peak": 6e-4, "warmup_steps": 2}},
            {"steps_before": steps[1], "lr_before": {"peak": 1.8e-3}}]},
    }


def vcycle(model: dict, out_dir: str, dry_run: bool, peak_tflops: float, *, procs: int = 1,
           parallel: Optional[dict] = None) -> dict:
    """Run the V-cycle through the launcher on ``procs`` GPUs laid out as ``parallel``; per level:
    tokens/s, utilisation, transitions, memory."""
    from megatron_multilevel.config import load_config
    from megatron_multilevel.flops import flops_per_token
    from megatron_multilevel.records import read_metrics

    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, not a resumed one
    os.makedirs(out_dir)
    cfg = vcycle_config(model, out_dir, dry_run, parallel)
    path = os.path.join(out_dir, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    t0 = time.time()
    result = subprocess.run(["bash", os.path.join(ROOT, "launch", "pretrain_vcycle.sh"), path, "--num_procs", str(procs)],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    if result.returncode:
        say(result.stdout[-3000:] + result.stderr[-3000:])
        raise SystemExit(f"the V-cycle run failed (exit {result.returncode})")
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    parsed = load_config(cfg)
    models = parsed.level_models()
    seq = parsed.data.seq_length
    records = [r for r in read_metrics(out_dir) if r["type"] == "train"]
    rows = []
    for phase in summary["phases"]:
        # the first logged window of a phase holds its warm-up (kernel selection, allocator)
        rates = sorted(r["tokens_per_s"] for r in records if r["phase"] == phase["phase"])[1:] or [0.0]
        rate = rates[len(rates) // 2]
        tflops = rate * flops_per_token(models[phase["level"]], seq) / 1e12
        rows.append({"phase": phase["phase"], "level": phase["level"],
                     "shape": f"{phase['model']['num_layers']}x{phase['model']['hidden_size']}",
                     "tokens_per_s": rate, "tflops": tflops, "mfu": tflops / peak_tflops,
                     "transition_seconds": phase["transition_seconds"],
                     "peak_memory_gib": phase.get("peak_memory_gib")})
    return {"phases": rows, "seconds": time.time() - t0, "final_valid_loss": summary["totals"]["final_valid_loss"]}


def transition_jumps(out_dir: str) -> list[float]:
    from megatron_multilevel.records import read_metrics

    return [r["jump"] for r in read_metrics(out_dir) if r["type"] == "transition"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="small shapes on the CPU, no GPU needed")
    p.add_argument("--peak-tflops", "--peak_tflops", type=float, default=DEFAULT_PEAK_TFLOPS,
                   help="the device's dense bf16 peak, for the utilisation figure")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check"))
    args = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    started = time.time()
    env = environment()
    say("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    if not env["cuda"] and not args.dry_run:
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run")
    model = DRY_MODEL if args.dry_run else GPU_MODEL
    failed = run_tests(args.dry_run)
    diffs = logit_differences(model)
    for name, d in diffs.items():
        say(f"width de-coalescing, {name}: max |logit difference| {d['max_abs_diff']:.3g} "
            f"(logits up to {d['max_abs_logit']:.3g})")
    run = vcycle(model, os.path.join(args.out, "vcycle"), args.dry_run, args.peak_tflops)
    say("| phase | level | shape | tokens/s | TFLOP/s | MFU | transition s | peak memory GiB |")
    say("|---|---|---|---|---|---|---|---|")
    for r in run["phases"]:
        memory = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        say(f"| {r['phase']} | {r['level']} | {r['shape']} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} "
            f"| {100 * r['mfu']:.1f}% | {r['transition_seconds']:.2f} | {memory} |")
    report = {"environment": env, "logit_differences": diffs, "vcycle": run}
    bf16_jumps = transition_jumps(os.path.join(args.out, "vcycle"))
    if env["transformer_engine"] and not args.dry_run:
        fp8 = vcycle({**model, "fp8": "hybrid"}, os.path.join(args.out, "vcycle_fp8"), False, args.peak_tflops)
        fp8_jumps = transition_jumps(os.path.join(args.out, "vcycle_fp8"))
        say(f"fp8 (hybrid) V-cycle: final validation loss {fp8['final_valid_loss']:.4f} (bf16 "
            f"{run['final_valid_loss']:.4f}); transition jumps on the check batch fp8 "
            f"{', '.join(f'{j:+.3g}' for j in fp8_jumps)}, bf16 {', '.join(f'{j:+.3g}' for j in bf16_jumps)}")
        failed = failed or not all(map(lambda v: v == v and abs(v) < 1e9, [fp8["final_valid_loss"], *fp8_jumps]))
        report["vcycle_fp8"] = {**fp8, "jumps": fp8_jumps, "bf16_jumps": bf16_jumps}
    else:
        say("fp8: skipped (it needs Transformer Engine on a GPU)")
    import torch

    if env["cuda"] and not args.dry_run and torch.cuda.device_count() >= 2:
        # the same V-cycle over two pipeline stages (NCCL's send/recv, the tied embedding's two copies)
        piped = vcycle(model, os.path.join(args.out, "vcycle_pp2"), False, args.peak_tflops, procs=2,
                       parallel={"pipeline_model_parallel_size": 2})
        say(f"pipelined (PP 2) V-cycle: final validation loss {piped['final_valid_loss']:.4f} (one GPU "
            f"{run['final_valid_loss']:.4f}); tokens/s per level {[round(r['tokens_per_s']) for r in piped['phases']]}")
        failed = failed or not abs(piped["final_valid_loss"] - run["final_valid_loss"]) < 0.05
        report["vcycle_pp2"] = piped
    else:
        say("pipeline parallelism: skipped (it needs two GPUs)")
    report["seconds"] = time.time() - started
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    say(f"gpu check {'failed' if failed else 'done'} in {report['seconds']:.0f} s; report in {args.out}/gpu_check.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
