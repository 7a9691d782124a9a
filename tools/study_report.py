"""A study's report: every point's savings side by side, the regime of each point, and the saving
against the budget per method.

    python tools/study_report.py                  # the scale study: benchmarks/cpu-*, writes benchmarks/study.*
    python tools/study_report.py --study regime   # the regime study: benchmarks/long-*, writes benchmarks/regime.*
    python tools/study_report.py --study regime2  # its second pin's points: benchmarks/long2-*, regime2.*
    python tools/study_report.py --study regime3  # its third pin's points: benchmarks/long3-*, regime3.*
    python tools/study_report.py --study controls # the scale study's controls: benchmarks/ctl-*, controls.*
    python tools/study_report.py --study deep3    # 16 layers at 80 tokens per parameter: deep3-*, deep3.*
    python tools/study_report.py --study docs     # the same on a second corpus: docs-*, docs.*
    python tools/study_report.py --point bert-4x64-4700   # one point's rows and where its lead is made

A point of the scale study is a directory ``cpu-<layers>x<hidden>-<steps>`` of ``benchmarks/``
(``run_study.sh --list``), one of the regime study ``long-<layers>x<hidden>-<steps>``, one of the
scale study's controls (the smaller model alone, and scratch) ``ctl-<layers>x<hidden>-<steps>``; a point
counts when its ``results.json`` was made by the study's pinned code (``benchmarks/STUDY_COMMIT``
for the scale study, each point's own ``STUDY_COMMIT`` for the others, one commit for all);
the others are named and left out, so that the table never mixes code versions. Writes
``<study>.md`` (one row per point and method, then each multilevel method's lead over the point's
baseline, the best-tuned training from scratch, at equal FLOPs at the end of each phase, from the
point's full-budget run files), ``<study>.json`` and a plot of the saving against the budget.
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# study -> (its points' directories, what its files are called)
STUDIES = {"scale": (re.compile(r"^cpu-(\d+)x(\d+)-(\d+)$"), "study"),
           "regime": (re.compile(r"^long-(\d+)x(\d+)-(\d+)$"), "regime"),
           # the regime study's second size at 80 tokens per parameter, made by a later pin
           "regime2": (re.compile(r"^long2-(\d+)x(\d+)-(\d+)$"), "regime2"),
           # the regime study's longest point again, for a growth its pin predates (G_stack)
           "regime3": (re.compile(r"^long3-(\d+)x(\d+)-(\d+)$"), "regime3"),
           # the scale study's points again, with the smaller-model control it lacked
           "controls": (re.compile(r"^ctl-(\d+)x(\d+)-(\d+)$"), "controls"),
           # a 16-layer GPT at 80 tokens per parameter: the late expansion under WSD, each pin its own
           "deep": (re.compile(r"^deep-(\d+)x(\d+)-(\d+)$"), "deep"),
           "deep2": (re.compile(r"^deep2-(\d+)x(\d+)-(\d+)$"), "deep2"),
           "deep3": (re.compile(r"^deep3-(\d+)x(\d+)-(\d+)$"), "deep3"),
           # deep3's best method and baseline on a second corpus (Python 3.11's documentation)
           "docs": (re.compile(r"^docs-(\d+)x(\d+)-(\d+)$"), "docs")}


def study_commit(benchmarks: str, study: str) -> str:
    """The commit whose code makes the runs of ``study``: the scale study's pin
    (``benchmarks/STUDY_COMMIT``), else the one pin all the study's points share."""
    pattern, _ = STUDIES[study]
    if study == "scale":
        files = [os.path.join(benchmarks, "STUDY_COMMIT")]
    else:
        files = [os.path.join(benchmarks, name, "STUDY_COMMIT") for name in sorted(os.listdir(benchmarks))
                 if pattern.match(name) and os.path.isfile(os.path.join(benchmarks, name, "STUDY_COMMIT"))]
    if not files or not all(os.path.isfile(path) for path in files):
        raise SystemExit(f"study_report: no STUDY_COMMIT for the {study} study in {benchmarks}: it names the "
                         "commit the study's runs are made by")
    pins = set()
    for path in files:
        with open(path) as f:
            pins.add(f.read().strip())
    if len(pins) > 1:
        raise SystemExit(f"study_report: the {study} study's points are pinned to several commits {sorted(pins)}: "
                         "one table, one code version")
    return pins.pop()


def read_points(benchmarks: str, commit: str, pattern=STUDIES["scale"][0]) -> tuple[dict[str, dict], list[str]]:
    """The points made by ``commit`` (each results.json with its ``steps``), and notes on the others."""
    points, notes = {}, []
    for name in sorted(os.listdir(benchmarks)):
        match = pattern.match(name)
        path = os.path.join(benchmarks, name, "results.json")
        if not match or not os.path.isfile(path):
            continue
        with open(path) as f:
            results = json.load(f)
        if results.get("commits") != [commit]:
            notes.append(f"{name}: made by {results.get('commits')}, not the study's {commit[:12]}: left out")
            continue
        points[name] = {**results, "steps": int(match.group(3))}
    return points, notes


def parameter_counts(points: dict[str, dict]) -> dict[str, int]:
    """The fine model's parameters by shape, counted on the Megatron-Core model itself."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_multilevel.config import load_config
    from megatron_multilevel.distributed import init_single_process
    from megatron_multilevel.models import build_model

    init_single_process()
    counts = {}
    for results in points.values():
        cfg = load_config(results["config"]).model
        shape = f"{cfg.num_layers}x{cfg.hidden_size}"
        if shape not in counts:
            counts[shape] = sum(p.numel() for p in build_model(cfg).parameters())
    return counts


def table(rows: list[dict]) -> str:
    from megatron_multilevel.study.savings import format_saving

    lines = ["| point | parameters | tokens | tokens per parameter | seeds | best scratch: final loss | method | "
             "final loss | equal quality: FLOPs saved | equal quality: wall-clock saved (normalised) | "
             "curve crossing: FLOPs saved |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["scratch_final_loss_range"]
        for method, m in sorted(r["methods"].items()):
            reached, ran = m.get("smaller_model_suffices") or (0, 0)
            name = method + (f" (the smaller model suffices: {reached}/{ran})" if reached else "")
            lines.append(f"| {r['point']} | {r['parameters'] / 1e6:.2f}M | {r['tokens'] / 1e6:.2f}M | "
                         f"{r['tokens_per_parameter']:.2f} | {r['seeds']} | {r['baseline']}: {r['scratch_final_loss']:.4f} "
                         f"({lo:.4f} to {hi:.4f}) | {name} | {m['final_valid_loss']:.4f} | "
                         f"{format_saving(m['equal_quality'])} | {format_saving(m['equal_quality_seconds'])} | "
                         f"{format_saving(m['crossing'])} |")
    return "\n".join(lines) + "\n"


def read_leads(benchmarks: str, rows: list[dict], points: dict[str, dict]) -> list[dict]:
    """Per point (in the order of ``rows``) and multilevel method, from the full-budget run files of
    ``<point>/runs/`` made by the code of the point's ``results.json`` (``points[name]``): its
    phases (level and steps) and its lead over training from scratch at the end of each phase, at
    equal FLOPs (:func:`megatron_multilevel.study.savings.phase_leads`), the median over the seeds
    and every seed's."""
    import statistics

    from megatron_multilevel.study.runs import kept_runs
    from megatron_multilevel.study.savings import phase_leads

    out = []
    for r in rows:
        kept, _ = kept_runs(os.path.join(benchmarks, r["point"], "runs"), points[r["point"]]["version"])
        runs = {(run["method"], run["seed"]): run for run in kept if float(run["fraction"]) == 1.0}
        baseline = points[r["point"]]["baseline"]
        for method in sorted({m for m, _ in runs} - {baseline}):
            seeds = sorted(s for m, s in runs if m == method and (baseline, s) in runs)
            if not seeds or len(runs[method, seeds[0]]["phases"]) < 2:
                continue
            phases = runs[method, seeds[0]]["phases"]
            leads = {s: phase_leads(runs[baseline, s]["valid"], runs[method, s]["phases"]) for s in seeds}
            out.append({"point": r["point"], "method": method, "seeds": seeds,
                        "phases": [{"level": p["level"], "steps": p["steps"]} for p in phases],
                        "lead": [None if leads[seeds[0]][i] is None else statistics.median(leads[s][i] for s in seeds)
                                 for i in range(len(phases))],
                        "lead_by_seed": {str(s): leads[s] for s in seeds}})
    return out


def add_schedules(benchmarks: str, rows: list[dict], points: dict[str, dict]) -> None:
    """Each multilevel method of each row gets its ``schedule`` (coarse share, second visit, E_a:
    :func:`megatron_multilevel.study.planner.schedule_of`), read from a full-budget run file of the
    point's code version: what the planner recommends."""
    from megatron_multilevel.study.planner import schedule_of
    from megatron_multilevel.study.runs import kept_runs

    for r in rows:
        kept, _ = kept_runs(os.path.join(benchmarks, r["point"], "runs"), points[r["point"]]["version"])
        configs = {run["method"]: run["config"] for run in kept if float(run["fraction"]) == 1.0}
        for method, m in r["methods"].items():
            block = configs.get(method, {}).get("multilevel", {})
            if block.get("enabled") and block.get("num_levels", 2) == 2 and "ode" not in block:
                m["schedule"] = schedule_of(block, r["steps"])


def leads_table(leads: list[dict]) -> str:
    lines = ["| point | method | seeds | phases (level: steps) | lead over scratch at equal FLOPs at each phase's end "
             "(nats, median over seeds) |", "|---|---|---|---|---|"]
    for x in leads:
        phases = ", ".join(f"{p['level']}: {p['steps']}" for p in x["phases"])
        lead = ", ".join("-" if v is None else f"{v:+.3f}" for v in x["lead"])
        lines.append(f"| {x['point']} | {x['method']} | {len(x['seeds'])} | {phases} | {lead} |")
    return "\n".join(lines) + "\n"


def print_point(benchmarks: str, name: str) -> int:
    """The study table's rows and the lead table of one point, from its ``results.json`` (one code
    version by construction); nothing written."""
    from megatron_multilevel.study.savings import study_rows

    match = re.match(r"^.+-(\d+)x(\d+)-(\d+)$", name)
    path = os.path.join(benchmarks, name, "results.json")
    if not match or not os.path.isfile(path):
        raise SystemExit(f"study_report: --point {name}: no {path} (a point is <name>-<layers>x<hidden>-<steps>)")
    with open(path) as f:
        points = {name: {**json.load(f), "steps": int(match.group(3))}}
    rows = study_rows(points, parameter_counts(points))
    print(f"{name}, made by {', '.join(points[name]['commits'])}\n\n" + table(rows) + "\nWhere the lead is made "
          "(nats ahead of scratch at equal FLOPs at each phase's end, level 0 the full model):\n\n"
          + leads_table(read_leads(benchmarks, rows, points)))
    return 0


def regime_studies(benchmarks: str, study: str, commit: str, rows: list[dict]) -> dict[str, list[dict]]:
    """The regime pins' rows to plot beside ``study``'s: each other regime pin's kept rows where one
    of its points has a multilevel cycle's saving (a pin of growths only has none to plot)."""
    from megatron_multilevel.study.savings import best_multilevel

    studies = {f"{study} study ({commit[:7]})": rows}
    for name in sorted(n for n in STUDIES if n.startswith("regime") and n != study):
        other = os.path.join(benchmarks, name + ".json")
        if os.path.isfile(other):
            with open(other) as f:
                kept = json.load(f)
            if any(map(best_multilevel, kept["points"])):
                studies[f"{name} study ({kept['commit'][:7]})"] = kept["points"]
    return studies


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--benchmarks", default=os.path.join(ROOT, "benchmarks"))
    p.add_argument("--study", choices=sorted(STUDIES), default="scale",
                   help="scale: the cpu-* points (study.*); regime: the long-* points (regime.*); regime2: the "
                        "long2-* points (regime2.*); regime3: the long3-* points (regime3.*); controls: the ctl-* points "
                        "(controls.*); deep, deep2, deep3: the deep-*, deep2-* and deep3-* points (16 layers, the late expansion); "
                        "docs: the docs-* points (deep3's comparison on a second corpus)")
    p.add_argument("--out", default=None, help="where the table, the JSON and the plot go (default: --benchmarks)")
    p.add_argument("--point", default=None, help="print one point's rows and where its lead is made (any point "
                   "named <name>-<layers>x<hidden>-<steps>, by its own code version: a BERT point, a peers point)")
    args = p.parse_args(argv)
    if args.point:
        return print_point(args.benchmarks, args.point)
    out = args.out or args.benchmarks
    pattern, stem = STUDIES[args.study]
    commit = study_commit(args.benchmarks, args.study)
    points, notes = read_points(args.benchmarks, commit, pattern)
    for note in notes:
        print(note)
    if not points:
        raise SystemExit(f"study_report: no point of {args.benchmarks} was made by {commit[:12]}")

    from megatron_multilevel.study.plotting import plot_regime, plot_scale
    from megatron_multilevel.study.savings import best_multilevel, study_rows, with_controls

    rows = study_rows(points, parameter_counts(points))
    os.makedirs(out, exist_ok=True)
    leads = read_leads(args.benchmarks, rows, points)
    add_schedules(args.benchmarks, rows, points)
    text = table(rows) + (
        "\nWhere the lead is made: each multilevel method's full-budget run against training from scratch"
        " with the same seed, at equal FLOPs, at the end of each of its phases (level 0 is the full"
        " model; positive: ahead).\n\n" + leads_table(leads))
    command = "python tools/study_report.py" + ("" if args.study == "scale" else f" --study {args.study}")
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(f"Made by `{command}` from the runs of commit {commit}.\n\n" + text)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"commit": commit, "points": rows, "leads": leads}, f, indent=1)
        f.write("\n")
    if args.study == "scale":
        plot = plot_scale(rows, out)
    elif args.study == "controls" or not any(map(best_multilevel, rows)):
        plot = "no plot"  # no cycle's saving to plot (the controls; a pin of growths only): the table says it
    else:  # the regime's points beside the scale study's (and the other regime pins' with a cycle)
        studies = regime_studies(args.benchmarks, args.study, commit, rows)
        scale = os.path.join(args.benchmarks, "study.json")
        if os.path.isfile(scale):
            with open(scale) as f:
                kept = json.load(f)
            scale_rows, controls_commit = kept["points"], "none"
            controls = os.path.join(args.benchmarks, "controls.json")
            if os.path.isfile(controls):  # the controls run later at the scale study's points
                with open(controls) as f:
                    later = json.load(f)
                scale_rows, controls_commit = with_controls(scale_rows, later["points"]), later["commit"][:7]
            studies[f"scale study ({kept['commit'][:7]}; controls {controls_commit})"] = scale_rows
        plot = plot_regime(studies, out)
    print(text + f"\nwritten: {os.path.join(out, stem + '.md')}, {stem}.json, {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
