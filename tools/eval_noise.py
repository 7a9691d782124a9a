"""How much of a validation loss is evaluation noise: per-sample losses of finished runs.

    python tools/eval_noise.py runs/savings/work/<version>/scratch-f1-s1234 runs/.../stacking-f1-s1234

Each run's last checkpoint is consolidated and scored on the run's own validation samples (the
same ones for every run of a comparison, ``data.valid_seed``). Printed per number of samples
``n``: each run's mean loss with its standard error (standard deviation of the per-sample losses
over ``sqrt(n)``), and, for every run after the first, the difference to the first run with the
standard error of that paired difference, the figure that bounds how finely two methods scored
on the same samples can be told apart.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def per_sample_losses(run_dir: str, samples: int) -> list[float]:
    """The mean loss of each of the first ``samples`` validation samples of ``run_dir``'s data."""
    import torch

    from megatron_multilevel.checkpoints.convert import load_source
    from megatron_multilevel.config import load_config
    from megatron_multilevel.data.datasets import build_data, collate
    from megatron_multilevel.models import build_model, language_model_loss, load_parameters

    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = load_config(json.load(f))
    source = load_source(run_dir)
    assert source.level == 0, f"{run_dir}: the last checkpoint is not of the fine model"
    model = build_model(source.model)
    load_parameters(model, source.tensors)
    model.eval()
    data = build_data(cfg, train_samples=1, valid_samples=samples)
    out = []
    with torch.no_grad():
        for i in range(samples):
            batch = collate([data.valid[i]], cfg.model.kind)
            out.append(language_model_loss(model, source.model, batch.tokens, batch.labels, batch.loss_mask,
                                           padding_mask=batch.padding_mask, tokentype_ids=batch.tokentype_ids).item())
    return out


def mean_and_error(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def main(argv=None) -> int:
    from megatron_multilevel.compat import quiet_library_notices

    quiet_library_notices()  # before Megatron-Core builds a model: its known notices, dropped
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (the first is the reference)")
    p.add_argument("--samples", type=int, nargs="+", default=[128, 256, 512, 1024])
    args = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_multilevel.distributed import init_single_process

    init_single_process()
    losses = {run: per_sample_losses(run, max(args.samples)) for run in args.runs}
    names = {run: os.path.basename(os.path.normpath(run)) for run in args.runs}
    first = args.runs[0]
    print("| samples | run | mean loss | standard error | difference to " + names[first] + " | its standard error |")
    print("|---|---|---|---|---|---|")
    for n in args.samples:
        for run in args.runs:
            mean, err = mean_and_error(losses[run][:n])
            diff = ""
            if run != first:
                d, derr = mean_and_error([a - b for a, b in zip(losses[run][:n], losses[first][:n])])
                diff = f"{d:+.4f} | {derr:.4f}"
            print(f"| {n} | {names[run]} | {mean:.4f} | {err:.4f} | {diff or '- | -'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
