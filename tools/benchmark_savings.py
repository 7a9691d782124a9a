"""Savings benchmark: from scratch vs V-cycle (2 and 3 levels) vs progressive stacking.

    python tools/benchmark_savings.py                                  # CPU default (~30 min, 2 cores)
    python tools/benchmark_savings.py --repeats 3                      # alternating order, medians
    python tools/benchmark_savings.py --alpha 0.25 0.5 1.0 --ea 0.05 0.2   # the paper's ablations
    python tools/benchmark_savings.py --extra-shapes depth width           # what to coalesce
    python tools/benchmark_savings.py --size gpt-base --procs 8 --steps 20000 --out runs/savings_gpt_base
    python tools/benchmark_savings.py --size bert-base --procs 8 --steps 60000 --out runs/savings_bert_base

Every method trains on the same data, tokenizer and model shape, within the budget of training
from scratch: the same training FLOPs (default; coarse steps are cheaper, so the other methods
see more tokens) or the same tokens (``--budget tokens``), each run through the real launcher.
Per method it reports the FLOPs and wall-clock seconds (training and transitions) needed to first reach the validation loss training from scratch ends at, the final
validation loss, and the savings against training from scratch (medians and spread over repeats,
each repeat with its own seed and the methods in rotated order). It writes ``results.json``,
``results.md`` and PNG plots of validation loss against FLOPs and wall-clock into ``--out``, and
measures the coarse/fine time per step in one process.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

SIZES = {
    # The pilot's model, on sequences of 64 tokens to fit the CPU budget.
    "cpu": dict(model={"kind": "gpt", "num_layers": 8, "hidden_size": 256, "num_attention_heads": 8,
                       "vocab_size": 4096, "max_sequence_length": 64},
                seq=64, batch=16, steps=480, fine_lr=1e-3),
    "tiny": dict(model={"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                        "vocab_size": 512, "max_sequence_length": 32},
                 seq=32, batch=8, steps=12, fine_lr=2e-3),
    "gpt-base": dict(config="configs/gpt_base_scratch.json", steps=20000, fine_lr=6e-4),
    "bert-base": dict(config="configs/bert_base.json", steps=60000, fine_lr=1e-4),
}


def base_config(args) -> dict:
    size = SIZES[args.size]
    if "config" in size:
        with open(os.path.join(ROOT, size["config"])) as f:
            base = json.load(f)
        base.pop("multilevel", None)
    else:
        base = {
            "train_batch_size": size["batch"],
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": size["fine_lr"], "betas": [0.9, 0.95],
                                                      "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": 0},
            "model": size["model"],
            "data": {"seq_length": size["seq"], "cache_dir": os.path.join(ROOT, ".cache", "megatron_multilevel")},
        }
    if args.data_prefix:
        base.setdefault("data", {}).update(prefix=args.data_prefix, tokenizer_model=args.tokenizer_model)
    steps = args.steps or size["steps"]
    interval = max(1, steps // args.evals)
    base["training"] = {**base.get("training", {}), "log_interval": interval, "eval_interval": interval,
                        "eval_batches": args.eval_batches, "save_interval": 0, "keep_checkpoints": 1}
    return base


def variants(args, base: dict) -> dict[str, dict]:
    from megatron_multilevel.benchmarking import variant_configs

    size = SIZES[args.size]
    steps = args.steps or size["steps"]
    common = dict(steps=steps, coarse_lr_factor=args.coarse_lr_factor, warmup=max(1, steps // 25),
                  after_warmup=max(1, steps // 25), budget=args.budget, perturbation_std=args.perturbation)
    out = {}
    for lr in args.scratch_lr or [size["fine_lr"]]:
        name = "scratch" if not args.scratch_lr or len(args.scratch_lr) == 1 else f"scratch-lr{lr:g}"
        out[name] = variant_configs(base, fine_lr=lr, **common)["scratch"]
    given = dict(fine_lr=size["fine_lr"], ea=args.ea[0], coarse_share=args.coarse_share[0], alpha=args.alpha[0],
                 depth_scaling=args.depth_scaling, shape=args.shape, **common)

    def methods(**change) -> dict[str, dict]:
        """The compared methods with the settings given, but for ``change``."""
        return variant_configs(base, **{**given, **change})

    main = methods()
    for name in ("vcycle2", "vcycle3", "stacking"):
        if name in args.methods:
            out[name] = main[name]
    sweeps = [("alpha", a, dict(alpha=a)) for a in args.alpha[1:]]
    sweeps += [("ea", e, dict(ea=e)) for e in args.ea[1:]]
    sweeps += [("coarse", c, dict(coarse_share=c)) for c in args.coarse_share[1:]]
    for key, value, change in sweeps:
        out[f"vcycle2-{key}{value:g}"] = methods(**change)["vcycle2"]
    if args.paper_variant:  # the paper's settings, beside the ones given
        out["vcycle2-paper"] = methods(ea=0.05, coarse_share=0.5, depth_scaling="none", shape="width+depth")["vcycle2"]
    if args.compare_depth_scaling:
        other = "none" if args.depth_scaling == "ode" else "ode"
        out[f"vcycle2-{other}"] = methods(depth_scaling=other)["vcycle2"]
    for shape in args.extra_shapes:
        if shape != args.shape:
            out[f"vcycle2-{shape}"] = methods(shape=shape)["vcycle2"]
    return out


def launch(config: dict, path: str, procs: int) -> float:
    """Run one config through the launcher (skipped if its summary exists); returns seconds."""
    run_dir = config["training"]["output_dir"]
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return 0.0
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    t0 = time.time()
    cmd = ["bash", os.path.join(ROOT, "launch", "pretrain_vcycle.sh"), path, "--num_procs", str(procs)]
    log = open(os.path.join(os.path.dirname(path), os.path.basename(path) + ".log"), "w")
    result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHON": sys.executable})
    if result.returncode:
        raise SystemExit(f"run {run_dir} failed (exit {result.returncode}); see {log.name}")
    return time.time() - t0


def step_time_ratios(base: dict, *, steps: int = 6) -> dict:
    """Seconds per training step of the fine model and its coarser levels, measured alternately
    in this one process (random tokens, the same batch)."""
    import torch
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_multilevel.config import ModelConfig, coarse_model_config
    from megatron_multilevel.distributed import init_single_process
    from megatron_multilevel.models import build_model, language_model_loss

    init_single_process()
    fine = ModelConfig(**base["model"])
    levels = {"fine": fine, "coarse (width+depth)": coarse_model_config(fine, width=True, depth=True),
              "half depth (stacking)": coarse_model_config(fine, width=False, depth=True)}
    if fine.num_layers % 4 == 0 and fine.num_attention_heads % 4 == 0:
        levels["coarsest of 3 levels"] = coarse_model_config(levels["coarse (width+depth)"], width=True, depth=True)
    seq, batch = base["data"]["seq_length"], base["train_batch_size"]
    tokens = torch.randint(0, fine.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    models = {}
    for name, cfg in levels.items():
        model = build_model(cfg)
        models[name] = (cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = {name: [] for name in models}
    for i in range(steps + 2):
        for name, (cfg, model, opt) in models.items():
            t0 = time.perf_counter()
            loss = language_model_loss(model, cfg, tokens[:, :-1], tokens[:, 1:], torch.ones(batch, seq))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    from megatron_multilevel.training.flops import flops_per_token

    out = {}
    for name, ts in times.items():
        median = sorted(ts)[len(ts) // 2]
        out[name] = {"seconds_per_step": median,
                     "time_ratio": median / sorted(times["fine"])[len(times["fine"]) // 2],
                     "flops_ratio": flops_per_token(levels[name], seq) / flops_per_token(fine, seq)}
    return out


def collect(out_dir: str, names: list[str], repeats: int) -> dict:
    from megatron_multilevel.benchmarking import run_savings, summarize
    from megatron_multilevel.training.metrics import read_metrics

    def records(name, r):
        return read_metrics(os.path.join(out_dir, "runs", f"{name}-r{r}"))

    baseline = "scratch" if "scratch" in names else next(n for n in names if n.startswith("scratch"))
    per_run = {name: [] for name in names}
    for r in range(repeats):
        base = records(baseline, r)
        for name in names:
            rec = records(name, r)
            with open(os.path.join(out_dir, "runs", f"{name}-r{r}", "summary.json")) as f:
                totals = json.load(f)["totals"]
            per_run[name].append({**run_savings(rec, base), "total_flops": totals["flops"],
                                  "total_seconds": totals["wall_seconds"]})
    summary = {}
    for name, runs in per_run.items():
        summary[name] = {key: summarize([run[key] for run in runs]) for key in
                         ("saving_flops", "saving_seconds", "flops_to_target", "seconds_to_target",
                          "final_valid_loss", "total_flops", "total_seconds")}
        summary[name]["repeats"] = runs
    return {"baseline": baseline, "methods": summary}


def _flops(value: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.3g}"


def table(results: dict) -> str:
    def pct(s):
        return "not reached" if s["median"] is None else (
            f"{100 * s['median']:.1f}% ({100 * s['min']:.1f} to {100 * s['max']:.1f})" + (
                f", reached {s['reached']}/{s['n']}" if s["reached"] < s["n"] else ""))

    def num(s, fmt):
        return "n/a" if s["median"] is None else fmt(s["median"])

    lines = ["| method | FLOPs to target | seconds to target | final valid loss | FLOPs saving | wall-clock saving |",
             "|---|---|---|---|---|---|"]
    for name, m in results["methods"].items():
        lines.append(
            f"| {name} | {num(m['flops_to_target'], _flops)} "
            f"| {num(m['seconds_to_target'], lambda v: f'{v:.0f} s')} "
            f"| {num(m['final_valid_loss'], lambda v: f'{v:.4f}')} | {pct(m['saving_flops'])} "
            f"| {pct(m['saving_seconds'])} |")
    return "\n".join(lines)


def plots(out_dir: str, names: list[str], target: float) -> list[str]:
    from megatron_multilevel.plotting import plot_validation
    from megatron_multilevel.training.metrics import read_metrics

    runs = {name: read_metrics(os.path.join(out_dir, "runs", f"{name}-r0")) for name in names}
    return plot_validation(runs, out_dir, target=target)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--steps", type=int, default=None, help="global batches per method (the token budget)")
    p.add_argument("--methods", nargs="+", default=["vcycle2", "vcycle3", "stacking"],
                   choices=["vcycle2", "vcycle3", "stacking"], help="compared with training from scratch")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--procs", type=int, default=1, help="processes per run (GPUs on a GPU node)")
    p.add_argument("--alpha", type=float, nargs="+", default=[0.5], help="first: the main V-cycles; more: a sweep")
    p.add_argument("--ea", type=float, nargs="+", default=[0.05], help="share of steps before coalescing")
    p.add_argument("--coarse-share", "--coarse_share", type=float, nargs="+", default=[0.5],
                   help="share of steps at coarser levels")
    p.add_argument("--coarse-lr-factor", "--coarse_lr_factor", type=float, default=3.0)
    p.add_argument("--budget", choices=["flops", "tokens"], default="flops",
                   help="what every method gets as much of as training from scratch")
    p.add_argument("--depth-scaling", "--depth_scaling", choices=["none", "ode"], default="none",
                   help="depth operators of the V-cycles (and stacking): the paper's, or ODE Euler steps")
    p.add_argument("--shape", choices=["width+depth", "width", "depth"], default="width+depth",
                   help="what the V-cycles coalesce (the paper: width and depth)")
    p.add_argument("--extra-shapes", "--extra_shapes", nargs="*", default=[], choices=["width+depth", "width", "depth"],
                   help="also the 2-level V-cycle coalescing these")
    p.add_argument("--compare-depth-scaling", "--compare_depth_scaling", action="store_true",
                   help="also the 2-level V-cycle with the other depth scaling")
    p.add_argument("--perturbation", type=float, default=0.0, help="multilevel.perturbation_std of the V-cycles")
    p.add_argument("--paper-variant", "--paper_variant", action="store_true",
                   help="also the 2-level V-cycle with the paper's E_a (5%%) and depth operators")
    p.add_argument("--scratch-lr", "--scratch_lr", type=float, nargs="*", default=None,
                   help="tune the baseline: one scratch run per learning rate")
    p.add_argument("--evals", type=int, default=24, help="validation points per run")
    p.add_argument("--eval-batches", "--eval_batches", type=int, default=8)
    p.add_argument("--data-prefix", "--data_prefix", default=None)
    p.add_argument("--tokenizer-model", "--tokenizer_model", default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-step-ratio", "--no_step_ratio", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "savings"))
    args = p.parse_args(argv)
    if bool(args.data_prefix) != bool(args.tokenizer_model):
        p.error("--data-prefix and --tokenizer-model go together")
    from megatron_multilevel.config import load_config

    base = base_config(args)
    configs = variants(args, base)
    for name, cfg in configs.items():
        load_config(cfg)  # every config is checked before anything runs
    os.makedirs(os.path.join(args.out, "configs"), exist_ok=True)
    names = list(configs)
    started = time.time()
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate: alternating order
        for name in order:
            cfg = json.loads(json.dumps(configs[name]))
            cfg["training"]["seed"] = args.seed + r
            cfg["training"]["output_dir"] = os.path.join(args.out, "runs", f"{name}-r{r}")
            seconds = launch(cfg, os.path.join(args.out, "configs", f"{name}-r{r}.json"), args.procs)
            print(f"repeat {r + 1}/{args.repeats}: {name} done in {seconds:.0f} s", flush=True)
    results = collect(args.out, names, args.repeats)
    results["command"] = "python tools/benchmark_savings.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results["benchmark_seconds"] = time.time() - started
    results["config"] = json.loads(json.dumps(base))
    data = results["config"]["data"]
    if data.get("cache_dir", "").startswith(ROOT):  # the repository's own cache: say so, not where it lies
        data["cache_dir"] = os.path.relpath(data["cache_dir"], ROOT)
    if not args.no_step_ratio:
        results["step_time"] = step_time_ratios(base)
    target = results["methods"][results["baseline"]]["repeats"][0]["target_loss"]
    results["plots"] = [os.path.basename(pth) for pth in plots(args.out, names, target)]
    md = table(results)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    if "step_time" in results:
        print("\n| level | s/step | time ratio | FLOPs ratio |\n|---|---|---|---|")
        for name, s in results["step_time"].items():
            print(f"| {name} | {s['seconds_per_step']:.3f} | {s['time_ratio']:.3f} | {s['flops_ratio']:.3f} |")
    print(f"\nresults in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
