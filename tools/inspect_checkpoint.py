"""Show what a checkpoint holds: level, step, model shape, layout, groupings, parameters, checksums.

    python tools/inspect_checkpoint.py runs/gpt_tiny_cpu            # a run's latest checkpoint
    python tools/inspect_checkpoint.py runs/gpt_tiny_cpu/checkpoints/phase01-step0000100
    python tools/inspect_checkpoint.py out/gpt_full --json          # a consolidated checkpoint
    python tools/inspect_checkpoint.py runs/gpt_tiny_cpu --verify   # its files against their sizes and checksums

Safe on checkpoints from anywhere: DeepSpeed files are read with ``weights_only=True`` and an
allowlist of the classes they hold; a file that asks for anything else is refused, nothing in it runs.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def describe(path: str) -> dict:
    from megatron_multilevel.checkpoints.convert import load_source
    from megatron_multilevel.checkpoints.full import checksum
    from megatron_multilevel.level_maps import LayerSelection, LevelMap

    source = load_source(path)
    m = source.model
    maps = []
    for text in source.level_maps:
        lm = LevelMap.from_json(text)
        maps.append({
            "from": f"{lm.fine.num_layers} layers x {lm.fine.hidden_size}",
            "to": f"{lm.coarse.num_layers} layers x {lm.coarse.hidden_size}",
            "width": None if not lm.width else {k: lm.unit_groupings[k].structure for k in ("hidden", "ffn")}
            | {"query_groups": lm.query_groups.structure},
            "depth": None if not lm.depth else lm.layers.structure,
            "depth_scaling": lm.depth_scaling,
        })
    layout = {k: source.description[k] for k in ("tensor_model_parallel_size", "zero_stage") if k in source.description}
    if "phase" in source.description:
        layout["position"] = {k: source.description[k] for k in ("tag", "phase", "step", "global_step")}
    if source.description.get("selection"):  # a coarse phase of the ODE strategy
        selection = LayerSelection.from_json(source.description["selection"])
        layout["ode_selection"] = {"parity": selection.parity, "fine_layers": list(selection.layers),
                                   "fine_num_layers": selection.fine.num_layers,
                                   "residual_scale": selection.residual_scale,
                                   "parametrisation": selection.parametrisation, "text": selection.describe()}
    return {
        "path": os.path.abspath(path), "kind": source.description["kind"], "level": source.level,
        "model": {"kind": m.kind, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "num_attention_heads": m.num_attention_heads, "num_query_groups": m.num_query_groups,
                  "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size},
        **layout, "level_maps": maps,
        "parameters": sum(t.numel() for t in source.tensors.values()),
        "tensors": {n: {"shape": list(t.shape), "sha256": checksum(t)} for n, t in sorted(source.tensors.items())},
    }


def verify(path: str) -> tuple[bool, str]:
    """Whether the files of the run checkpoint at ``path`` (a checkpoint, or a run: its latest)
    have the sizes and CRC-32 its sidecar recorded, and a line saying so."""
    from megatron_multilevel.config.parsing import read_json_object
    from megatron_multilevel.training import manifest
    from megatron_multilevel.training.checkpoint import SIDECAR, checkpoint_dir, latest_tag

    latest = latest_tag(path)
    if latest is not None:
        path = os.path.join(checkpoint_dir(path), latest)
    sidecar = os.path.join(path, SIDECAR)
    if not os.path.exists(sidecar):
        raise ValueError(f"{path} is not a complete run checkpoint (no {SIDECAR}); --verify checks those")
    try:
        files = read_json_object(sidecar).get("files")
    except ValueError as e:
        return False, f"unreadable: {e}"
    if files is None:
        return True, f"{path}: written before checkpoints recorded their files; nothing to check"
    problem = manifest.problem(path, files)
    if problem:
        return False, f"damaged: {problem}"
    return True, f"{path}: {len(files)} files, {sum(size for size, _ in files.values()):,} bytes, all intact"


def main(argv=None) -> int:
    from megatron_multilevel.compat import quiet_library_notices

    quiet_library_notices()  # before Megatron-Core builds a model: its known notices, dropped
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.add_argument("--verify", action="store_true",
                   help="check the checkpoint's files against the sizes and CRC-32 recorded when it was written "
                        "(exit status 1 when one differs)")
    args = p.parse_args(argv)
    if args.verify:
        try:
            ok, line = verify(args.path)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(line)
        return 0 if ok else 1
    import warnings

    warnings.filterwarnings("ignore")
    try:
        info = describe(args.path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    m = info["model"]
    print(f"{info['path']} ({info['kind']})")
    print(f"level {info['level']}: {m['kind']}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
          f"{m['num_attention_heads']} heads ({m['num_query_groups']} query groups), FFN {m['ffn_hidden_size']}, "
          f"vocab {m['vocab_size']}; {info['parameters']:,} parameters")
    if "tensor_model_parallel_size" in info:
        print(f"layout: TP={info['tensor_model_parallel_size']}, ZeRO stage {info['zero_stage']}")
    if "position" in info:
        pos = info["position"]
        print(f"position: {pos['tag']} (phase {pos['phase']}, step {pos['step']}, global step {pos['global_step']})")
    if "ode_selection" in info:
        print(f"ODE strategy, coarse model: holds {info['ode_selection']['text']}")
    for i, lm in enumerate(info["level_maps"]):
        print(f"level map {i}: {lm['from']} -> {lm['to']}; width {lm['width']}, depth {lm['depth']}, "
              f"depth scaling {lm['depth_scaling']}")
    print("| tensor | shape | sha256 |\n|---|---|---|")
    for name, t in info["tensors"].items():
        print(f"| {name} | {tuple(t['shape'])} | {t['sha256']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
