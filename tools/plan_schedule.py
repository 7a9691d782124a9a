"""Which schedule to train a GPT with, at its size and token budget, from the committed study points.

    python tools/plan_schedule.py --params 124M --tokens 2.6B          # a size and a budget (or 124e6, 2.6e9)
    python tools/plan_schedule.py --params 222k --tokens 17.8M --layers 16 --bar 0.1   # a depth; another bar
    python tools/plan_schedule.py --config configs/gpt_base.json        # a config's model and budget
    python tools/plan_schedule.py --config configs/gpt_base.json --write /tmp/planned.json  # ... and its schedule
    python tools/plan_schedule.py --validate                           # each point predicted by the others
    python tools/plan_schedule.py --hold-out long-4x64-4700 --params 236928 --tokens 4.8e6  # predict before running

Reads the scale study (``benchmarks/study.json``, with its controls from ``benchmarks/controls.json``)
and the regime study (``benchmarks/regime.json``, its later pins' points ``regime2.json`` and
``regime3.json``), the deep points (``deep*.json``, and ``docs.json`` on a second corpus), all made by
``tools/study_report.py``. The law and the advice are ``megatron_multilevel.study.planner``'s
(benchmarks/JOURNAL.md, "The planner"): the smaller model alone where the study's control found it
sufficient at the budget, training from scratch where the saving's interval does not lie above zero
or where the best candidate's saving is under the bar (``--bar``, 25%), else the multilevel schedule
of the nearest measured point or the growth that saved more there, with the saving the law expects
and its uncertainty. Beyond the measured sizes (more than twice the largest study model, or half the
smallest) it advises nothing: it says what was measured and what the published scaling laws say at
the model's budget, and marks every line it carries over from its points as extrapolated.
Parameters count the embedding.
"""

import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
STUDIES = {"scale": "study.json", "regime": "regime.json", "regime2": "regime2.json", "regime3": "regime3.json",
           "deep": "deep.json", "deep2": "deep2.json", "deep3": "deep3.json", "docs": "docs.json"}
# the text a study's points were trained on, where it is not the embedded default (the standard
# library's source files)
CORPORA = {"docs": "Python 3.11's documentation"}
SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}  # thousand, million, billion, trillion


def parse_count(text: str) -> float:
    """A count as people write one: ``350M``, ``1.3B``, ``20B``, ``125k``, ``2T``, ``1.3e9``, ``124000000``."""
    match = re.fullmatch(r"\s*([0-9_.]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*", text, re.IGNORECASE)
    try:
        value = float(match[1]) * SUFFIXES[match[2].lower()] if match else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not a positive count; give a number with an optional suffix k, M, B or T "
                         "(thousand, million, billion, trillion), e.g. 350M, 1.3B, 125k or 1.3e9")
    return value


def count_argument(text: str) -> float:
    """``parse_count`` as an argparse type: its message as the usage error."""
    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def human(count: float) -> str:
    """``350M``, ``1.3B``, ``237k``: three significant digits and the suffix of ``parse_count``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:.3g}"


def read_points(benchmarks: str) -> list:
    """Every point of the committed studies, as the planner reads it."""
    from megatron_multilevel.study.planner import StudyPoint
    from megatron_multilevel.study.savings import (best_growth, best_late, best_multilevel, control_seeds,
                                                   growth_verdict, with_controls)

    def rows_of(name):
        path = os.path.join(benchmarks, name)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)["points"]

    points = []
    for study, name in STUDIES.items():
        rows = rows_of(name)
        if rows is None:
            continue
        if study == "scale":  # with the controls run later at its points (benchmarks/ctl-*)
            rows = with_controls(rows, rows_of("controls.json") or [])
        for r in rows:
            best, growth = best_multilevel(r), best_growth(r)
            points.append(StudyPoint(
                point=r["point"], study=study, shape=r["shape"], parameters=r["parameters"],
                tokens_per_parameter=r["tokens_per_parameter"], method=best,
                saving=None if best is None else r["methods"][best]["equal_quality"]["median"],
                schedule=None if best is None else r["methods"][best].get("schedule"),
                control_seeds=control_seeds(r), late=best_late(r), growth_run=growth_verdict(r),
                corpus=CORPORA.get(study), seeds=r.get("seeds"),
                growth=None if growth is None else (growth, r["methods"][growth]["equal_quality"]["median"])))
    if not points:
        raise SystemExit(f"plan_schedule: no study in {benchmarks} ({', '.join(STUDIES.values())}): "
                         "run tools/study_report.py first")
    return with_growths_of_later_pins(points)


def with_growths_of_later_pins(points: list) -> list:
    """A shape and budget measured again by a later pin, for a growth method the first pin predates
    (G_stack on 4 x 64 at 81 tokens per parameter, regime3), counts at every point of that shape
    and budget: each point's growth is the best measured at any of them, each saving against its
    own pin's best-tuned scratch, named with the point that measured it."""
    import dataclasses

    def key(pt):
        return pt.shape, round(pt.tokens_per_parameter, 1)

    best = {}  # the shape and budget -> the point that measured the best growth there
    for pt in points:
        if pt.growth is not None and (key(pt) not in best or pt.growth[1] > best[key(pt)].growth[1]):
            best[key(pt)] = pt
    return [pt if key(pt) not in best else
            dataclasses.replace(pt, growth=best[key(pt)].growth, growth_point=best[key(pt)].point)
            for pt in points]


def config_budget(path: str, data_parallel: int = 1) -> dict:
    """A config's ``parameters`` (embedding counted), the ``tokens`` of its run (a multilevel run's
    compute counted in tokens of the full model) and so the from-scratch ``steps`` it is worth, its
    global batch (train_batch_size, else micro batch x accumulation x ``data_parallel``), the peak
    learning rate and warm-up of the run's start, and the ``raw`` config."""
    from megatron_multilevel.config import load_config
    from megatron_multilevel.config.parsing import read_json
    from megatron_multilevel.flops import parameter_count
    from megatron_multilevel.training.schedule import build_phases, fine_equivalent_steps

    raw = read_json(path)
    cfg = load_config(raw)
    if cfg.model.kind != "gpt":
        raise SystemExit(f"plan_schedule: {path} is a {cfg.model.kind} model; the law is fitted to GPT only (on BERT "
                         "the half-depth model alone beat the full one at 0.07, 20 and 81 tokens per parameter: "
                         "benchmarks/JOURNAL.md, 'BERT')")
    ds = cfg.deepspeed
    batch = ds.get("train_batch_size") or (ds.get("train_micro_batch_size_per_gpu", 1)
                                            * ds.get("gradient_accumulation_steps", 1) * data_parallel)
    seq = cfg.data.seq_length
    phases = build_phases(cfg)
    tokens = round(fine_equivalent_steps(cfg, phases) * batch * seq)  # the run's compute in full-model tokens
    return {"parameters": parameter_count(cfg.model), "tokens": tokens, "steps": round(tokens / (batch * seq)),
            "layers": cfg.model.num_layers,
            "peak": phases[0].lr.peak, "warmup": phases[0].lr.warmup_steps, "raw": raw}


def planned_config(budget: dict, schedule: dict, growth: "str | None" = None) -> dict:
    """The config of ``budget`` (:func:`config_budget`) with the recipe's multilevel block at the
    planned coarse share and second visit, for its from-scratch steps, peak rate and warm-up; with
    ``growth`` (a name of ``GROWTHS``), that growth's block instead."""
    from megatron_multilevel.study.variants import GROWTHS, RECIPE, variant_configs

    base = {k: v for k, v in budget["raw"].items() if k != "multilevel"}
    if growth is not None:
        method, settings = growth, {"after_warmup": budget["warmup"], **GROWTHS[growth]["settings"]}
    else:
        method, settings = "fcycle2", {**RECIPE, "coarse_share": round(schedule["coarse_share"], 3)}
        if schedule.get("revisit") is not None:
            settings["fcycle_revisit"] = round(schedule["revisit"], 3)
    made = variant_configs(base, steps=budget["steps"], fine_lr=budget["peak"], warmup=budget["warmup"],
                           methods=[method], **settings)[method]
    training = {k: v for k, v in budget["raw"].get("training", {}).items() if k != "train_steps"}  # the levels' now
    return {**budget["raw"], "training": training, "multilevel": made["multilevel"]}


def growth_name(method: str) -> str:
    """What a growth method of the studies is, as a run of this project makes it (its name where it
    is not one the planner writes)."""
    from megatron_multilevel.study.variants import GROWTHS

    return GROWTHS[method]["about"] if method in GROWTHS else method


def size_of(point: dict) -> str:
    return f"{human(point['parameters'])} parameters at {point['tokens_per_parameter']:.1f} tokens per parameter"


def beyond(result: dict, key: str, fewest: str, most: str, show) -> "str | None":
    """How far ``result[key]`` lies beyond the study points' range of it, or None inside it."""
    times = result["beyond"][key]
    if times <= 1.0:
        return None
    lo, hi = result[f"{key}_range"]
    return (f"{times:.3g} times the {most} ({show(hi)})" if result[key] > hi else
            f"1/{times:.3g} of the {fewest} ({show(lo)})")


def growth_said(v: dict) -> str:
    """What a growth verdict (savings.growth_verdict) says, in words."""
    if v["saving"] is not None:
        return f"saved {100 * v['saving']:.1f}% of the FLOPs at equal quality"
    if v["above_scratch"] > 0:
        return f"ended {v['above_scratch']:.3f} above the best-tuned scratch's final loss: no saving at equal quality"
    return (f"ended {-v['above_scratch']:.3f} under the best-tuned scratch's final loss on its FLOPs, no shorter "
            "budget run: its saving at equal quality not measured")


PUBLISHED = {
    "near compute-optimal": "the full model is near compute-optimal (Hoffmann et al. 2022: about 20 tokens per "
                            "parameter): train it from scratch",
    "larger than compute-optimal": "the model is larger than compute-optimal for its compute: Hoffmann et al. (2022) "
                                   "put the compute-optimal model for the same FLOPs at about {n} parameters on {d} "
                                   "tokens, which reaches a lower loss: a smaller model from scratch, or more tokens",
    "past compute-optimal": "the model is trained past compute-optimal (Hoffmann et al. 2022 would spend the same "
                            "FLOPs on about {n} parameters), as models are for cheaper inference (LLaMA, Touvron et "
                            "al. 2023): train it from scratch",
}
EXTRAPOLATED = "extrapolated, not measured at this size: "


def beyond_measured(result: dict) -> list[str]:
    """The lines that replace the advice beyond the measured sizes: what was measured, and what the
    published scaling laws say at this budget."""
    m, pub = result["measured"], result["published"]
    seeds = "" if m["seeds"] is None else (f", {m['seeds'][0]} seed(s) each" if m["seeds"][0] == m["seeds"][1] else
                                           f", {m['seeds'][0]} to {m['seeds'][1]} seeds each")
    from megatron_multilevel.study.planner import times_beyond

    fewest, most = m["parameters"]
    times = times_beyond(result["parameters"], fewest, most)
    size = (f"{times:.3g} times the largest" if result["parameters"] > most else f"1/{times:.3g} of the smallest")
    law = PUBLISHED[pub["regime"]].format(n=human(pub["compute_optimal_parameters"]),
                                          d=human(pub["compute_optimal_tokens"]))
    return [f"no advice: nothing was measured at this size: the study's {m['points']} points are models of "
            f"{human(fewest)} to {human(most)} parameters at {m['tokens_per_parameter'][0]:.2g} to "
            f"{m['tokens_per_parameter'][1]:.3g} tokens per parameter{seeds}, and this model is {size} (the planner "
            f"advises within {m['size_margin']:g} times the measured sizes)",
            f"published scaling laws: at {pub['tokens_per_parameter']:.3g} tokens per parameter {law}; nothing "
            f"measured here at this size"]


def describe(result: dict) -> str:
    s = result["schedule"]
    lo, hi = result["tokens_per_parameter_range"]
    fewest, most = result["parameters_range"]
    measured = result["within_measured_sizes"]
    lines = [f"model: {human(result['parameters'])} parameters (embedding counted), {human(result['tokens'])} "
             f"tokens: {result['tokens_per_parameter']:.1f} tokens per parameter",
             *([] if measured else beyond_measured(result)),
             ("" if measured else EXTRAPOLATED) + f"expected FLOPs saving of the best multilevel schedule at equal quality: "
             f"{100 * result['saving']:.1f}% +- {100 * result['interval']:.1f} (law fitted to "
             f"{result['fit_points']} study points of {human(fewest)} to {human(most)} parameters and {lo:.2f} to "
             f"{hi:.1f} tokens per parameter)"]
    size = beyond(result, "parameters", "smallest", "largest", lambda n: f"{human(n)} parameters")
    if size:
        carried = ("the law's size term carries the points' saving there" if result["size_term"] else
                   "the law has no size term (the points cannot tell a size's effect from its budget's): its "
                   f"saving is that of models of {human(fewest)} to {human(most)} parameters")
        lines.append(f"  model size beyond the study points: {size}; {carried}: an extrapolation, not a measurement")
    budget = beyond(result, "tokens_per_parameter", "fewest", "most", lambda t: f"{t:.3g}")
    if budget:
        lines.append(f"  tokens per parameter beyond the study points: {budget}: an extrapolation, not a measurement")
    if result.get("layers") and result["beyond"]["layers"] > 1:
        lo_layers, hi_layers = result["layers_range"]
        lines.append(f"  depth beyond the law's points: {result['layers']} layers, its points {lo_layers} to {hi_layers} "
                     "layers: an extrapolation, not a measurement")
    late = result.get("late")
    if late is not None:
        where = (f"at {late['point']} ({late['layers']} layers, {human(late['parameters'])} parameters, "
                 f"{late['tokens_per_parameter']:.0f} tokens per parameter)")
        lines.append(f"late expansion (a one-layer model grown once to full depth, Bu 2026): " + (
            f"{where} its best run ({late['method']}) ended {late['above_scratch']:.3f} above the best-tuned "
            "scratch's final loss: no saving at equal quality; not advised" if late["saving"] is None else
            f"{where} its best run ({late['method']}) saved {100 * late['saving']:.1f}% of the FLOPs at equal quality"))
    for v in result.get("at_depth") or []:
        lines.append(f"growth at {v['layers']} layers, on {v['corpus'] or 'the standard library source files'}: "
                     f"{v['method']} " + growth_said(v) + f" ({v['point']})")
    advice = result["advice"] if measured else result["extrapolated_advice"]
    candidate = result.get("candidate")
    if not measured:
        lines += extrapolated(result)
    elif candidate is not None:
        lines.append(f"advice: train the full model from scratch: the best candidate ({candidate['advice']}, below) is "
                     f"expected to save {100 * candidate['saving']:.1f}% at equal quality by the weakest measurement "
                     f"behind it, under the {100 * result['bar']:.0f}% this planner asks before it advises a schedule "
                     "(--bar sets another)")
    elif advice == "smaller model":
        seeds = result.get("control_seeds")
        lines.append(f"advice: train the smaller (half-depth) model alone: at {result['control']}, with as many "
                     "or more tokens per parameter, it reached the best-tuned full model's final loss on the "
                     "same FLOPs" + ("" if not seeds else f" (in {seeds[0]} of its {seeds[1]} seeds)")
                     + f", a model of {size_of(result['control_size'])}"
                     + "; a multilevel saving there shows only that the full model was not needed yet")
    elif advice == "scratch":
        lines.append("advice: train the full model from scratch: no multilevel schedule is shown to reach its "
                     "loss with fewer FLOPs at this budget (the saving's interval does not lie above zero)")
    cycle = (f"F-cycle, {s['num_levels']} levels, depth only, coarse share {s['coarse_share']:.2f} of the steps, "
             f"E_a {s['ea']:.2f}" + ("" if s.get("revisit") is None else f", second coarse visit {s['revisit']:.2f} "
                                     "of the first") + f" (the best schedule of the nearest measured point, "
             f"{result['from_point']}: {size_of(result['from_point_size'])})")
    growth = result.get("growth")
    # a growth is measured at the nearest point's shape and budget (its own, or a later pin's)
    grown = human(result["from_point_size"]["parameters"])
    shown = candidate["advice"] if candidate is not None else advice
    head = ("candidate" if candidate is not None else "advice" if measured else
            EXTRAPOLATED + "the nearest measured point's best schedule")
    if not measured:
        shown = "growth" if growth is not None else "multilevel"
    if shown == "multilevel":
        lines.append(f"{head}: multilevel: {cycle}")
    elif shown == "growth":
        lines.append(f"{head}: growth: {growth_name(growth['method'])}: at {growth['point']} it saved "
                     f"{100 * growth['saving']:.1f}% of the FLOPs at equal quality on a model of {grown} "
                     f"parameters, more than the best "
                     f"multilevel schedule there ({growth['cycle_method']}, {100 * growth['cycle_saving']:.1f}%); "
                     f"the law above is the cycles'. The multilevel schedule it beat: {cycle}")
    if growth is not None and advice == "smaller model" and measured:
        lines.append(f"  (were the full model trained: {growth_name(growth['method'])} saved "
                     f"{100 * growth['saving']:.1f}% at {growth['point']} ({grown} parameters), the best multilevel "
                     f"schedule {100 * growth['cycle_saving']:.1f}%)")
    return "\n".join(lines)


def extrapolated(result: dict) -> list[str]:
    """Beyond the measured sizes: what the points' own rule says, each line marked as carried over
    from smaller models."""
    said = result["extrapolated_advice"]
    if said == "smaller model":
        seeds = result.get("control_seeds")
        return [EXTRAPOLATED + f"at {result['control']} ({size_of(result['control_size'])}) the smaller "
                "(half-depth) model alone reached the best-tuned full model's final loss on the same FLOPs"
                + ("" if not seeds else f" (in {seeds[0]} of its {seeds[1]} seeds)")]
    if said == "scratch":
        return [EXTRAPOLATED + f"by the points' own rule, the full model from scratch (no schedule shown to reach the "
                               f"{100 * result['bar']:.0f}% bar at this budget)"]
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=count_argument,
                   help="parameters of the full model, embedding counted (350M, 1.3B, 1.3e9, ...)")
    p.add_argument("--tokens", type=count_argument, help="training tokens of the run (20B, 2.6e9, ...)")
    p.add_argument("--layers", type=int, default=None,
                   help="transformer layers of the full model (with --config: its own), for what was measured at "
                        "that depth")
    p.add_argument("--config", help="a GPT config: its model and budget (train_steps x batch x sequence; a "
                                    "multilevel config's compute in tokens of the full model)")
    p.add_argument("--write", help="with --config: write the config with the planned multilevel block here (the "
                                   "advised growth, else the nearest measured point's schedule, also "
                                   "where the advice is not multilevel)")
    p.add_argument("--growth", default=None, help="with --write: write this growth (stacking, gstack, msg) "
                                                  "whatever the advice")
    p.add_argument("--bar", type=float, default=None,
                   help="the FLOPs saving at equal quality (a share: 0.25 is 25%%) a schedule must be expected to "
                        "reach before it is advised (default 0.25; 0: any saving shown)")
    p.add_argument("--data-parallel", "--data_parallel", type=int, default=1,
                   help="with --config and no train_batch_size: the data-parallel size of the global batch")
    p.add_argument("--validate", action="store_true", help="predict each measured point from the others")
    p.add_argument("--hold-out", "--hold_out", default=None, help="fit without this study point")
    p.add_argument("--benchmarks", default=os.path.join(ROOT, "benchmarks"))
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if not args.validate and not args.config and (args.params is None or args.tokens is None):
        p.error("give --params and --tokens, or --config, or --validate")
    if args.write and not args.config:
        p.error("--write goes with --config")
    from megatron_multilevel.study.variants import GROWTHS

    if args.growth is not None and (not args.write or args.growth not in GROWTHS):
        p.error(f"--growth {args.growth!r}: it goes with --write and is one of {sorted(GROWTHS)}")
    from megatron_multilevel.study.planner import BAR, leave_one_out, plan

    if args.bar is not None and not 0 <= args.bar < 1:
        p.error(f"--bar {args.bar}: a share of the FLOPs in [0, 1) (0.25 is 25%)")

    points = read_points(args.benchmarks)
    if args.hold_out:
        if args.hold_out not in {pt.point for pt in points}:
            p.error(f"--hold-out {args.hold_out}: no such study point (points: {', '.join(pt.point for pt in points)})")
        points = [pt for pt in points if pt.point != args.hold_out]
    if args.validate:
        rows = leave_one_out(points)
        print("| held-out point | measured | predicted by the others | error |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['point']} | {100 * r['measured']:.1f}% | {100 * r['predicted']:.1f}% +- "
                  f"{100 * r['interval']:.1f} | {100 * r['error']:+.1f} |")
        print(f"\nroot mean square leave-one-out error: "
              f"{100 * (sum(r['error'] ** 2 for r in rows) / len(rows)) ** 0.5:.1f} points of saving")
        return 0
    budget = None
    if args.config:
        budget = config_budget(args.config, args.data_parallel)
        params, tokens, layers = budget["parameters"], budget["tokens"], budget["layers"]
    else:
        params, tokens, layers = args.params, args.tokens, args.layers
    try:
        result = plan(points, params, tokens, layers, bar=BAR if args.bar is None else args.bar)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result, indent=1) if args.json else describe(result))
    if args.write:  # the growth asked for, else the advised one, else the schedule to train multilevel with
        shown = result["candidate"]["advice"] if result["candidate"] else result["advice"]
        if shown is None:  # beyond the measured sizes: the nearest point's growth, else its schedule
            shown = "growth" if result["growth"] else "multilevel"
        growth = result["growth"]["method"] if shown == "growth" else None
        growth = args.growth or (growth if growth in GROWTHS else None)
        with open(args.write, "w") as f:
            json.dump(planned_config(budget, result["schedule"], growth), f, indent=2)
            f.write("\n")
        advised = result["advice"] in ("multilevel", "growth")
        verdict = (f"the advice above is {result['advice']!r}" if result["advice"] else
                   "no advice at this size, nothing measured there")
        what = (f" ({growth_name(growth)}" if growth else f" (the multilevel schedule of {result['from_point']}") + (
            ")" if advised and (growth or result["advice"] == "multilevel") else
            f", for a run that {'grows' if growth else 'trains multilevel'} anyway: {verdict})")
        print(f"written: {args.write}{what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
