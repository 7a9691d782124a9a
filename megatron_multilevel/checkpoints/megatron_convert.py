"""``to-megatron`` and ``from-megatron`` of ``tools/convert_checkpoint.py``: this project's
checkpoints to Megatron-Core ``torch_dist`` (Megatron-LM's save layout) and back, each verified
before it reports success (``megatron_dist`` holds the format)."""

import dataclasses
import os
import shutil
from typing import Optional

import torch

from megatron_multilevel.checkpoints import megatron_dist, verify
from megatron_multilevel.checkpoints.convert import VerificationError, load_source
from megatron_multilevel.checkpoints.deepspeed_reader import open_checkpoint
from megatron_multilevel.checkpoints.full import prepare_output, save_full
from megatron_multilevel.checkpoints.reshard import state_worker
from megatron_multilevel.config import load_config
from megatron_multilevel.config.parsing import read_json_object
from megatron_multilevel.ode_operators import fold_branch_multiplier
from megatron_multilevel.parallel.spawn import run_ranks


def _optimizer_state(path: str) -> tuple[dict, Optional[int]]:
    """The optimizer state of a DeepSpeed checkpoint of this project (full tensors per state key)
    and its step, read in the layout it was written in (one process per rank of that layout)."""
    ckpt = open_checkpoint(path)
    sidecar = ckpt.sidecar
    run_dir = os.path.dirname(os.path.dirname(ckpt.path))
    read = run_ranks(state_worker, sidecar["world_size"], sidecar["config"], os.path.abspath(run_dir),
                     [(ckpt.tag, sidecar["state"])], tensor_model_parallel_size=ckpt.tp)[0][0]
    return read["moments"], read["step"] or None


def to_megatron(src: str, out: str, *, overwrite: bool, iteration: Optional[int] = None,
                optimizer: bool = True, tokenizer: Optional[str] = None) -> None:
    """Write the model of ``src`` (any checkpoint of this project, at any level) and, from a
    DeepSpeed checkpoint, its optimizer state as a ``torch_dist`` checkpoint ``out``; read it
    back through Megatron-Core's loading and compare logits and state before reporting success."""
    source = load_source(src)
    tokenizer = tokenizer or source.tokenizer
    if tokenizer is not None and not os.path.exists(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer!r} does not exist")
    prepare_output(out, overwrite, src)
    moments, step = {}, None
    if optimizer and source.description.get("kind") == "deepspeed" and source.step == 1:
        print("reading the optimizer state in the layout it was written in", flush=True)
        moments, step = _optimizer_state(source.description["path"])
    if iteration is None:
        iteration = int(source.description.get("global_step") or 0)
    notes = megatron_dist.write(out, source.plain_tensors(), source.model, iteration=iteration, moments=moments,
                                step=step, tokenizer=tokenizer, source=source.description)
    try:
        back = megatron_dist.read(out, source.model)
        tokens = verify.fixed_tokens(source.model)
        rows = [("source", "torch_dist, loaded by Megatron-Core (TP=1)",
                 verify.logits_full(source.tensors, source.model, tokens, step=source.step),
                 verify.logits_full(back.tensors, back.model, tokens))]
        if not verify.compare(rows):
            raise VerificationError("verification failed: the torch_dist checkpoint computes other logits")
        if moments and not notes:  # written (a depth-muP model's is not: the notes say so)
            bad = [f"{key}.{name}" for key, tensors in moments.items() for name, t in tensors.items()
                   if not torch.equal(t.float(), back.moments[key][name])]
            if bad or back.step != step:
                raise VerificationError(f"verification failed: the optimizer state read back differs ({bad[:4]}, "
                                        f"step {back.step} for {step})")
            print(f"optimizer state {', '.join(moments)} at step {step}: read back exactly")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    for note in notes:
        print(note)
    print(f"wrote {out}: iteration {iteration}"
          + ("" if tokenizer is None else f", tokenizer {os.path.basename(tokenizer)}")
          + "; Megatron-LM reads it with --ckpt-format torch_dist --load " + out + " and "
          + " ".join(f.split("  #")[0] for f in megatron_dist.megatron_flags(source.model)))


def from_megatron(src: str, out: str, *, config: Optional[str], fmt: str, overwrite: bool) -> None:
    """A ``torch_dist`` checkpoint (any layout) -> one consolidated checkpoint of this project, its
    model as ``config``'s model block says (default: the config the checkpoint records)."""
    model = None
    if config is not None:
        model = load_config(read_json_object(config)).model
    prepare_output(out, overwrite, src)
    source = load_source(src, model)
    save_full(out, source.tensors, source.model, source=source.description, fmt=fmt, tokenizer=source.tokenizer)
    try:  # the consolidated checkpoint as a run loads it, against the model Megatron-Core loaded (its plain one)
        written = load_source(out)
        plain = dataclasses.replace(source.model, depth_mup_base_layers=None)
        tokens = verify.fixed_tokens(source.model)
        rows = [("torch_dist", "loaded by Megatron-Core (TP=1), against the consolidated checkpoint",
                 verify.logits_full(fold_branch_multiplier(source.tensors, source.model), plain, tokens),
                 verify.logits_full(written.tensors, written.model, tokens, step=written.step))]
        if not verify.compare(rows):
            raise VerificationError("verification failed: the consolidated checkpoint computes other logits than "
                                    "the torch_dist checkpoint")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    print(f"wrote {out}: {source.model.num_layers} layers, hidden {source.model.hidden_size}"
          + ("" if not source.moments else f" (its optimizer state, {', '.join(source.moments)}, is not kept in a "
             "consolidated checkpoint; init-run reads it from the torch_dist checkpoint itself)"))
