"""The savings benchmark's arithmetic (``tools/benchmark_savings.py``, ``tools/study_report.py``
and a run's baseline use it): savings at equal quality and where the curves cross, their spread
over seeds, the scale study's rows and where a run's lead over training from scratch is made.

Savings are measured as the paper does: the compute (FLOPs, and wall-clock seconds of training
and transitions) a method needs to first reach the validation loss that training from scratch
ends at, against what training from scratch needs to reach it, on the same data, tokenizer, seed,
model shape and token budget. Only the fine model's validation losses count (a coarse level
reaching the loss is not a model of the fine shape). Between two evaluations the loss curve is
taken as linear.
"""

import statistics
from typing import Optional, Sequence

from megatron_multilevel.methods import CYCLE_FAMILIES, GROWTH_FAMILIES


def first_crossing(points: Sequence[tuple[float, float]], target: float) -> Optional[float]:
    """The first ``x`` at which the piecewise-linear curve ``(x, loss)`` reaches ``loss <= target``,
    or None if it never does."""
    previous = None
    for x, loss in points:
        if loss <= target:
            if previous is None:
                return x
            x0, loss0 = previous
            return x0 + (x - x0) * (loss0 - target) / (loss0 - loss)
        previous = (x, loss)
    return None


def fine_curve(records: list[dict], axis: str) -> list[tuple[float, float]]:
    """``(axis, loss)`` of the fine model's (level 0) validation records, in order."""
    return [(r[axis], r["loss"]) for r in records if r.get("type") == "valid" and r.get("level") == 0]


def run_savings(records: list[dict], baseline_records: list[dict]) -> dict:
    """Cost to reach the baseline's final validation loss, and the saving against the baseline."""
    target = fine_curve(baseline_records, "flops")[-1][1]
    out = {"target_loss": target, "final_valid_loss": fine_curve(records, "flops")[-1][1]}
    for axis in ("flops", "seconds"):
        cost = first_crossing(fine_curve(records, axis), target)
        base = first_crossing(fine_curve(baseline_records, axis), target)
        out[f"{axis}_to_target"] = cost
        out[f"saving_{axis}"] = None if cost is None else 1.0 - cost / base
    return out


def equal_quality(points: Sequence[tuple[float, float]], target: float) -> dict:
    """The smallest budget fraction whose final validation loss reaches ``target``.

    ``points`` are ``(fraction, final loss)`` of one method run with its whole schedule
    compressed to each fraction of the baseline's budget. Between two fractions the final loss
    is taken as linear. ``bound`` says how far the figure holds: ``"interpolated"`` between two
    runs, ``"at_most"`` when even the smallest fraction run reaches the target (the fraction
    needed may be smaller), ``"not_reached"`` when no fraction does (``gap``: how far above the
    target the largest fraction ends)."""
    points = sorted(points)
    fraction = first_crossing(points, target)
    if fraction is None:
        return {"fraction": None, "saving": None, "bound": "not_reached", "gap": points[-1][1] - target}
    bound = "at_most" if fraction == points[0][0] else "interpolated"
    return {"fraction": fraction, "saving": 1.0 - fraction, "bound": bound, "gap": None}


def at_fraction(points: Sequence[tuple[float, float]], fraction: float) -> float:
    """The value at ``fraction`` of the piecewise-linear curve ``(fraction, value)``, clamped to
    its first and last points."""
    points = sorted(points)
    if fraction <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if fraction <= x1:
            return y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)
    return points[-1][1]


def summarize(values: Sequence[Optional[float]]) -> dict:
    """Median and spread of repeated measurements (None: not reached in some repeat)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": len(values), "reached": 0}
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(values),
            "reached": len(present)}


def study_rows(points: dict[str, dict], parameters: dict[str, int]) -> list[dict]:
    """One row per point of a scale study, from each point's ``results.json`` (``points[name]``) and
    the fine model's parameter count by shape (``parameters["8x256"]``): the regime (steps,
    tokens, tokens per parameter, the final loss of training from scratch) and, per method, the
    median, lowest and highest saving over seeds by both measures, with how many seeds reached
    scratch's loss. Rows are ordered by model shape, then budget."""
    rows = []
    for name, results in points.items():
        cfg = results["config"]
        model, seq, batch = cfg["model"], cfg["data"]["seq_length"], cfg["train_batch_size"]
        shape = f"{model['num_layers']}x{model['hidden_size']}"
        scratch = results["methods"][results["baseline"]]
        steps = results["steps"]
        tokens = steps * batch * seq
        methods = {}
        for method, m in results["methods"].items():
            if method == results["baseline"]:
                continue
            # seeds whose smallest budget already reached scratch's loss: the fraction needed is at
            # most that budget, the saving at least what it says
            at_least = sum(s.get("equal_quality", {}).get("bound") == "at_most" for s in m["seeds"])
            # seeds run at the full budget only (no fractions to read a saving from): whether that
            # run ends at or under scratch's loss (a saving of 0 or more) is all they say
            one_budget = [s for s in m["seeds"] if s.get("equal_quality", {}).get("bound") == "one_budget"]
            full_reached = sum(_full_budget_loss(s) <= s["target_loss"] for s in one_budget)
            bounds = {"at_least": at_least, "one_budget": len(one_budget), "full_budget_reached": full_reached,
                      # every seed ran at the full budget only and reached scratch's loss there: a
                      # saving of 0 or more, not a miss
                      "zero_or_more": len(one_budget) == full_reached == len(m["seeds"]) > 0}
            # the coarse model alone reaching scratch's final loss at the full budget: the smaller
            # model suffices at this budget (seeds where it did, of those it ran)
            suffices = None
            if m["family"] == "coarse":
                ran = [s for s in m["seeds"] if s["final_valid_loss"].get("1") is not None]
                suffices = [sum(_full_budget_loss(s) <= s["target_loss"] for s in ran), len(ran)]
            methods[method] = {"family": m["family"], "final_valid_loss": m["final_valid_loss"]["median"],
                               "smaller_model_suffices": suffices,
                               "equal_quality": {**m["eq_saving_flops"], **bounds},
                               "crossing": m["crossing_saving_flops"],
                               "equal_quality_seconds": {**m["eq_saving_seconds_normalized"], **bounds}}
        rows.append({"point": name, "shape": shape, "steps": steps, "tokens": tokens,
                     "parameters": parameters[shape], "tokens_per_parameter": tokens / parameters[shape],
                     "seeds": len(results["seeds"]), "baseline": results["baseline"],
                     "scratch_final_loss": scratch["final_valid_loss"]["median"],
                     "scratch_final_loss_range": [scratch["final_valid_loss"]["min"], scratch["final_valid_loss"]["max"]],
                     "methods": methods})
    return sorted(rows, key=lambda r: (r["parameters"], r["tokens"]))


def phase_leads(scratch_valid: list[dict], phases: list[dict]) -> list[Optional[float]]:
    """How far a run is ahead of training from scratch at the end of each of its phases, at equal
    FLOPs: scratch's validation loss at the run's FLOPs so far (linear between scratch's
    evaluations), minus the run's validation loss at that phase's end; positive is ahead.
    ``scratch_valid``: scratch's evaluations (``flops``, ``loss``), ``phases``: the run's
    (``flops`` spent in the phase, ``valid_loss`` at its end), both as a benchmark run file has
    them; None for a phase that ends before scratch's first evaluation. Where a multilevel run's
    lead is made and where it is lost, phase by phase."""
    points = sorted((v["flops"], v["loss"]) for v in scratch_valid)
    leads, spent = [], 0.0
    for phase in phases:
        spent += phase["flops"]
        # the full budget's FLOPs match scratch's, to rounding (beyond its last evaluation: clamped)
        assert spent <= points[-1][0] * (1 + 1e-6), (spent, points[-1][0])
        leads.append(None if spent < points[0][0] else at_fraction(points, spent) - phase["valid_loss"])
    return leads


def _full_budget_loss(seed: dict) -> float:
    """The final validation loss of a seed's largest budget run (``final_valid_loss`` is keyed by
    the budget fraction, as text)."""
    losses = seed["final_valid_loss"]
    return losses[max(losses, key=float)]


def format_saving(s: dict) -> str:
    """``20.1% (18.0 to 22.3), 2/2`` from a :func:`summarize` block: median (lowest to highest),
    how many seeds reached scratch's loss of how many, and how many of those are lower bounds. A
    method run at the full budget only says whether that run reached scratch's loss."""
    if not s["reached"] and s.get("one_budget") == s["n"]:
        reached = f"scratch's loss reached in {s['full_budget_reached']}/{s['n']}"
        if s["zero_or_more"]:
            return f"0% or more (full budget only: {reached})"
        if s["full_budget_reached"]:
            return f"full budget only: {reached}"
        return f"not reached at the full budget, 0/{s['n']}"
    if not s["reached"]:
        return f"not reached, 0/{s['n']}"
    bound = f" (at least, in {s['at_least']} of them: the smallest budget reached it)" if s.get("at_least") else ""
    # seeds run at the full budget only beside seeds with fractions: not misses, so say what they did
    more = (f" ({s['one_budget']} more at the full budget only: scratch's loss reached in "
            f"{s['full_budget_reached']}/{s['one_budget']})" if s.get("one_budget") else "")
    return (f"{100 * s['median']:.1f}% ({100 * s['min']:.1f} to {100 * s['max']:.1f}), "
            f"{s['reached']}/{s['n']}{bound}{more}")


def best_multilevel(row: dict) -> Optional[str]:
    """The multilevel method (a cycle of this project, not stacking or a control) of a study row
    (:func:`study_rows`) with the highest median equal-quality FLOPs saving, or None where none has one."""
    return _best_of(row, CYCLE_FAMILIES)


def best_growth(row: dict) -> Optional[str]:
    """The growth method (progressive stacking or a published peer, :data:`megatron_multilevel.methods.GROWTH_FAMILIES`) of a
    study row with the highest median equal-quality FLOPs saving, or None where none has one."""
    return _best_of(row, GROWTH_FAMILIES)


def best_late(row: dict) -> Optional[dict]:
    """The late expansion's best run at a study row's point (the lowest final loss of its family,
    any tau or initialisation): ``method``, its final loss ``above_scratch`` (the best-tuned
    scratch's) and its median equal-quality ``saving`` (None: it never reached scratch's loss); None
    where the late expansion was not run there."""
    runs = [(m["final_valid_loss"], name) for name, m in row["methods"].items() if m["family"] == "late"]
    if not runs:
        return None
    loss, name = min(runs)
    return {"method": name, "above_scratch": loss - row["scratch_final_loss"],
            "saving": row["methods"][name]["equal_quality"]["median"]}


def growth_verdict(row: dict) -> Optional[dict]:
    """What growth did at a study row's point, saving or not: the growth run with the highest
    median equal-quality saving, else (none reached the best-tuned scratch's loss) the one that
    ended lowest; ``method``, ``saving`` (None: not reached) and its final loss ``above_scratch``.
    None where no growth method ran there. The late expansion is not counted: :func:`best_late` is its."""
    runs = {name: m for name, m in row["methods"].items() if m["family"] in GROWTH_FAMILIES and m["family"] != "late"}
    if not runs:
        return None
    saved = [(m["equal_quality"]["median"], n) for n, m in runs.items() if m["equal_quality"]["median"] is not None]
    name = max(saved)[1] if saved else min(runs, key=lambda n: runs[n]["final_valid_loss"])
    return {"method": name, "saving": runs[name]["equal_quality"]["median"],
            "above_scratch": runs[name]["final_valid_loss"] - row["scratch_final_loss"]}


def _best_of(row: dict, families: tuple) -> Optional[str]:
    measured = [(m["equal_quality"]["median"], name) for name, m in row["methods"].items()
                if m["family"] in families and m["equal_quality"]["median"] is not None]
    return max(measured)[1] if measured else None


def control_verdict(row: dict) -> Optional[bool]:
    """Whether the smaller model suffices at a study row's point: its coarse model alone reached
    the best scratch's final loss in some seed; None where no control was run there."""
    seeds = control_seeds(row)
    return None if seeds is None else seeds[0] > 0


def control_seeds(row: dict) -> Optional[tuple]:
    """The seeds in which a study row's control (its coarse model alone, at the rate that reached it
    most often) reached the best scratch's final loss, and the seeds it ran: ``(reached, ran)``;
    None where no control was run there."""
    controls = [tuple(m["smaller_model_suffices"]) for m in row["methods"].values() if m.get("smaller_model_suffices")]
    return max(controls) if controls else None


def with_controls(rows: list[dict], control_rows: list[dict]) -> list[dict]:
    """A study's ``rows`` with the controls run later at its points (``control_rows``, matched by
    model shape and budget) added to their methods, named ``<method> (control)``."""
    later = {(r["shape"], r["steps"]): r["methods"] for r in control_rows}
    return [{**r, "methods": {**r["methods"], **{
        f"{name} (control)": m for name, m in later.get((r["shape"], r["steps"]), {}).items()
        if m.get("smaller_model_suffices")}}} for r in rows]
