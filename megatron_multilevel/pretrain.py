"""Entry point of a pretraining run: from scratch or a V-cycle, GPT or BERT.

Started by the DeepSpeed launcher (``launch/pretrain_vcycle.sh``), one process per rank:

    deepspeed --num_gpus 8 --module megatron_multilevel.pretrain --config configs/gpt_base.json \\
        training.output_dir=runs/gpt_base multilevel.alpha=0.25

Overrides are ``dotted.key=value`` (JSON values; list items by index, e.g.
``multilevel.levels.0.steps_before=100``) applied to the config file before it is checked.

``--with-baseline`` (the default for the embedded default config, ``configs/gpt_tiny_cpu.json``)
also trains the fine model from scratch on the same data, seed and training FLOPs in
``<run>/baseline`` (or reuses a finished one there) and reports the saving at equal quality;
``--no-baseline`` turns it off. With it comes the control, the first coarse level's model alone on
the same FLOPs in ``<run>/control``, which says whether the full model is yet the right model at
this budget (``--no-control`` skips it).
"""

import argparse
import os
import sys

import torch

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                              "gpt_tiny_cpu.json")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Multi-level (V-cycle) pretraining with Megatron-Core and DeepSpeed")
    parser.add_argument("--config", required=True, help="run config: a DeepSpeed JSON config plus our blocks")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("--with-baseline", dest="with_baseline", action="store_true", default=None,
                        help="also train the fine model from scratch with the same training FLOPs and report the "
                             "saving (default: only for configs/gpt_tiny_cpu.json)")
    parser.add_argument("--no-baseline", dest="with_baseline", action="store_false", help="no baseline")
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="with the baseline, skip its control (the first coarse level's model alone on the same "
                             "FLOPs, which says whether the full model is yet the right model at this budget)")
    parser.add_argument("--allow-config-change", dest="allow_config_change", action="store_true",
                        help="resume although the config changes what the checkpoint's config said (rates, schedule, "
                             "seed, data...); the changes are recorded in <run>/config_changes.jsonl")
    parser.add_argument("--check", action="store_true",
                        help="only read and check the config and its overrides, as the ranks do, and exit (0: valid; "
                             "2: one line, error: ...); launch/pretrain_vcycle.sh runs it before the DeepSpeed "
                             "launcher starts anything")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    return parser.parse_args(argv)


def wants_baseline(args, cfg) -> bool:
    """``--with-baseline`` / ``--no-baseline``, else on for the embedded default config's multilevel runs."""
    if args.with_baseline is not None:
        return args.with_baseline
    default = os.path.isfile(DEFAULT_CONFIG) and os.path.samefile(args.config, DEFAULT_CONFIG)
    return default and cfg.multilevel.enabled


def _shape(cfg) -> str:
    return f"{cfg.model.num_layers} x {cfg.model.hidden_size}"


def runs_line(cfg, baseline, control) -> "str | None":
    """The run's opening line where it trains references after itself: how many runs, what each is,
    where, and the flags that skip them; None for a run alone."""
    if baseline is None:
        return None
    run_dir = cfg.training.output_dir
    if control is None:
        return (f"2 runs: the multilevel run in {run_dir}, then its baseline (the fine model ({_shape(baseline)}) "
                f"from scratch on the same training FLOPs) in {baseline.training.output_dir}; --no-baseline skips it")
    return (f"3 runs: the multilevel run in {run_dir}, then its baseline (the fine model ({_shape(baseline)}) from "
            f"scratch on the same training FLOPs) in {baseline.training.output_dir} and its control (the coarse "
            f"model ({_shape(control)}) alone) in {control.training.output_dir}; --no-baseline skips both, "
            f"--no-control the control")


def _memory_per_rank() -> tuple[int, str]:
    """The memory one rank trains in, and what it is: its GPU's, or its share of the CPU's."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, "its GPU's memory"
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
    return psutil.virtual_memory().total // local, f"the CPU's memory shared by {local} rank(s)"


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_multilevel.compat import quiet_library_notices

    quiet_library_notices()  # before anything imports DeepSpeed or builds a model
    import warnings

    from megatron_multilevel.config import load_config
    from megatron_multilevel.config.parsing import apply_overrides, one_line_warning, read_json
    from megatron_multilevel.training.baseline import baseline_config, control_config, run_reference

    if args.check:  # every warning of the config one line, as the check shows them before launch
        warnings.formatwarning = one_line_warning
    try:
        cfg = load_config(apply_overrides(read_json(args.config), args.overrides))
        from megatron_multilevel.models import check_fp8

        check_fp8(cfg.model)
        baseline = baseline_config(cfg) if wants_baseline(args, cfg) else None
        control = control_config(cfg, baseline) if baseline is not None and args.control else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # ranks sharing a CPU split its cores instead of oversubscribing them
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))

    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron_multilevel.data.datasets import ordered_samples
    from megatron_multilevel.distributed import init_distributed, shutdown_distributed
    from megatron_multilevel.flops import check_fits
    from megatron_multilevel.launching.node import mark_error_said
    from megatron_multilevel.study.baseline import report_baseline
    from megatron_multilevel.training.checkpoint import CheckpointError
    from megatron_multilevel.training.run_lock import hold_run_directory
    from megatron_multilevel.training.stop import STOPPED_STATUS, Stopped, StopRequest, die_with_parent
    from megatron_multilevel.training.trainer import Trainer, TrainingError, run_samples
    from megatron_multilevel.training.transition_check import TransitionJump

    if "LOCAL_RANK" in os.environ:  # started by a launcher: no rank outlives it
        die_with_parent()
    stop = StopRequest(cfg.training.stop_grace_seconds).install()
    lock = None
    try:
        init_distributed(cfg.level_tp_sizes()[0], seed=cfg.training.seed)
        check_fits(cfg.model, torch.distributed.get_world_size(), *_memory_per_rank())
        lock = hold_run_directory(cfg.training.output_dir, print)
        if torch.distributed.get_rank() == 0 and runs_line(cfg, baseline, control):
            print(runs_line(cfg, baseline, control), flush=True)
        for run in (baseline, control):  # their data.order_samples before the run trains (its own: Trainer's)
            if run is not None:
                ordered_samples(run, run_samples(run, torch.distributed.get_world_size()))
        Trainer(cfg, stop, allow_config_change=args.allow_config_change).run()
        if baseline is not None:
            run_reference(baseline, "baseline", f"the fine model ({_shape(baseline)}) from scratch", stop)
            if control is not None:
                run_reference(control, "control", f"the coarse model ({_shape(control)}) alone from scratch", stop)
            if torch.distributed.get_rank() == 0:
                report_baseline(cfg.training.output_dir, baseline.training.output_dir,
                                control.training.output_dir if control is not None else None)
    except Stopped as e:
        if torch.distributed.get_rank() == 0:
            print(e, flush=True)
        shutdown_distributed()
        return STOPPED_STATUS
    except (ValueError, TrainingError, CheckpointError, TransitionJump) as e:
        print(f"error: {e}", file=sys.stderr)
        mark_error_said()  # said: the node launch drops DeepSpeed's line on the status
        shutdown_distributed()
        return 1
    finally:
        stop.uninstall()
        if lock is not None:
            lock.release()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
