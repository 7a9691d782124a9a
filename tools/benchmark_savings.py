"""Savings benchmark: training from scratch against multilevel cycles and progressive stacking.

    python tools/benchmark_savings.py                                   # CPU default, one seed
    python tools/benchmark_savings.py --methods vcycle2 fcycle2 stacking --fractions 0.6 0.8 1.0 \
        --repeats 2 --results benchmarks/cpu-8x256-480                  # equal quality, kept results
    python tools/benchmark_savings.py --recipe --methods fcycle2 stacking --fractions 0.6 0.8 1.0   # the recipe
    python tools/benchmark_savings.py --alpha 0.25 0.5 1.0 --ea 0.05 0.2    # the paper's ablations
    python tools/benchmark_savings.py --extra-shapes depth width            # what to coalesce
    python tools/benchmark_savings.py --methods bert2bert --bert2bert-init aki   # bert2BERT grown by AKI
    python tools/benchmark_savings.py --size gpt-base --procs 8 --steps 20000 --out runs/savings_gpt_base

Every method trains on the same data, tokenizer, model shape and validation samples (every run, at
every budget fraction, reads a prefix of one training sample order: ``--order-samples``), within the
budget of training from scratch: the same training FLOPs (default; coarse steps are cheaper, so
the other methods see more tokens) or the same tokens (``--budget tokens``), each run through the
real launcher. Two measures of the saving, per seed against training from scratch with the same
seed, then medians and spread over seeds:

- **equal quality**: each method also runs with its whole schedule compressed to smaller budget
  fractions (``--fractions``); the smallest fraction whose final validation loss reaches the final
  loss of training from scratch (interpolated between fractions) is the compute it needs;
- **curve crossing**: the FLOPs and seconds at which the full-budget run first reaches that loss.

Wall-clock is reported raw (seconds of training and transitions, indicative on a shared machine)
and normalised: every phase's steps times the time per step of its model shape, measured
alternately in one process. Each finished run leaves a small JSON file under ``--results``/runs
(its curve, totals, config, the code version and commit); a later call, on any machine, reuses
every kept run made by the same code and only runs what is missing, and the report (``results.json``,
``results.md``, PNG plots) is made from the kept files of the current code version only.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
from megatron_multilevel.level_maps import DEPTH_SCALINGS  # noqa: E402
from megatron_multilevel.methods import CYCLE_FAMILIES, NAMES, family  # noqa: E402
from megatron_multilevel.study.late import add_schedule_flags  # noqa: E402
from megatron_multilevel.study.report import collect, shape_name, table  # noqa: E402
from megatron_multilevel.study.runs import reusable, run_result, source_commit, write_json  # noqa: E402
from megatron_multilevel.study.sizes import SIZES, adamw  # noqa: E402

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
            "optimizer": size.get("optimizer") or adamw(size["fine_lr"]),
            "zero_optimization": {"stage": 0},
            "model": size["model"],
            "data": {"seq_length": size["seq"], "cache_dir": os.path.join(ROOT, ".cache", "megatron_multilevel")},
        }
    if args.dropout is not None:  # every run alike, scratch too (the BERT configs' 0.1 breaks width symmetry)
        base["model"] = {**base["model"], "hidden_dropout": args.dropout, "attention_dropout": args.dropout}
    if args.data_prefix:
        base.setdefault("data", {}).update(prefix=args.data_prefix, tokenizer_model=args.tokenizer_model)
    steps = args.steps or size["steps"]
    interval = max(1, steps // args.evals)
    base.setdefault("data", {})["split"] = args.split
    base["training"] = {**base.get("training", {}), "log_interval": interval, "eval_interval": interval,
                        "eval_batches": args.eval_batches, "save_interval": 0, "keep_checkpoints": 1}
    return base


def gstack_share(args, base: dict, steps: int) -> "float | None":
    """``--gstack-share``: a number, None (the coarse share), or ``paper``: G_stack's growth-timing
    rule (``study.variants.gstack_growth_tokens``) for this model and budget, as a share of its tokens."""
    if args.gstack_share is None or (args.gstack_share == "paper" and "gstack" not in args.methods):
        return None
    if args.gstack_share != "paper":
        try:
            return float(args.gstack_share)
        except ValueError:
            raise ValueError(f"--gstack-share takes a share of the steps or 'paper', got {args.gstack_share!r}")
    from megatron_multilevel.config import load_config
    from megatron_multilevel.flops import flops_per_token, parameter_count
    from megatron_multilevel.study.variants import gstack_growth_tokens

    cfg = load_config({**base, "multilevel": {"enabled": False}})
    tokens = steps * base["train_batch_size"] * cfg.data.seq_length
    flops = tokens * flops_per_token(cfg.model, cfg.data.seq_length)
    d = gstack_growth_tokens(parameter_count(cfg.model), flops)
    if d >= tokens:
        raise ValueError(f"--gstack-share paper: G_stack's rule asks for {d:.3g} small-model tokens, more than the "
                         f"budget's {tokens:.3g} (the rule was fitted at 410M-7B parameters); give a share instead")
    return d / tokens


def fine_lr(args) -> float:
    """The full model's peak learning rate of every method: ``--fine-lr``, else the size's."""
    return args.fine_lr or SIZES[args.size]["fine_lr"]


def variants(args, base: dict) -> dict[str, dict]:
    from megatron_multilevel.study.late import (bu_configs, late_configs, mup_suffix, with_depth_mup,
                                                with_optimizer, with_schedule)
    from megatron_multilevel.study.variants import variant_configs

    size = SIZES[args.size]
    base = with_optimizer(base, args.optimizer, fine_lr(args), args.muon_adam_lr)
    steps = args.steps or size["steps"]
    after_warmup = max(1, steps // 25) if args.after_warmup is None else args.after_warmup
    common = dict(steps=steps, coarse_lr_factor=args.coarse_lr_factor, warmup=max(1, steps // 25),
                  after_warmup=after_warmup, budget=args.budget, perturbation_std=args.perturbation)
    out = {}
    for lr, decay, shape in itertools.product(args.scratch_lr or [fine_lr(args)], args.scratch_decay_fraction,
                                              args.scratch_decay):
            # the size's own rate is plain "scratch" (every earlier result's name), any other is named
            # (also under --fine-lr: one name, one config, whatever the other methods' rate); so is
            # a decay over the last part of the steps only (warm-up, stable, decay)
            other = args.scratch_optimizer == "adamw" and "optimizer" in size  # a size of SGD trained by AdamW
            muon = "-muon" * (args.optimizer == "muon")
            name = ("scratch" if lr == size["fine_lr"] and not other and not muon
                    else f"scratch{'-adamw' * other}{muon}-lr{lr:g}")
            name += ("" if decay == 1.0 else f"-wsd{decay:g}") + ("" if shape == "cosine" else f"-{shape}")
            out[name] = variant_configs({**base, "optimizer": adamw(lr)} if other else base, fine_lr=lr, methods=[],
                                        **common)["scratch"]
            out[name]["training"]["lr"]["decay_fraction"] = decay
            if shape != "cosine":
                out[name]["training"]["lr"]["decay"] = shape
            out[name] = with_schedule(out[name], min_ratio=args.min_ratio)
    given = dict(fine_lr=fine_lr(args), ea=args.ea[0], coarse_share=args.coarse_share[0], alpha=args.alpha[0],
                 depth_scaling=args.depth_scaling, shape=args.shape, depth_pairing=args.depth_pairing,
                 fcycle_revisit=args.fcycle_revisit, optimizer_state=args.optimizer_state,
                 after_lr_factor=args.after_lr_factor, ode=ode_overrides(args.ode), lr_schedule=args.lr_schedule,
                 interpolation=args.interpolation, gstack_factor=args.gstack_factor,
                 gstack_share=gstack_share(args, base, steps), msg_mask_share=args.msg_mask_share,
                 ligo_share=args.ligo_share, bert2bert_init=args.bert2bert_init,
                 methods=[m for m in METHODS if m != "ode2" or m in args.methods], **common)

    def methods(**change) -> dict[str, dict]:
        """The compared methods with the settings given, but for ``change``."""
        return variant_configs(base, **{**given, **change})

    main = methods()
    if {"late", "source"} & set(args.methods):
        main.update(late_configs(main["scratch"], steps=steps, fine_lr=fine_lr(args), warmup=common["warmup"],
                                 share=args.late_share, layers=args.late_layers, init=args.late_init,
                                 optimizer_state=args.optimizer_state, grown_moments=args.grown_moments or "zero",
                                 lr_schedule=args.lr_schedule, after_warmup=after_warmup, budget=args.budget))
    if "bu" in args.methods:  # Bu's recipe, and scratch under its optimizer and schedule at its rate
        made = bu_configs(main["scratch"], steps=steps, lr=fine_lr(args), adam_lr=args.muon_adam_lr,
                          share=args.late_share, init=args.late_init, decay=args.decay or "1-sqrt")
        main["bu"] = made["bu"]
        out[f"scratch-bu-lr{fine_lr(args):g}"] = made["scratch"]
    for name in args.methods:
        # bert2bert grown by AKI is named apart from the FPI runs (results of both can share --results)
        out[name + "-aki" if name == "bert2bert" and args.bert2bert_init == "aki" else name] = main[name]
    cycles = [name for name in args.methods if family(name) in CYCLE_FAMILIES] or ["vcycle2"]
    sweeps = [("alpha", a, dict(alpha=a)) for a in args.alpha[1:]]
    sweeps += [("ea", e, dict(ea=e)) for e in args.ea[1:]]
    sweeps += [("coarse", c, dict(coarse_share=c)) for c in args.coarse_share[1:]]
    for key, value, change in sweeps:
        out[f"{cycles[0]}-{key}{value:g}"] = methods(**change)[cycles[0]]
    if args.paper_variant:  # the paper's settings, beside the ones given
        out["vcycle2-paper"] = methods(ea=0.05, coarse_share=0.5, depth_scaling="none", shape="width+depth",
                                       depth_pairing="adjacent")["vcycle2"]
    if args.compare_depth_scaling:
        for other in DEPTH_SCALINGS:
            if other != args.depth_scaling:
                out[f"{cycles[0]}-{other}"] = methods(depth_scaling=other)[cycles[0]]
    for shape in args.extra_shapes:
        if shape != args.shape:
            for name in cycles:
                out[f"{name}-{shape}"] = methods(shape=shape)[name]
    # every method's schedule as the flags say (warmup-stable-decay: --decay-fraction below 1)
    out = {name: cfg if name.startswith(("scratch", "bu")) else with_schedule(
        cfg, decay=args.decay, decay_fraction=args.decay_fraction, min_ratio=args.min_ratio,
        grown_moments=args.grown_moments) for name, cfg in out.items()}
    out = {name + mup_suffix(args) * name.startswith("scratch"): with_depth_mup(cfg, args.depth_mup, args.depth_mup_base)
           for name, cfg in out.items()}
    # a tag names the settings, so that variants of one method can share a results directory
    return {name if name.startswith("scratch") else name + args.tag: cfg for name, cfg in out.items()}


def recipe_defaults(p: argparse.ArgumentParser) -> dict:
    """The recipe (``study.variants.RECIPE``) as defaults of ``p``'s flags (a flag that takes a
    sweep, a list, gets the recipe's value as its only, the method's, value)."""
    from megatron_multilevel.study.variants import RECIPE

    return {"methods": ["fcycle2"],
            **{k: [v] if isinstance(p.get_default(k), list) else v for k, v in RECIPE.items()}}


def ode_overrides(pairs: list[str]) -> dict:
    """``--ode KEY=VALUE ...`` as a dict of JSON values (a bare word is a string)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--ode takes KEY=VALUE pairs, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def launch(config: dict, path: str, procs: int) -> float:
    """Run one config through the launcher (a killed run resumes from its checkpoints); returns seconds."""
    run_dir = config["training"]["output_dir"]
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    t0 = time.time()
    cmd = ["bash", os.path.join(ROOT, "launch", "pretrain_vcycle.sh"), path, "--num_procs", str(procs)]
    with open(path + ".log", "a") as log:
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHON": sys.executable})
    if result.returncode:
        raise SystemExit(f"run {run_dir} failed (exit {result.returncode}); see {path}.log")
    return time.time() - t0


def step_times(configs: dict[str, dict], *, steps: int = 12) -> dict:
    """Seconds per training step of every model shape the configs train, measured alternately in
    this one process on the same batch (runs made one after another on a shared machine are not
    comparable in seconds; these per-step times are). The fastest of ``steps`` repeats counts:
    other load on the machine only ever adds time."""
    import torch
    import warnings

    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():  # as the launcher does: DeepSpeed told, not warning that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_multilevel.config import load_config
    from megatron_multilevel.distributed import init_single_process
    from megatron_multilevel.models import build_model, language_model_loss
    from megatron_multilevel.flops import flops_per_token

    init_single_process()
    shapes = {}
    for cfg in configs.values():
        for model in load_config(cfg).level_models():
            shapes.setdefault(f"{model.num_layers}x{model.hidden_size}", model)
    fine = load_config(next(iter(configs.values()))).model
    any_cfg = next(iter(configs.values()))
    seq, batch = any_cfg["data"]["seq_length"], any_cfg["train_batch_size"]
    tokens = torch.randint(0, fine.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    models = {}
    for name, cfg in shapes.items():
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
    fine_name = f"{fine.num_layers}x{fine.hidden_size}"
    best = {name: min(ts) for name, ts in times.items()}
    return {name: {"seconds_per_step": best[name], "time_ratio": best[name] / best[fine_name],
                   "flops_ratio": flops_per_token(shapes[name], seq) / flops_per_token(fine, seq)}
            for name in shapes}


def kept_step_times(path: str, version: str, results: list[dict], measure=step_times) -> dict:
    """The per-step times of every shape the kept ``results`` train: those kept in ``path`` when made
    by this code version and covering every such shape, else all measured again (``measure``) and kept."""
    times = None
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
        times = kept["times"] if kept["version"] == version else None
    shapes = {shape_name(p["model"]) for r in results for p in r["phases"]}
    if times is None or not shapes <= set(times):
        # every shape measured again, together, when a method added since trains a shape the kept
        # times lack: per-step times are comparable only when measured in one process
        times = measure({name: json.loads(json.dumps(r["config"])) for name, r in
                         {r["method"]: r for r in results}.items()})
        write_json(path, {"version": version, "times": times})
    return times


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--steps", type=int, default=None, help="global batches of training from scratch (the budget)")
    p.add_argument("--methods", nargs="*", default=["vcycle2", "vcycle3", "stacking"], choices=METHODS,
                   help="compared with training from scratch (given with none: training from scratch only, a sweep "
                        "of its rates)")
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0],
                   help="budget fractions each compared method runs at, its whole schedule compressed to each "
                        "(the equal-quality measure); training from scratch runs at 1.0")
    p.add_argument("--repeats", type=int, default=1, help="seeds: --seed, --seed + 1, ...")
    p.add_argument("--procs", type=int, default=1, help="processes per run (GPUs on a GPU node)")
    p.add_argument("--alpha", type=float, nargs="+", default=[0.5], help="first: the main cycles; more: a sweep")
    p.add_argument("--ea", type=float, nargs="+", default=[0.05], help="share of steps before coalescing")
    p.add_argument("--coarse-share", "--coarse_share", type=float, nargs="+", default=[0.5],
                   help="share of steps at coarser levels")
    p.add_argument("--coarse-lr-factor", "--coarse_lr_factor", type=float, default=None,
                   help="the cycles' coarse peak learning rate over the fine one (default: 3 where the "
                        "coarse model is narrower, 1 where it is only shallower)")
    p.add_argument("--fcycle-revisit", "--fcycle_revisit", type=float, default=0.25,
                   help="F-cycle: steps of the second coarse visit, as a share of the first")
    p.add_argument("--optimizer-state", "--optimizer_state", choices=["reset", "map"], default="reset",
                   help="AdamW at the cycles' transitions: restarted (the paper) or its moments mapped")
    p.add_argument("--after-warmup", "--after_warmup", type=int, default=None,
                   help="warm-up steps of the fine level after a return (default: 4%% of the steps)")
    p.add_argument("--after-lr-factor", "--after_lr_factor", type=float, default=1.0,
                   help="the fine level's peak learning rate after a return, times the fine rate")
    p.add_argument("--interpolation", choices=["blend", "correction"], default="blend",
                   help="how the cycles return to a finer level: blend with the model before coalescing "
                        "(the paper) or add the coarse change to it (multigrid's coarse correction)")
    p.add_argument("--lr-schedule", "--lr_schedule", choices=["restart", "continue"], default="restart",
                   help="learning rate over the phases of every method but scratch: restarted at every phase "
                        "(the paper) or one schedule over the whole run (multilevel.lr_schedule)")
    p.add_argument("--budget", choices=["flops", "tokens"], default="flops",
                   help="what every method gets as much of as training from scratch")
    p.add_argument("--depth-scaling", "--depth_scaling", choices=DEPTH_SCALINGS, default="none",
                   help="depth operators of the cycles (and stacking): the paper's, ODE Euler steps, or ODE with function-preserving growth (identity)")
    p.add_argument("--depth-pairing", "--depth_pairing", choices=["adjacent", "halves"], default="adjacent",
                   help="which fine layers a coarse layer stands for (halves: what stacking does)")
    p.add_argument("--shape", choices=["width+depth", "width", "depth"], default="width+depth",
                   help="what the cycles coalesce (the paper: width and depth)")
    p.add_argument("--extra-shapes", "--extra_shapes", nargs="*", default=[], choices=["width+depth", "width", "depth"],
                   help="also every chosen cycle coalescing these")
    p.add_argument("--compare-depth-scaling", "--compare_depth_scaling", action="store_true",
                   help="also the first chosen cycle with each other depth scaling")
    p.add_argument("--ode", nargs="*", default=[], metavar="KEY=VALUE",
                   help="ode2: keys of its multilevel.ode block, e.g. coherence=none cycles=8 optimizer_state=map")
    p.add_argument("--perturbation", type=float, default=0.0, help="multilevel.perturbation_std of the cycles")
    p.add_argument("--ligo-share", "--ligo_share", type=float, default=0.01,
                   help="ligo: share of the steps its depth operator trains (each a full model's step)")
    p.add_argument("--msg-mask-share", "--msg_mask_share", type=float, default=0.05,
                   help="msg: share of the steps over which the stacked layers are masked in (MSG's growth "
                        "time; default 0.05)")
    p.add_argument("--gstack-factor", "--gstack_factor", type=int, choices=[2, 4], default=4,
                   help="gstack: how many times the small model is stacked (the paper: 4)")
    p.add_argument("--gstack-share", "--gstack_share", default=None,
                   help="gstack: share of the steps for the small model (default: --coarse-share), or 'paper': "
                        "G_stack's growth-timing rule for this model and budget")
    p.add_argument("--bert2bert-init", "--bert2bert_init", choices=["fpi", "aki"], default="fpi",
                   help="bert2bert: its width growth, function-preserving (fpi) or the advanced knowledge "
                        "initialisation, new units from the layer above (aki: runs named bert2bert-aki)")
    p.add_argument("--paper-variant", "--paper_variant", action="store_true", help="also the 2-level V-cycle with "
                   "the paper's E_a (5%%) and depth operators")
    p.add_argument("--scratch-lr", "--scratch_lr", type=float, nargs="*", default=None,
                   help="tune the baseline: one scratch run per peak learning rate (the best is the baseline)")
    p.add_argument("--scratch-decay-fraction", "--scratch_decay_fraction", type=float, nargs="+", default=[1.0],
                   help="training from scratch with its decay over this share of the steps after warm-up, the peak "
                        "held before it (warm-up, stable, decay); several: each is run, the best is the baseline")
    add_schedule_flags(p)
    p.add_argument("--scratch-optimizer", "--scratch_optimizer", choices=["size", "adamw"], default="size",
                   help="training from scratch with the size's optimizer, or with AdamW at the --scratch-lr rates "
                        "(a size of SGD: both candidates for the best baseline)")
    p.add_argument("--fine-lr", "--fine_lr", type=float, default=None,
                   help="the full model's peak learning rate of every method (default: the size's)")
    p.add_argument("--evals", type=int, default=12, help="validation points per run")
    p.add_argument("--eval-batches", "--eval_batches", type=int, default=32)
    p.add_argument("--split", default="95,5,0", help="data.split of every run")
    p.add_argument("--order-samples", "--order_samples", type=int, default=None,
                   help="data.order_samples of every run, which all read prefixes of one sample order (default: the "
                        "kept runs' value, else the training samples of the longest run at the full budget)")
    p.add_argument("--data-prefix", "--data_prefix", default=None)
    p.add_argument("--tokenizer-model", "--tokenizer_model", default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--results", default=None,
                   help="where the small per-run result files are kept (commit them; a later call reuses "
                        "every run already there made by the same code); default: --out")
    p.add_argument("--report-only", "--report_only", action="store_true",
                   help="run nothing: remake the report from the kept results of the current code version")
    p.add_argument("--recipe", action="store_true", help="the recipe's settings (README, 'The recipe') as defaults, "
                   "and fcycle2 as the method; flags given beside it override them")
    p.add_argument("--tag", default="", help="appended to every method's name but scratch's: variants share --results")
    p.add_argument("--dropout", type=float, default=None, help="model.hidden_dropout and attention_dropout, every run")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "savings"), help="run directories and the report")
    return p


def parse_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.recipe:
        p.set_defaults(**recipe_defaults(p))
        args = p.parse_args(argv)
    if bool(args.data_prefix) != bool(args.tokenizer_model):
        p.error("--data-prefix and --tokenizer-model go together")
    if not all(0.0 < f <= 1.0 for f in args.scratch_decay_fraction):
        p.error(f"--scratch-decay-fraction: each must be in (0, 1], got {args.scratch_decay_fraction}")
    return args


def main(argv=None) -> int:
    p = build_parser()
    args = parse_args(p, argv)
    from megatron_multilevel.config import load_config
    from megatron_multilevel.study.runs import kept_runs, source_version, table_order
    from megatron_multilevel.study.variants import compress

    base = base_config(args)
    try:
        configs = variants(args, base)
    except ValueError as e:  # a schedule that does not fit the budget, a bad --ode pair
        p.error(str(e))
    for name, cfg in configs.items():
        for fraction in args.fractions:
            load_config(compress(cfg, fraction))  # every config is checked before anything runs
    version = source_version(ROOT)
    results_dir = os.path.join(args.results or args.out, "runs")
    os.makedirs(results_dir, exist_ok=True)
    if not args.report_only:  # one sample order for the table: every run, every fraction, reads a prefix of it
        try:
            order = table_order(configs, kept_runs(results_dir, version)[0], args.order_samples, where=results_dir)
        except ValueError as e:
            p.error(str(e))
        for cfg in [base, *configs.values()]:
            cfg.setdefault("data", {})["order_samples"] = order
    work = os.path.join(args.out, "work", version)
    os.makedirs(work, exist_ok=True)
    names = list(configs)
    started = time.time()
    for r in range(0 if args.report_only else args.repeats):
        seed = args.seed + r
        order = names[r % len(names):] + names[: r % len(names)]  # rotate: alternating order
        for name in order:
            for fraction in ([1.0] if name.startswith("scratch") else sorted(args.fractions, reverse=True)):
                run = f"{name}-f{fraction:g}-s{seed}"
                cfg = compress(configs[name], fraction)
                cfg["training"]["seed"] = seed
                cfg["training"]["output_dir"] = os.path.join(work, run)
                kept = os.path.join(results_dir, run + ".json")
                if reusable(kept, version, cfg):
                    continue
                seconds = launch(cfg, os.path.join(work, run + ".json"), args.procs)
                result = run_result(cfg["training"]["output_dir"], method=name, fraction=fraction, seed=seed,
                                    version=version, commit=source_commit(ROOT), config=cfg)
                data = result["config"].get("data", {})
                if "cache_dir" in data:  # a place, not a setting: recorded where it lies in the repository
                    data["cache_dir"] = repo_relative(data["cache_dir"])
                write_json(kept, result)
                print(f"seed {seed}: {run} done in {seconds:.0f} s, final validation loss "
                      f"{result['totals']['final_valid_loss']:.4f}", flush=True)
    report(args, base, names, version, results_dir, started, argv)
    return 0


METHODS = [name for name in NAMES if name != "scratch"]


def repo_relative(arg: str) -> str:
    """A path (or ``--flag=path``) in the repository, relative to it, so that kept records travel:
    relative to this checkout, or to the one whose study worktree this is (``benchmarks/run_study.sh``
    runs a pinned commit from ``<checkout>/.cache/study-<commit>``). Anything else is left as it is."""
    head, eq, path = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    if not eq:
        head, path = "", arg
    common = subprocess.run(["git", "rev-parse", "--git-common-dir"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    for root in [ROOT] + ([os.path.dirname(os.path.abspath(os.path.join(ROOT, common)))] if common else []):
        if os.path.isabs(path) and (path == root or path.startswith(root + os.sep)):
            return head + eq + os.path.relpath(path, root)
    return arg


def report(args, base: dict, names: list[str], version: str, results_dir: str, started: float, argv) -> dict:
    """Tables, plots and ``results.json`` from the kept results of this code version."""
    from megatron_multilevel.study.plotting import plot_kept_runs
    from megatron_multilevel.study.runs import kept_runs

    kept, others = kept_runs(results_dir, version)
    order = {name: i for i, name in enumerate(names)}
    results = sorted(kept, key=lambda r: order.get(r["method"], len(order)))
    if others:
        print(f"note: results of other code versions {others} in {results_dir} are left out", flush=True)
    if not results:
        print(f"no kept results of this code version ({version}) in {results_dir}: nothing to report", flush=True)
        return {}
    times = kept_step_times(os.path.join(args.results or args.out, "step_time.json"), version, results)
    summary = collect(results, times)
    command = argv if argv is not None else sys.argv[1:]
    summary.update(command=" ".join(["python tools/benchmark_savings.py"] + [repo_relative(a) for a in command]),
                   version=version, commits=sorted({r["commit"] for r in results}),
                   benchmark_seconds=time.time() - started, step_time=times, config=json.loads(json.dumps(base)))
    data = summary["config"]["data"]
    if data.get("cache_dir", "").startswith(ROOT):  # the repository's own cache: say so, not where it lies
        data["cache_dir"] = os.path.relpath(data["cache_dir"], ROOT)
    out_dir = args.results or args.out
    target = summary["methods"][summary["baseline"]]["seeds"][0]["target_loss"]
    summary["plots"] = [os.path.basename(pth) for pth in plot_kept_runs(out_dir, results, target)]
    md = table(summary)
    write_json(os.path.join(out_dir, "results.json"), summary)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    print("\n| shape | s/step | time ratio | FLOPs ratio |\n|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t['seconds_per_step']:.3f} | {t['time_ratio']:.3f} | {t['flops_ratio']:.3f} |")
    print(f"\nresults in {out_dir}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
