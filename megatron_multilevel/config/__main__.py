"""Check a run's config as its ranks will, before any of them starts:

    python -m megatron_multilevel.config --config configs/gpt_base.json [dotted.key=value ...] [--with-baseline]

The arguments are the ranks' own (``megatron_multilevel.pretrain``'s), and so is the code that reads
the file, applies the overrides and checks the result, the baseline's config included where the run
trains one. A valid config shows its warnings, one line each, and exits 0; an invalid one prints one
line, ``error: ...``, and exits 2. ``launch/pretrain_vcycle.sh`` runs it before the DeepSpeed
launcher. It imports neither Megatron-Core nor DeepSpeed (about as long as importing torch).
"""

import sys
import warnings


def one_line(message, category, filename, lineno, line=None) -> str:
    """A warning as ``warning: message``, without the file, line and source of the call."""
    return f"warning: {message}\n"


def main(argv=None) -> int:
    # An entry point, like pretrain itself: the ranks' steps, not a part of this package's API.
    from megatron_multilevel.config.parsing import read_json
    from megatron_multilevel.config.run import load_config
    from megatron_multilevel.pretrain import apply_overrides, parse_args, wants_baseline
    from megatron_multilevel.training.baseline import baseline_config

    args = parse_args(argv)
    warnings.formatwarning = one_line
    try:
        cfg = load_config(apply_overrides(read_json(args.config), args.overrides))
        if wants_baseline(args, cfg):
            baseline_config(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
