"""Plot the metrics of one or more runs as PNG files.

    python tools/plot_metrics.py runs/gpt_tiny_cpu                       # -> runs/gpt_tiny_cpu/plots/
    python tools/plot_metrics.py runs/scratch runs/vcycle --out plots/   # several runs on one figure

Writes ``loss_vs_steps.png``, ``loss_vs_flops.png`` and ``loss_vs_seconds.png``: training loss
(thin) and validation loss (markers) of every run against global step, training FLOPs and
wall-clock seconds (training and transitions), with the level of each phase shaded.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output directory (default: <first run>/plots)")
    parser.add_argument("--labels", nargs="*", default=None, help="legend labels, one per run")
    args = parser.parse_args(argv)
    from megatron_multilevel.study.plotting import plot_runs
    from megatron_multilevel.records import METRICS_FILE, read_metrics

    runs = {}
    for i, run in enumerate(args.runs):
        if not os.path.exists(os.path.join(run, METRICS_FILE)):
            print(f"error: {os.path.join(run, METRICS_FILE)} does not exist", file=sys.stderr)
            return 2
        label = args.labels[i] if args.labels and i < len(args.labels) else os.path.basename(os.path.normpath(run))
        runs[label] = read_metrics(run)
    out = args.out or os.path.join(args.runs[0], "plots")
    for path in plot_runs(runs, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
