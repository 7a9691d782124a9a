"""What a multilevel run saved against its baseline (``--with-baseline``, ``training/baseline.py``
trains it and its control): the comparison added to the run's summary, the plots of the validation
curves, and the lines the run ends with. Run on rank 0 by the entry point once the baseline (and
the control) have finished.

The control, the first coarse level's model alone on the same FLOPs, says the run's regime: where
it ends at or below the baseline, the full model is not yet the right model at this budget, and a
saving shows only that it was not needed (the study's control, ``docs/results.md``).
"""

import json
import os
import tempfile

from megatron_multilevel.config import load_config
from megatron_multilevel.flops import parameter_count
from megatron_multilevel.records import SUMMARY, read_metrics, read_summary
from megatron_multilevel.study.plotting import plot_validation
from megatron_multilevel.study.savings import run_savings


def _reference(run_dir: str) -> dict:
    """A finished reference run's totals, model (``L x H``) and tokens per parameter."""
    totals = read_summary(run_dir)["totals"]
    model = load_config(os.path.join(run_dir, "config.json")).model
    return {"dir": run_dir, "steps": totals["steps"], "final_valid_loss": totals["final_valid_loss"],
            "flops": totals["flops"], "wall_seconds": totals["wall_seconds"],
            "model": f"{model.num_layers} x {model.hidden_size}",
            "tokens_per_parameter": totals["tokens"] / parameter_count(model)}


def compare(run_dir: str, base_dir: str, control_dir: str | None = None) -> dict:
    """The ``baseline`` block of the run's summary (added to its ``summary.json``; with the
    control's, under ``control``), and the plots."""
    records, base_records = read_metrics(run_dir), read_metrics(base_dir)
    saving = run_savings(records, base_records)
    reached = saving["flops_to_target"] is not None
    block = {
        **_reference(base_dir),
        "saving": {**saving, "reached": reached,
                   "gap": None if reached else saving["final_valid_loss"] - saving["target_loss"]},
    }
    curves = {"multilevel run": records, f"baseline (fine model {block['model']} from scratch)": base_records}
    if control_dir is not None:
        block["control"] = _reference(control_dir)
        curves[f"control (coarse model {block['control']['model']} alone)"] = read_metrics(control_dir)
    with tempfile.TemporaryDirectory(dir=run_dir) as tmp:
        # plot_validation names its figures valid_loss_vs_<axis>.png
        plot_validation(curves, tmp, target=saving["target_loss"])
        for axis in ("flops", "seconds"):
            os.replace(os.path.join(tmp, f"valid_loss_vs_{axis}.png"), os.path.join(run_dir, f"loss_vs_{axis}.png"))
    path = os.path.join(run_dir, SUMMARY)
    summary = read_summary(run_dir)
    summary["baseline"] = block
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)
    return block


def report_lines(block: dict, run_dir: str) -> list[str]:
    """The final lines: the baseline, then the saving at equal quality (negative: a loss)."""
    s = block["saving"]
    lines = [f"baseline: the fine model ({block['model']}) from scratch, {block['steps']} steps: final validation loss "
             f"{block['final_valid_loss']:.4f}, {block['flops'] / 1e12:.3f} TFLOPs, "
             f"{block['wall_seconds']:.1f} s training"]
    if s["reached"]:
        lines.append(f"saving at equal quality: {s['saving_flops']:.0%} of the FLOPs and {s['saving_seconds']:.0%} "
                     f"of the wall-clock: the multilevel run reaches the baseline's final validation loss "
                     f"{s['target_loss']:.4f} after {s['flops_to_target'] / 1e12:.3f} TFLOPs and "
                     f"{s['seconds_to_target']:.1f} s")
    else:
        lines.append(f"saving at equal quality: not reached: the multilevel run ends at {s['final_valid_loss']:.4f}, "
                     f"{s['gap']:.4f} above the baseline's final validation loss {s['target_loss']:.4f}")
    lines += _control_lines(block)
    lines.append(f"plots: {os.path.join(run_dir, 'loss_vs_flops.png')}, loss_vs_seconds.png; "
                 f"summary: {os.path.join(run_dir, SUMMARY)}")
    return lines


def _control_lines(block: dict) -> list[str]:
    """The control's line and what it says of the run's regime (none without a control)."""
    c = block.get("control")
    if c is None:
        return []
    line = (f"control: the coarse model ({c['model']}) alone from scratch, {c['steps']} steps on the same FLOPs: final "
            f"validation loss {c['final_valid_loss']:.4f}")
    gap = block["final_valid_loss"] - c["final_valid_loss"]
    if gap >= 0:
        regime = (f"regime: at {block['tokens_per_parameter']:.2f} tokens per parameter the {c['model']} model alone "
                  f"ends {gap:.4f} below the {block['model']} baseline{_versus_run(block, c)}: the full model is not "
                  f"yet the right model at this budget, so a saving here shows only that it was not needed; where "
                  f"the full model wins (tens of tokens per parameter) the savings are smaller: docs/results.md")
    else:
        regime = (f"regime: at {block['tokens_per_parameter']:.2f} tokens per parameter the {block['model']} baseline "
                  f"ends {-gap:.4f} below the {c['model']} model alone: the full model is the right model here, so "
                  f"a saving is one; docs/results.md has the measured regimes")
    return [line, regime]


def _versus_run(block: dict, control: dict) -> str:
    below = block["saving"]["final_valid_loss"] - control["final_valid_loss"]
    return f" and {below:.4f} below the multilevel run" if below > 0 else ""


def report_baseline(run_dir: str, base_dir: str, control_dir: str | None = None) -> dict:
    """Compare the finished run in ``run_dir`` with its finished baseline in ``base_dir`` (and
    control in ``control_dir``), say the saving and the regime, and return the summary's
    ``baseline`` block."""
    block = compare(run_dir, base_dir, control_dir)
    for line in report_lines(block, run_dir):
        print(line, flush=True)
    return block
