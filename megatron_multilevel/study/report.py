"""The savings benchmark's report from its kept runs (``tools/benchmark_savings.py`` makes it):
the baseline, the best-tuned training from scratch (:func:`best_scratch`); each method's savings per
seed against it and their medians (:func:`collect`), in FLOPs, raw seconds and seconds normalised by
per-step times measured in one process (:func:`normalized_seconds`, :func:`normalized_at_flops`);
and the Markdown table of them (:func:`table`).

Pure: it reads and writes no files and launches nothing; the arithmetic under it is
:mod:`megatron_multilevel.study.savings`.
"""

import statistics

from megatron_multilevel.methods import family
from megatron_multilevel.study.savings import (at_fraction, equal_quality, fine_curve, first_crossing, run_savings,
                                               summarize)


def shape_name(model: dict) -> str:
    """A model shape's name, ``8x256``: layers x width (the key of the per-step times)."""
    return f"{model['num_layers']}x{model['hidden_size']}"


def normalized_seconds(phases: list[dict], times: dict) -> float:
    """A run's training time in seconds of the per-step times measured in one process: each
    phase's steps times its shape's time per step (transitions not counted)."""
    return sum(p["steps"] * times[shape_name(p["model"])]["seconds_per_step"] for p in phases)


def normalized_at_flops(phases: list[dict], times: dict, flops: float) -> float:
    """Normalised seconds spent by the time a run has spent ``flops`` training FLOPs (within a
    phase both grow in proportion)."""
    spent = seconds = 0.0
    for p in phases:
        phase_seconds = p["steps"] * times[shape_name(p["model"])]["seconds_per_step"]
        if spent + p["flops"] >= flops:
            return seconds + phase_seconds * (flops - spent) / p["flops"]
        spent, seconds = spent + p["flops"], seconds + phase_seconds
    return seconds


def best_scratch(results: list[dict]) -> str:
    """The baseline: of the scratch runs at each learning rate (``--scratch-lr``), the rate whose
    full-budget runs end lowest (median over its seeds), among the rates run with the most seeds, so
    that every saving is measured against the best-tuned training from scratch of the point."""
    finals: dict[str, dict[int, float]] = {}
    for r in results:
        if family(r["method"]) == "scratch" and r["fraction"] == 1.0:
            finals.setdefault(r["method"], {})[r["seed"]] = r["totals"]["final_valid_loss"]
    assert finals, "no run of training from scratch at the full budget"
    most = max(len(by_seed) for by_seed in finals.values())
    return min((name for name, by_seed in finals.items() if len(by_seed) == most),
               key=lambda name: (statistics.median(finals[name].values()), name))


def collect(results: list[dict], times: dict) -> dict:
    """Savings per method and seed against the baseline of the same seed, and their medians."""

    def records(run):
        return [{**r, "type": "valid"} for r in run["valid"]]

    baseline = best_scratch(results)
    seeds = sorted({r["seed"] for r in results if r["method"] == baseline and r["fraction"] == 1.0})
    names = list(dict.fromkeys(r["method"] for r in results))
    methods = {}
    for name in names:
        per_seed = []
        for seed in seeds:
            base = next(r for r in results if r["method"] == baseline and r["seed"] == seed and r["fraction"] == 1.0)
            runs = sorted((r for r in results if r["method"] == name and r["seed"] == seed), key=lambda r: r["fraction"])
            if not runs:
                continue
            target = base["totals"]["final_valid_loss"]
            base_norm = normalized_seconds(base["phases"], times)
            row = {"seed": seed, "target_loss": target,
                   "final_valid_loss": {f"{r['fraction']:g}": r["totals"]["final_valid_loss"] for r in runs}}
            full = next((r for r in runs if r["fraction"] == 1.0), None)
            if full is not None:
                crossing = run_savings(records(full), records(base))
                row.update({f"crossing_{k}": v for k, v in crossing.items() if k.startswith(("saving", "flops_to",
                                                                                                "seconds_to"))})
                if crossing["flops_to_target"] is not None:
                    # against the FLOPs at which the baseline itself first reaches its final loss,
                    # as the FLOPs saving is (a noisy last evaluation can come after that)
                    base_crossing = first_crossing(fine_curve(records(base), "flops"), target)
                    base_at = normalized_at_flops(base["phases"], times, base_crossing)
                    row["crossing_saving_seconds_normalized"] = 1.0 - normalized_at_flops(
                        full["phases"], times, crossing["flops_to_target"]) / base_at
            eq = equal_quality([(r["fraction"], r["totals"]["final_valid_loss"]) for r in runs], target)
            if len(runs) < 2 and name != baseline:  # one budget: no curve over budgets to read the fraction from
                eq = {"fraction": None, "saving": None, "bound": "one_budget", "gap": None}
            row["equal_quality"] = eq
            if eq["fraction"] is not None:
                seconds = at_fraction([(r["fraction"], r["totals"]["wall_seconds"]) for r in runs], eq["fraction"])
                norm = at_fraction([(r["fraction"], normalized_seconds(r["phases"], times)) for r in runs],
                                   eq["fraction"])
                row["eq_saving_flops"] = eq["saving"]
                row["eq_saving_seconds"] = 1.0 - seconds / base["totals"]["wall_seconds"]
                row["eq_saving_seconds_normalized"] = 1.0 - norm / base_norm
            else:
                row["eq_saving_flops"] = row["eq_saving_seconds"] = row["eq_saving_seconds_normalized"] = None
            per_seed.append(row)
        keys = ("eq_saving_flops", "eq_saving_seconds_normalized", "eq_saving_seconds", "crossing_saving_flops",
                "crossing_saving_seconds_normalized", "crossing_saving_seconds")
        methods[name] = {"family": family(name), **{k: summarize([row.get(k) for row in per_seed]) for k in keys},
                         "final_valid_loss": summarize([row["final_valid_loss"].get("1") for row in per_seed]),
                         "seeds": per_seed}
    return {"baseline": baseline, "seeds": seeds, "methods": methods}


def smaller_model_suffices(method: dict) -> "str | None":
    """For the coarse model alone: in how many seeds its full-budget run reaches scratch's final loss
    (``"2/2 seeds"``), or None (another method, or no seed reached it). Where it does, the smaller
    model is the better choice at this budget, and a multilevel saving shows only that the full
    model was not needed yet."""
    if method["family"] != "coarse":
        return None
    rows = [row for row in method["seeds"] if row["final_valid_loss"].get("1") is not None]
    reached = sum(row["final_valid_loss"]["1"] <= row["target_loss"] for row in rows)
    return f"{reached}/{len(rows)} seed{'s' if len(rows) > 1 else ''}" if reached else None


def table(results: dict) -> str:
    """The Markdown table of :func:`collect`'s summary: per method, the final loss and both savings
    (median, lowest to highest over seeds)."""

    def pct(s):
        return "not reached" if s["median"] is None else (
            f"{100 * s['median']:.1f}% ({100 * s['min']:.1f} to {100 * s['max']:.1f})" + (
                f", reached {s['reached']}/{s['n']}" if s["reached"] < s["n"] else ""))

    def equal(m, key):
        bounds = {row["equal_quality"]["bound"] for row in m["seeds"]}
        if m["family"] == "scratch":
            return pct(m[key])
        if bounds == {"one_budget"}:
            return "one budget run"
        return pct(m[key]) + (" (at least: the smallest budget reached it)" if "at_most" in bounds else "")

    lines = ["| method | final valid loss | equal quality: FLOPs saving | wall-clock (normalised) | wall-clock (raw) "
             "| curve crossing: FLOPs saving | wall-clock (normalised) | wall-clock (raw) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in results["methods"].items():
        loss = m["final_valid_loss"]
        suffices = smaller_model_suffices(m)
        if suffices:
            name += f" (the smaller model suffices: {suffices})"
        lines.append(
            f"| {name} | {'n/a' if loss['median'] is None else format(loss['median'], '.4f')} "
            f"| {equal(m, 'eq_saving_flops')} | {equal(m, 'eq_saving_seconds_normalized')} "
            f"| {equal(m, 'eq_saving_seconds')} | {pct(m['crossing_saving_flops'])} "
            f"| {pct(m['crossing_saving_seconds_normalized'])} | {pct(m['crossing_saving_seconds'])} |")
    return "\n".join(lines)
