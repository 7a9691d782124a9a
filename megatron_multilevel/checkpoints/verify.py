"""Self-checks of checkpoint conversions: exact tensor round trips and logits on a fixed input."""

import json
import os
import shutil
from typing import Optional

import torch

from megatron_multilevel.config import ModelConfig, RunConfig, config_to_dict
from megatron_multilevel.config.parsing import parse_dataclass
from megatron_multilevel.distributed import init_single_process, set_tensor_model_parallel_size
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.models import build_model, load_parameters, model_logits
from megatron_multilevel.training.pipeline import PipelineStep
from megatron_multilevel.parallel.spawn import run_ranks
from megatron_multilevel.residual_step import set_residual_step

# Logits of the same weights computed two ways agree to float rounding; anything above this is a
# conversion error, not rounding.
LOGITS_TOLERANCE = 1e-4


def fixed_tokens(cfg: ModelConfig) -> torch.Tensor:
    seq = min(16, cfg.max_sequence_length)
    return torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1234))


def forward_step(description: dict) -> int:
    """The step a checkpoint's forward pass takes, from its sidecar (or a consolidated checkpoint's
    description): an ODE coarse model's in the explicit parametrisation (its ``selection``), else 1."""
    text = description.get("selection")
    return LayerSelection.from_json(text).forward_step if text else 1


def single_process_model(tensors: dict, cfg: ModelConfig, *, step: float = 1) -> torch.nn.Module:
    """A TP=1 Megatron model of ``cfg`` holding the full ``tensors``, in this process, in eval mode;
    ``step``: the forward step of an ODE coarse model in the explicit parametrisation (1: none)."""
    init_single_process()
    set_tensor_model_parallel_size(1)
    model = build_model(cfg, perform_initialization=False)
    load_parameters(model, tensors)
    return set_residual_step(model, step * cfg.branch_multiplier).eval()


def logits_full(tensors: dict, cfg: ModelConfig, tokens: torch.Tensor, *, step: float = 1) -> torch.Tensor:
    """Logits of full tensors in a TP=1 Megatron model (taking ``step``), in this process."""
    model = single_process_model(tensors, cfg, step=step)
    with torch.no_grad():
        return model_logits(model, cfg, tokens).float()


def gathered_logits(model, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a tensor-parallel model, gathered over the vocabulary shards (collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model.eval()
    with torch.no_grad():
        if ps.get_pipeline_model_parallel_world_size() > 1:  # through the stages, on every stage
            local = PipelineStep(cfg, tokens.shape[1], tokens.shape[0]).logits(model, tokens)
        else:
            local = model_logits(model, cfg, tokens).float().contiguous()
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)  # tp x (b, s, vocab / tp) -> (b, s, vocab), the ranks' shards in order


def _layout_worker(rank, world, shards, model_dict, tokens, step):
    cfg = parse_dataclass(ModelConfig, model_dict, "model")
    model = build_model(cfg, perform_initialization=False)
    load_parameters(model, shards[rank])
    return gathered_logits(set_residual_step(model, step * cfg.branch_multiplier), cfg, tokens)


def logits_in_layout(shards: list[dict], cfg: ModelConfig, tokens: torch.Tensor, *, step: float = 1) -> torch.Tensor:
    """Logits of per-rank shards in their own tensor-parallel layout (one process per rank), the
    model taking ``step`` as :func:`logits_full`."""
    import dataclasses

    tp = len(shards)
    return run_ranks(_layout_worker, tp, shards, dataclasses.asdict(cfg), tokens, step,
                     tensor_model_parallel_size=tp)[0]


def compare(rows: list[tuple[str, str, torch.Tensor, torch.Tensor]], *, required: Optional[list[bool]] = None) -> bool:
    """Print a table comparing logits; True if every required row agrees within the tolerance."""
    print("| source | target | max abs diff | mean abs diff | same top-1 |")
    print("|---|---|---|---|---|")
    ok = True
    for i, (a_name, b_name, a, b) in enumerate(rows):
        diff = (a - b).abs()
        top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        needed = required[i] if required is not None else True
        good = diff.max().item() <= LOGITS_TOLERANCE
        ok &= good or not needed
        note = "" if needed else " (information)"
        print(f"| {a_name} | {b_name} | {diff.max().item():.2e}{note} | {diff.mean().item():.2e} | {top1:.1%} |")
    return ok


def finish_run(out: str, cfg: RunConfig, rows: list[tuple[str, str, torch.Tensor, torch.Tensor]], what: str) -> None:
    """Keep the run directory ``out`` only if its logits agree: compare ``rows`` (as ``compare``);
    if they agree, write the run's ``config.json`` (the file to launch it with), else remove ``out``
    and raise ``RuntimeError("verification failed: <what>")``."""
    if not compare(rows):
        shutil.rmtree(out, ignore_errors=True)
        raise RuntimeError(f"verification failed: {what}")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config_to_dict(cfg), f, indent=1)


def mismatched(a: dict, b: dict) -> list[str]:
    """Names whose tensors are not bit-identical (or that one side lacks)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]
