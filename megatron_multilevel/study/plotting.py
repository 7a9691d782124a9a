"""PNG plots of training metrics (``metrics.jsonl`` records), for runs and benchmarks."""

import os

from megatron_multilevel.study.savings import best_multilevel, control_verdict

X_AXES = {
    "global_step": ("steps", "global step"),
    "flops": ("flops", "training FLOPs"),
    "seconds": ("seconds", "wall-clock seconds (training + transitions)"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, ax, xlabel: str, ylabel: str, path: str) -> str:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_runs(runs: dict[str, list[dict]], out_dir: str, *, axes=("global_step", "flops", "seconds"),
              title: str = "") -> list[str]:
    """One PNG per x axis with every run's training and validation loss; returns the paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for axis in axes:
        name, label = X_AXES[axis]
        fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
        for i, (run, records) in enumerate(runs.items()):
            color = f"C{i % 10}"
            train = [r for r in records if r.get("type") == "train"]
            valid = [r for r in records if r.get("type") == "valid"]
            if train:
                ax.plot([r[axis] for r in train], [r["loss"] for r in train], color=color, alpha=0.35, lw=1)
            if valid:
                ax.plot([r[axis] for r in valid], [r["loss"] for r in valid], "o-", color=color, ms=3, lw=1.5,
                        label=f"{run} (validation)")
            if len(runs) == 1:
                _shade_levels(ax, train, axis)
        if title:
            ax.set_title(title)
        paths.append(_finish(plt, fig, ax, label, "loss", os.path.join(out_dir, f"loss_vs_{name}.png")))
    return paths


def _shade_levels(ax, train: list[dict], axis: str) -> None:
    """Shade the stretches trained at coarser levels (darker for coarser)."""
    start = None
    for prev, rec in zip([None] + train, train + [None]):
        level = rec["level"] if rec else None
        if prev is None or level != prev["level"]:
            if prev is not None and prev["level"] > 0 and start is not None:
                ax.axvspan(start, prev[axis], color="grey", alpha=0.12 * prev["level"], lw=0)
            start = rec[axis] if rec else None


def plot_validation(runs: dict[str, list[dict]], out_dir: str, *, target: "float | None" = None) -> list[str]:
    """Validation loss of every run against FLOPs and against wall-clock, one figure each; the fine
    model's points joined by lines, coarser levels' points hollow; ``target`` dashed."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for axis in ("flops", "seconds"):
        name, label = X_AXES[axis]
        fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
        for i, (run, records) in enumerate(runs.items()):
            color = f"C{i % 10}"
            valid = [r for r in records if r.get("type") == "valid"]
            fine = [r for r in valid if r["level"] == 0]
            coarse = [r for r in valid if r["level"] > 0]
            ax.plot([r[axis] for r in fine], [r["loss"] for r in fine], "o-", color=color, ms=3, lw=1.5, label=run)
            if coarse:
                ax.plot([r[axis] for r in coarse], [r["loss"] for r in coarse], "o", color=color, ms=4,
                        mfc="none", alpha=0.7)
        if target is not None:
            ax.axhline(target, color="black", ls="--", lw=1, label="final loss of training from scratch")
        low = min(r["loss"] for recs in runs.values() for r in recs if r.get("type") == "valid")
        low = low if target is None else min(low, target)
        ax.set_ylim(low - 0.05, low + 1.5)
        paths.append(_finish(plt, fig, ax, label, "validation loss (hollow: coarser levels)",
                             os.path.join(out_dir, f"valid_loss_vs_{name}.png")))
    return paths


def plot_budgets(budgets: dict[str, dict[int, list[tuple[float, float]]]], out_dir: str, *,
                 target: "float | None" = None) -> str:
    """Final validation loss against the budget fraction each run was compressed to, one line
    per method and seed (``budgets[method][seed] = [(fraction, loss), ...]``); ``target`` dashed."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (method, seeds) in enumerate(budgets.items()):
        for j, (seed, points) in enumerate(sorted(seeds.items())):
            points = sorted(points)
            ax.plot([f for f, _ in points], [loss for _, loss in points], "o-", color=f"C{i % 10}", ms=4, lw=1.5,
                    alpha=1.0 if j == 0 else 0.5, label=method if j == 0 else None)
    if target is not None:
        ax.axhline(target, color="black", ls="--", lw=1, label="final loss of training from scratch")
    return _finish(plt, fig, ax, "budget (fraction of the FLOPs of training from scratch)", "final validation loss",
                   os.path.join(out_dir, "final_loss_vs_budget.png"))


def plot_kept_runs(out_dir: str, results: list[dict], target: float) -> list[str]:
    """The savings benchmark's plots from its kept run files (``results``): the validation curves
    of the full-budget runs of the first seed (:func:`plot_validation`) and every run's final loss
    against its budget (:func:`plot_budgets`), ``target`` (scratch's final loss) dashed in both."""
    seed = min(r["seed"] for r in results)
    curves = {r["method"]: [{**v, "type": "valid"} for v in r["valid"]] for r in results
              if r["seed"] == seed and r["fraction"] == 1.0}
    budgets = {}
    for r in results:
        budgets.setdefault(r["method"], {}).setdefault(r["seed"], []).append(
            (r["fraction"], r["totals"]["final_valid_loss"]))
    return plot_validation(curves, out_dir, target=target) + [plot_budgets(budgets, out_dir, target=target)]


def plot_scale(rows: list[dict], out_dir: str) -> str:
    """FLOPs saved at equal quality (solid) and by the curve crossing (dashed) against the token
    budget, one panel per model shape and one colour per method; bars: lowest to highest seed;
    a point where some seed did not reach scratch's loss is drawn at 0 with a cross, one where the
    method ran at the full budget only and reached it in every seed (a saving of 0 or more) with a
    triangle up; the methods sit a little to either side of their budget so that equal savings
    stay visible; one legend for all panels, under them (``rows``:
    :func:`megatron_multilevel.study.savings.study_rows`)."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    shapes = sorted({r["shape"] for r in rows}, key=lambda s: next(r["parameters"] for r in rows if r["shape"] == s))
    methods = sorted({m for r in rows for m in r["methods"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), dpi=120, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        for i, method in enumerate(methods):
            for key, style in (("equal_quality", "-"), ("crossing", "--")):
                pts = [(r["tokens"], r["methods"][method][key]) for r in mine if method in r["methods"]]
                if not pts:
                    continue
                # each method a little to the side of the budget (log axis), so equal savings do not hide each other
                xs = [t * 2 ** (0.04 * (i - (len(methods) - 1) / 2)) for t, _ in pts]
                ys = [100 * (s["median"] or 0.0) for _, s in pts]
                lo = [y - 100 * (s["min"] or 0.0) for y, (_, s) in zip(ys, pts)]
                hi = [100 * (s["max"] or 0.0) - y for y, (_, s) in zip(ys, pts)]
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o" + style, color=f"C{i % 10}", ms=4, lw=1.5, capsize=3,
                            alpha=1.0 if key == "equal_quality" else 0.5,
                            label=f"{method} ({'equal quality' if key == 'equal_quality' else 'crossing'})")
                for x, (_, s) in zip(xs, pts):
                    if s["median"] is None:  # not reached in some seed
                        ax.plot([x], [0.0], "^" if s.get("zero_or_more") else "x", color=f"C{i % 10}", ms=8)
        ax.set_xscale("log", base=2)
        budgets = [r["tokens"] for r in mine]
        ax.set_xlim(min(budgets) / 2 ** 0.5, max(budgets) * 2 ** 0.5)  # half an octave either side
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_title(f"GPT {shape}, {mine[0]['parameters'] / 1e6:.1f}M parameters")
        ax.set_xlabel("tokens of training from scratch")
        ax.set_ylabel("FLOPs saved against training from scratch (%)")
        ax.grid(alpha=0.3)
    legend = {}  # label -> handle, over every panel (a method may be missing from one)
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)

    def marker(symbol: str):
        return plt.Line2D([], [], ls="", marker=symbol, color="gray", ms=8)

    legend["scratch's loss not reached in every seed"] = marker("x")
    legend["full budget only, scratch's loss reached in every seed (0% or more)"] = marker("^")
    ncol = 3
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    rows_of_legend = -(-len(legend) // ncol)
    fig.tight_layout(rect=(0, 0.045 * rows_of_legend, 1, 1))
    path = os.path.join(out_dir, "saving_vs_budget.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_regime(studies: dict[str, list[dict]], out_dir: str) -> str:
    """The best multilevel schedule's FLOPs saved at equal quality against tokens per parameter of
    the full model, one line per model shape and study (``studies[label]``: the rows of
    :func:`megatron_multilevel.study.savings.study_rows`), with the controls marked: at every point
    where the coarse model alone was run, a star at 0 when it reaches the best scratch's final loss
    (the smaller model suffices there), a hollow circle when it does not. A point whose best
    schedule has no equal-quality figure (run at the full budget only, or never reaching scratch's
    loss) is drawn at 0 with a cross."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    line = 0
    for label, rows in studies.items():
        for shape in sorted({r["shape"] for r in rows}, key=lambda s: next(r["parameters"] for r in rows
                                                                           if r["shape"] == s)):
            mine = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["tokens_per_parameter"])
            color = f"C{line % 10}"
            line += 1
            xs, ys = [], []
            for r in mine:
                best = best_multilevel(r)
                x = r["tokens_per_parameter"]
                if best is None:
                    ax.plot([x], [0.0], "x", color=color, ms=8)
                else:
                    xs.append(x)
                    ys.append(100 * r["methods"][best]["equal_quality"]["median"])
                suffices = control_verdict(r)
                if suffices is not None:
                    ax.plot([x], [0.0], "*" if suffices else "o", ms=11 if suffices else 8, color=color,
                            mfc=color if suffices else "none")
            ax.plot(xs, ys, "o-", color=color, lw=1.5, ms=5,
                    label=f"GPT {shape} ({mine[0]['parameters'] / 1e6:.2f}M parameters), {label}")
    ax.set_xscale("log")
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axvline(20.0, color="gray", lw=0.8, ls=":")  # compute-optimal (Chinchilla)
    for symbol, text, filled in (("*", "the coarse model alone reaches scratch's loss (the smaller model suffices)",
                                  True),
                                 ("o", "the coarse model alone does not", False),
                                 ("x", "no equal-quality saving measured or reached", True)):
        ax.plot([], [], ls="", marker=symbol, color="gray", ms=8, mfc="gray" if filled else "none", label=text)
    ax.set_title("Best multilevel schedule against the best-tuned scratch (median over seeds)")
    path = os.path.join(out_dir, "saving_vs_tokens_per_parameter.png")
    return _finish(plt, fig, ax, "tokens per parameter of the full model (embedding counted)",
                   "FLOPs saved at equal quality (%)", path)

