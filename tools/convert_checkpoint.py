"""Convert checkpoints: consolidate, reshard, apply the operators offline, exchange with Hugging Face.

    python tools/convert_checkpoint.py to-full runs/gpt out/gpt_full                 # any TP, any ZeRO stage
    python tools/convert_checkpoint.py reshard runs/gpt runs/gpt_tp2 --target-tp 2 --num-gpus 16 [--zero-stage 3]
        [--target-pp 4]
    python tools/convert_checkpoint.py coalesce out/gpt_full out/gpt_coarse [--no-depth] [--width-pairing adjacent]
    python tools/convert_checkpoint.py decoalesce out/gpt_coarse out/gpt_fine        # reuses the recorded grouping
    python tools/convert_checkpoint.py interpolate out/gpt_fine out/gpt_mix --alpha 0.5 --with out/gpt_full
    python tools/convert_checkpoint.py to-hf out/gpt_full out/gpt_hf                 # GPT2LMHeadModel / MegatronBertForMaskedLM + tokenizer
    python tools/convert_checkpoint.py from-hf path/to/hf_model out/from_hf          # its tokenizer files kept beside
    python tools/convert_checkpoint.py init-run out/from_hf runs/mine --config mine.json   # a run that starts from it
    python tools/convert_checkpoint.py to-megatron runs/gpt out/gpt_mcore            # Megatron-Core torch_dist (Megatron-LM's layout)
    python tools/convert_checkpoint.py from-megatron path/to/megatron/save out/full [--config mine.json]
    python tools/convert_checkpoint.py init-run path/to/megatron/save runs/mine --config mine.json  # weights and Adam state

A source is a run directory (its latest checkpoint), one checkpoint tag directory, a
consolidated checkpoint, or a Megatron-Core torch_dist checkpoint (a Megatron-LM save directory,
whose latest iteration is read, or one iteration's directory; any tensor-parallel layout). DeepSpeed files are read with an allowlist of the classes they hold
(``weights_only``): a file that asks for anything else is refused, and nothing in it runs.
Consolidated checkpoints carry the run's tokenizer, and ``to-hf`` writes it as Hugging Face
tokenizer files (``--tokenizer`` names another), then checks that ``transformers`` alone continues
a prompt greedily as the Megatron model does. Every conversion writes a new directory (an existing one only with
--overwrite) and verifies itself first: exact tensor round trips where the maths says so, and
logits of source and target on a fixed input, printed as a table. Flags take hyphens or
underscores.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args(argv=None):
    from megatron_multilevel.level_maps import DEPTH_SCALINGS, PAIRINGS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, help_):
        c = sub.add_parser(name, help=help_)
        c.add_argument("source")
        c.add_argument("output")
        c.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
        return c

    def num_gpus(c, help_):
        c.add_argument("--num-gpus", "--num_gpus", type=int, default=None, help=help_)

    def fmt(c):
        c.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")

    fmt(command("to-full", "a DeepSpeed checkpoint -> one consolidated fp32 checkpoint"))
    c = command("reshard", "a run -> the same run, optimizer included, at another TP or PP size, number of ranks "
                           "or ZeRO stage")
    c.add_argument("--target-tp", "--target_tp", type=int, default=None,
                   help="every level's tensor-parallel size (default: the run's)")
    c.add_argument("--target-pp", "--target_pp", type=int, default=None,
                   help="every level's pipeline stages, split evenly (default: the run's)")
    num_gpus(c, "the ranks the run continues on (default: the run's, where the TP sizes divide it)")
    c.add_argument("--zero-stage", "--zero_stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="every level's ZeRO stage (default: the run's)")
    c = command("coalesce", "a checkpoint -> its coalesced (coarser) model")
    fmt(c)
    c.add_argument("--no-width", "--no_width", dest="width", action="store_false")
    c.add_argument("--no-depth", "--no_depth", dest="depth", action="store_false")
    c.add_argument("--width-pairing", "--width_pairing", choices=PAIRINGS, default="halves")
    c.add_argument("--depth-pairing", "--depth_pairing", choices=PAIRINGS, default="adjacent")
    c.add_argument("--depth-scaling", "--depth_scaling", choices=DEPTH_SCALINGS, default="none")
    c.add_argument("--tensor-model-parallel-size", "--tensor_model_parallel_size", type=int, default=1,
                   help="pair units inside the shards of this TP size")
    c = command("decoalesce", "a coalesced checkpoint -> the finer model (with the grouping it records)")
    fmt(c)
    c.add_argument("--level-map", "--level_map", default=None, help="a level_map.json to use instead")
    c = command("interpolate", "(1 - alpha) * WITH + alpha * SOURCE")
    fmt(c)
    c.add_argument("--alpha", type=float, required=True)
    c.add_argument("--with", dest="other", required=True, help="the model before coalescing")
    c = command("to-hf", "-> a Hugging Face transformers checkpoint, with its tokenizer")
    c.add_argument("--tokenizer", default=None,
                   help="a SentencePiece model or Hugging Face tokenizer directory (default: the one the source records)")
    c = command("init-run", "a checkpoint -> a run directory whose training starts from it")
    c.add_argument("--config", required=True, help="the run config (the model of its first phase's level must match "
                                                   "the checkpoint's)")
    num_gpus(c, "the ranks the run will train on (default: its first level's TP size); ZeRO partitions follow it")
    c.add_argument("--fresh-optimizer", "--fresh_optimizer", action="store_true",
                   help="start with a fresh optimizer even where the source (torch_dist) has an optimizer state")
    c.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                   help="changes to the config, as the launcher takes them (e.g. multilevel.cycle=v)")
    c = command("to-megatron", "-> a Megatron-Core torch_dist checkpoint (Megatron-LM's save layout), optimizer included")
    c.add_argument("--iteration", type=int, default=None, help="its iteration number (default: the source's global step)")
    c.add_argument("--no-optimizer", "--no_optimizer", dest="optimizer", action="store_false",
                   help="the weights only")
    c.add_argument("--tokenizer", default=None, help="the tokenizer to keep beside it (default: the source's)")
    c = command("from-megatron", "a Megatron-Core torch_dist checkpoint (any layout) -> a consolidated checkpoint")
    fmt(c)
    c.add_argument("--config", default=None,
                   help="a run config whose model block describes it (default: the config the checkpoint records)")
    fmt(command("from-hf", "a Hugging Face transformers checkpoint -> a consolidated checkpoint"))
    commands = ("to_full", "to_hf", "from_hf", "init_run", "to_megatron", "from_megatron")
    return p.parse_args([a.replace("_", "-") if a in commands else a for a in (argv or sys.argv[1:])])


STEPS = {
    "to-hf": "loading it, converting its tensors to Hugging Face names, verifying the tensor round trip and the "
             "logits, writing, then checking the written tokenizer and a greedy continuation",
    "from-hf": "loading it, converting its tensors to Megatron names, verifying the tensor round trip and the "
               "logits, writing",
}


def prepare_checks() -> None:
    """Start the one-process group that the checks build their Megatron model in, saying so first
    (on CPU, DeepSpeed loads its communication op there; ``init_single_process`` says when it
    compiles it, the first time)."""
    from megatron_multilevel.distributed import init_single_process

    print("preparing the checks: a one-process Megatron environment", flush=True)
    init_single_process()


def main(argv=None) -> int:
    from megatron_multilevel.compat import quiet_library_notices

    quiet_library_notices()  # before Megatron-Core builds a model: its known notices, dropped
    args = parse_args(argv)
    if args.command in STEPS:  # before the imports, which take seconds
        print(f"{args.command}: {args.source} -> {args.output}: {STEPS[args.command]}", flush=True)
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_multilevel.checkpoints import convert
    from megatron_multilevel.checkpoints.reshard import reshard

    try:
        if args.command == "to-full":
            convert.to_full(args.source, args.output, fmt=args.format, overwrite=args.overwrite)
        elif args.command == "reshard":
            reshard(args.source, args.output, target_tp=args.target_tp, num_gpus=args.num_gpus,
                    zero_stage=args.zero_stage, overwrite=args.overwrite, target_pp=args.target_pp)
        elif args.command == "coalesce":
            convert.coalesce_checkpoint(
                args.source, args.output, width=args.width, depth=args.depth, width_pairing=args.width_pairing,
                depth_pairing=args.depth_pairing, depth_scaling=args.depth_scaling,
                tensor_model_parallel_size=args.tensor_model_parallel_size, fmt=args.format, overwrite=args.overwrite)
        elif args.command == "decoalesce":
            convert.decoalesce_checkpoint(args.source, args.output, level_map=args.level_map, fmt=args.format,
                                          overwrite=args.overwrite)
        elif args.command == "interpolate":
            convert.interpolate_checkpoint(args.source, args.output, alpha=args.alpha, other=args.other,
                                           fmt=args.format, overwrite=args.overwrite)
        elif args.command == "to-hf":
            prepare_checks()
            convert.to_hf(args.source, args.output, overwrite=args.overwrite, tokenizer=args.tokenizer)
        elif args.command == "init-run":
            from megatron_multilevel.checkpoints.init_run import init_run

            init_run(args.source, args.config, args.output, num_gpus=args.num_gpus, overwrite=args.overwrite,
                     fresh_optimizer=args.fresh_optimizer, overrides=args.overrides)
        elif args.command in ("to-megatron", "from-megatron"):
            from megatron_multilevel.checkpoints import megatron_convert

            prepare_checks()
            if args.command == "to-megatron":
                megatron_convert.to_megatron(args.source, args.output, overwrite=args.overwrite,
                                             iteration=args.iteration, optimizer=args.optimizer,
                                             tokenizer=args.tokenizer)
            else:
                megatron_convert.from_megatron(args.source, args.output, config=args.config, fmt=args.format,
                                               overwrite=args.overwrite)
        else:
            prepare_checks()
            convert.from_hf(args.source, args.output, fmt=args.format, overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
