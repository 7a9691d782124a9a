"""The scale study's report: every point's savings side by side, the regime of each point, and the
saving against the budget per method.

    python tools/study_report.py              # reads benchmarks/<point>/results.json, writes benchmarks/study.*

A point is a directory ``cpu-<layers>x<hidden>-<steps>`` of ``benchmarks/`` (``run_study.sh
--list``) whose ``results.json`` was made by the study's pinned code (``benchmarks/STUDY_COMMIT``);
the others are named and left out, so that the table never mixes code versions. Writes
``study.md`` (one row per point and method, then each multilevel method's lead over scratch at
equal FLOPs at the end of each phase, from the point's full-budget run files), ``study.json`` and
``saving_vs_budget.png``.
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
POINT = re.compile(r"^cpu-(\d+)x(\d+)-(\d+)$")


def read_points(benchmarks: str, commit: str) -> tuple[dict[str, dict], list[str]]:
    """The points made by ``commit`` (each results.json with its ``steps``), and notes on the others."""
    points, notes = {}, []
    for name in sorted(os.listdir(benchmarks)):
        match = POINT.match(name)
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

    lines = ["| point | parameters | tokens | tokens per parameter | seeds | scratch: final loss | method | "
             "final loss | equal quality: FLOPs saved | equal quality: wall-clock saved (normalised) | "
             "curve crossing: FLOPs saved |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["scratch_final_loss_range"]
        for method, m in sorted(r["methods"].items()):
            lines.append(f"| {r['point']} | {r['parameters'] / 1e6:.2f}M | {r['tokens'] / 1e6:.2f}M | "
                         f"{r['tokens_per_parameter']:.2f} | {r['seeds']} | {r['scratch_final_loss']:.4f} "
                         f"({lo:.4f} to {hi:.4f}) | {method} | {m['final_valid_loss']:.4f} | "
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
        for method in sorted({m for m, _ in runs} - {"scratch"}):
            seeds = sorted(s for m, s in runs if m == method and ("scratch", s) in runs)
            if not seeds or len(runs[method, seeds[0]]["phases"]) < 2:
                continue
            phases = runs[method, seeds[0]]["phases"]
            leads = {s: phase_leads(runs["scratch", s]["valid"], runs[method, s]["phases"]) for s in seeds}
            out.append({"point": r["point"], "method": method, "seeds": seeds,
                        "phases": [{"level": p["level"], "steps": p["steps"]} for p in phases],
                        "lead": [None if leads[seeds[0]][i] is None else statistics.median(leads[s][i] for s in seeds)
                                 for i in range(len(phases))],
                        "lead_by_seed": {str(s): leads[s] for s in seeds}})
    return out


def leads_table(leads: list[dict]) -> str:
    lines = ["| point | method | seeds | phases (level: steps) | lead over scratch at equal FLOPs at each phase's end "
             "(nats, median over seeds) |", "|---|---|---|---|---|"]
    for x in leads:
        phases = ", ".join(f"{p['level']}: {p['steps']}" for p in x["phases"])
        lead = ", ".join("-" if v is None else f"{v:+.3f}" for v in x["lead"])
        lines.append(f"| {x['point']} | {x['method']} | {len(x['seeds'])} | {phases} | {lead} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--benchmarks", default=os.path.join(ROOT, "benchmarks"))
    p.add_argument("--out", default=None, help="where study.md, study.json and the plot go (default: --benchmarks)")
    args = p.parse_args(argv)
    out = args.out or args.benchmarks
    commit_file = os.path.join(args.benchmarks, "STUDY_COMMIT")
    if not os.path.isfile(commit_file):
        raise SystemExit(f"study_report: {commit_file} is missing: it names the commit the study's runs are made by")
    with open(commit_file) as f:
        commit = f.read().strip()
    points, notes = read_points(args.benchmarks, commit)
    for note in notes:
        print(note)
    if not points:
        raise SystemExit(f"study_report: no point of {args.benchmarks} was made by {commit[:12]}")

    from megatron_multilevel.study.plotting import plot_scale
    from megatron_multilevel.study.savings import study_rows

    rows = study_rows(points, parameter_counts(points))
    os.makedirs(out, exist_ok=True)
    leads = read_leads(args.benchmarks, rows, points)
    text = table(rows) + (
        "\nWhere the lead is made: each multilevel method's full-budget run against training from scratch"
        " with the same seed, at equal FLOPs, at the end of each of its phases (level 0 is the full"
        " model; positive: ahead).\n\n" + leads_table(leads))
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write(f"Made by `python tools/study_report.py` from the runs of commit {commit}.\n\n" + text)
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump({"commit": commit, "points": rows, "leads": leads}, f, indent=1)
        f.write("\n")
    plot = plot_scale(rows, out)
    print(text + f"\nwritten: {os.path.join(out, 'study.md')}, study.json, {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
