"""Time and memory of a V-cycle transition on a GPT-Base-shaped model (124M parameters, fp32).

Run (spawns its own ranks; on a GPU node use the same command):

    python tools/benchmark_transition.py                 # 2 ranks, both paths
    python tools/benchmark_transition.py --layers 4      # a smaller model, quicker
    python tools/benchmark_transition.py --paths streaming --vocab 50304 256000

For each path it prints, per rank: the coarsen and prolong times, the peak memory the transition
added (the new level's model included), its transient part (the peak beyond what the transition
leaves behind: the new model and the fine snapshot), in MiB and in full fine layers, and the
floors a user compares with: a plain clone of the rank's own parameters (memory bandwidth), the
rank's share of the model, one layer in full, and the word embedding in full.

- fast path: TP=2 at both levels, shard-local groupings, ZeRO-0: each rank maps its own shards.
- streaming: DP=2 with ZeRO-3: parameters gathered, projected and re-partitioned layer by layer,
  the word embedding and output layer slab by slab of vocabulary rows.
- tp-change (``--paths tp-change``): TP=2 to TP=1 under ZeRO-1, groupings for both TP sizes.
"""

import argparse
import ctypes
import functools
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> int:
    """Free unreachable objects (the previous repeat's engines hold reference cycles), return freed
    heap to the OS and reset the peak-RSS counter; returns the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def tensor_bytes(module) -> int:
    total = 0
    for p in module.parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p
        total += t.numel() * t.element_size()
    return total


def run_path(name, cfg, fine_layout, coarse_layout, repeats):
    import deepspeed
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.models import build_model
    from megatron_multilevel.parallel.mpu import mpu
    from megatron_multilevel.parallel.transition import coarsen, prolong
    from megatron_multilevel.training.engines import build_empty_model

    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": fine_layout.zero_stage},
        "steps_per_print": 10**9,
    }
    set_tensor_model_parallel_size(fine_layout.tensor_model_parallel_size)
    set_seed(0)
    # The groupings a run makes for these two layouts (``level_maps.run_level_maps``).
    lm = make_level_map(cfg, tensor_model_parallel_size=fine_layout.tensor_model_parallel_size,
                        coarse_tensor_model_parallel_size=coarse_layout.tensor_model_parallel_size)
    if fine_layout.zero_stage == 3:
        with deepspeed.zero.Init(data_parallel_group=ps.get_data_parallel_group(), config_dict_or_path=ds_config, mpu=mpu):
            model = build_model(cfg)
    else:
        model = build_model(cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu)
    own = tensor_bytes(engine.module)

    # Floor: a plain clone of this rank's own parameters.
    params = [p.ds_tensor if hasattr(p, "ds_tensor") else p.data for p in engine.module.parameters()]
    clone_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copies = [t.clone() for t in params]
        clone_times.append(time.perf_counter() - t0)
        del copies

    # Floor of the streaming path: the rank's own parameters through one all-gather (the least
    # communication that assembles the whole model once).
    flat = torch.cat([t.reshape(-1) for t in params])
    gather_times = []
    for _ in range(repeats):
        out = flat.new_empty(flat.numel() * dist.get_world_size())
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, flat)
        gather_times.append(time.perf_counter() - t0)
        del out
    del flat

    rows = []
    for _ in range(repeats):
        dist.barrier()
        base = reset_peak()
        t0 = time.perf_counter()
        staged, before = coarsen(engine.module, lm, fine_layout=fine_layout, coarse_layout=coarse_layout,
                                 build_target=functools.partial(build_empty_model, lm.coarse, coarse_layout, ds_config))
        t_coarsen = time.perf_counter() - t0
        peak_coarsen = rss_bytes("VmHWM") - base
        coarse_model = staged.model
        dist.barrier()
        base = reset_peak()
        t0 = time.perf_counter()
        fine = prolong(coarse_model, before, lm, 0.5, coarse_layout=coarse_layout, fine_layout=fine_layout,
                       build_target=functools.partial(build_empty_model, lm.fine, fine_layout, ds_config))
        t_prolong = time.perf_counter() - t0
        peak_prolong = rss_bytes("VmHWM") - base
        # The transient part: the peak beyond what the transition leaves (the new model; coarsening also
        # the fine snapshot).
        transient_coarsen = peak_coarsen - tensor_bytes(coarse_model) - before.params.local_bytes()
        transient_prolong = peak_prolong - tensor_bytes(fine.model)
        rows.append((t_coarsen, t_prolong, peak_coarsen, peak_prolong, tensor_bytes(coarse_model),
                     before.params.local_bytes(), tensor_bytes(fine.model), transient_coarsen, transient_prolong))
        del staged, before, fine, coarse_model
        set_tensor_model_parallel_size(fine_layout.tensor_model_parallel_size)
    layer = sum(p.numel() for n, p in build_layer_shapes(cfg)) * 4
    return dict(path=name, own=own, clone=min(clone_times), gather=min(gather_times), rows=rows, layer=layer,
                embedding=cfg.vocab_size * cfg.hidden_size * 4)


def build_layer_shapes(cfg):
    """(name, tensor) of one full fine layer, for its size."""
    from megatron_multilevel.plan import parameter_plan

    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    shapes = {
        "qkv.w": (qkv, h), "qkv.b": (qkv,), "proj.w": (h, cfg.num_attention_heads * cfg.kv_channels),
        "proj.b": (h,), "fc1.w": (f, h), "fc1.b": (f,), "fc2.w": (h, f), "fc2.b": (h,),
        "ln1.w": (h,), "ln1.b": (h,), "ln2.w": (h,), "ln2.b": (h,),
    }
    assert parameter_plan(cfg)
    return [(n, torch.empty(s, device="meta")) for n, s in shapes.items()]


PATHS = {
    "fast": ("fast path (TP=2, ZeRO-0)", (2, 0), (2, 0)),
    "streaming": ("streaming (DP=2, ZeRO-3)", (1, 3), (1, 3)),
    "tp-change": ("TP 2 -> 1 (ZeRO-1)", (2, 1), (1, 1)),
}


def worker(rank, world, args):
    from megatron_multilevel.config import ModelConfig
    from megatron_multilevel.parallel.staging import Layout

    results = []
    for vocab in args.vocab:
        # vocab 512 isolates the layer stream: GPT-2's word embedding alone is 5.5 layers.
        cfg = ModelConfig(num_layers=args.layers, hidden_size=768, num_attention_heads=12, vocab_size=vocab,
                          max_sequence_length=1024)
        for path in args.paths:
            name, fine, coarse = PATHS[path]
            results.append(run_path(f"{name}, vocab {vocab}", cfg, Layout(*fine), Layout(*coarse), args.repeats))
    return results


def report(results_by_rank, args):
    mib = 2**20
    print(f"GPT-Base shape: {args.layers} layers, hidden 768, 12 heads, fp32, 2 ranks (gloo on CPU, NCCL on GPU); "
          f"best of {args.repeats}; rank 0 (rank 1 alike); transient: the larger of the two ranks")
    print()
    print("| path | coarsen s | prolong s | clone own params s | all-gather own params s | coarsen / clone "
          "| prolong / clone | peak extra coarsen MiB | peak extra prolong MiB | transient coarsen MiB (layers) "
          "| transient prolong MiB (layers) | new coarse model MiB | fine snapshot MiB | new fine model MiB "
          "| own params MiB | one layer MiB | word embedding MiB |")
    print("|" + "---|" * 17)
    for i, r in enumerate(results_by_rank[0]):
        rows = r["rows"]
        tc, tp = min(x[0] for x in rows), min(x[1] for x in rows)
        pc, pp = min(x[2] for x in rows), min(x[3] for x in rows)
        # Each rank's best repeat, then the worse rank.
        per_rank = [[min(x[k] for x in ranks[i]["rows"]) for ranks in results_by_rank] for k in (7, 8)]
        trc, trp = (max(by_rank) for by_rank in per_rank)
        print(f"  transient coarsen / prolong MiB by rank: {[[v / mib for v in by_rank] for by_rank in per_rank]}",
              file=sys.stderr)
        coarse_b, snap_b, fine_b = rows[0][4], rows[0][5], rows[0][6]
        print(f"| {r['path']} | {tc:.2f} | {tp:.2f} | {r['clone']:.3f} | {r['gather']:.3f} "
              f"| {tc / r['clone']:.1f}x | {tp / r['clone']:.1f}x | {pc / mib:.0f} | {pp / mib:.0f} "
              f"| {trc / mib:.0f} ({trc / r['layer']:.1f}) | {trp / mib:.0f} ({trp / r['layer']:.1f}) "
              f"| {coarse_b / mib:.0f} | {snap_b / mib:.0f} | {fine_b / mib:.0f} | {r['own'] / mib:.0f} "
              f"| {r['layer'] / mib:.0f} | {r['embedding'] / mib:.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab", type=int, nargs="+", default=[50304, 512])
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["fast", "streaming"])
    args = parser.parse_args()
    from megatron_multilevel.parallel.spawn import run_ranks

    # Large allocations are mmapped and returned on free, so that resident memory tracks the live
    # tensors (glibc's default keeps freed blocks of up to 32 MiB in the heap).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    report(run_ranks(worker, 2, args), args)

if __name__ == "__main__":
    main()
