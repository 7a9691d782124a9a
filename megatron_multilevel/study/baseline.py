"""What a multilevel run saved against its baseline (``--with-baseline``, ``training/baseline.py``
trains it): the comparison added to the run's summary, the plots of both validation curves, and the
lines the run ends with. Run on rank 0 by the entry point once the baseline has finished.
"""

import json
import os
import tempfile

from megatron_multilevel.records import SUMMARY, read_metrics, read_summary
from megatron_multilevel.study.plotting import plot_validation
from megatron_multilevel.study.savings import run_savings


def compare(run_dir: str, base_dir: str) -> dict:
    """The ``baseline`` block of the run's summary (added to its ``summary.json``), and the plots."""
    records, base_records = read_metrics(run_dir), read_metrics(base_dir)
    totals = read_summary(base_dir)["totals"]
    saving = run_savings(records, base_records)
    reached = saving["flops_to_target"] is not None
    block = {
        "dir": base_dir, "steps": totals["steps"], "final_valid_loss": totals["final_valid_loss"],
        "flops": totals["flops"], "wall_seconds": totals["wall_seconds"],
        "saving": {**saving, "reached": reached,
                   "gap": None if reached else saving["final_valid_loss"] - saving["target_loss"]},
    }
    with tempfile.TemporaryDirectory(dir=run_dir) as tmp:
        # plot_validation names its figures valid_loss_vs_<axis>.png
        plot_validation({"multilevel run": records, "baseline (fine model from scratch)": base_records}, tmp,
                        target=saving["target_loss"])
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
    lines = [f"baseline: the fine model from scratch, {block['steps']} steps: final validation loss "
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
    lines.append(f"plots: {os.path.join(run_dir, 'loss_vs_flops.png')}, loss_vs_seconds.png; "
                 f"summary: {os.path.join(run_dir, SUMMARY)}")
    return lines


def report_baseline(run_dir: str, base_dir: str) -> dict:
    """Compare the finished run in ``run_dir`` with its finished baseline in ``base_dir``, say the
    saving and return the summary's ``baseline`` block."""
    block = compare(run_dir, base_dir)
    for line in report_lines(block, run_dir):
        print(line, flush=True)
    return block
