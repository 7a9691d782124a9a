"""The conversions of ``tools/convert_checkpoint.py``; each verifies itself before it reports success.

A source is a run directory (its latest checkpoint), one checkpoint tag directory, or a
consolidated checkpoint (``to-full``'s output). Outputs are new directories, never edits in place.
"""

import dataclasses
import json
import os
from typing import Optional

import torch

from megatron_multilevel.checkpoints import megatron_dist, verify
from megatron_multilevel.checkpoints.deepspeed_reader import merge_tensor_parallel, open_checkpoint, rank_state_dicts
from megatron_multilevel.checkpoints.full import is_full, load_full, prepare_output, save_full
from megatron_multilevel.checkpoints.hf import (
    check_exportable, from_hf_state_dict, hf_logits, hf_model, hf_model_class, model_config_from_hf, to_hf_state_dict)
from megatron_multilevel.checkpoints.hf_generation import check_generation, write_tokenizer
from megatron_multilevel.config import DataConfig, ModelConfig, check_alpha, check_model_parallel
from megatron_multilevel.config.parsing import read_json_object
from megatron_multilevel.data.tokenizer import run_tokenizer_copy
from megatron_multilevel.level_maps import LayerSelection, LevelMap, make_level_map
from megatron_multilevel.ode_operators import fold_branch_multiplier, fold_step
from megatron_multilevel.operators import coalesce, decoalesce, interpolate
from megatron_multilevel.parallel.tp_layout import shard
from megatron_multilevel.plan import parameter_plan
from megatron_multilevel.training.safe_load import load_restricted, only_safe_globals

HF_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
HF_PICKLE, HF_PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class VerificationError(RuntimeError):
    """A conversion's own check failed; nothing is reported as converted."""


@dataclasses.dataclass
class Source:
    tensors: dict
    model: ModelConfig
    level: int
    level_maps: list
    description: dict
    rank_shards: Optional[list] = None  # per tensor-parallel rank, for a DeepSpeed source
    tokenizer: Optional[str] = None  # the tokenizer of its token ids, where one is known
    moments: dict = dataclasses.field(default_factory=dict)  # a torch_dist source's optimizer state
    optimizer_step: Optional[int] = None  # and its step count

    @property
    def selection(self) -> Optional[LayerSelection]:
        """The layer selection of a coarse model of the ODE strategy, else None."""
        text = self.description.get("selection")
        return LayerSelection.from_json(text) if text else None

    @property
    def step(self) -> int:
        """The step its forward pass takes: an explicit ODE coarse model's, else 1."""
        return verify.forward_step(self.description)

    def plain_tensors(self) -> dict:
        """Its tensors for a model that takes no step (transformers', a new run's), computing the same
        function: an explicit ODE coarse model's step folded into its weights."""
        return self.tensors if self.step == 1 else fold_step(self.tensors, self.selection)


def run_tokenizer(config: dict, run_dir: Optional[str] = None) -> Optional[str]:
    """The tokenizer a run trained with: the copy kept in its run directory (``run_dir``), else its
    config's, or the embedded corpus's, if it is on disk."""
    kept = run_tokenizer_copy(run_dir) if run_dir else None
    if kept:
        return kept
    data = config.get("data", {})
    path = data.get("tokenizer_model")
    if path is None:
        from megatron_multilevel.data.corpus import corpus_root

        vocab = config.get("model", {}).get("vocab_size")
        if vocab is None:
            return None
        path = str(corpus_root(data.get("cache_dir", DataConfig.cache_dir), vocab) / "tokenizer.model")
    return os.path.abspath(path) if os.path.exists(path) else None


def load_source(path: str, model: Optional[ModelConfig] = None) -> Source:
    """The checkpoint at ``path``: a consolidated one, a DeepSpeed run or tag directory of this
    project, or a Megatron-Core ``torch_dist`` checkpoint (read as a model of ``model``, by
    default the config it records)."""
    if not os.path.exists(path):
        raise ValueError(f"source {path!r} does not exist")
    if megatron_dist.is_torch_dist(path):
        ckpt = megatron_dist.read(path, model)
        for note in ckpt.notes:
            print(f"{path}: {note}")
        return Source(ckpt.tensors, ckpt.model, 0, [], {"kind": "megatron torch_dist", "path": os.path.abspath(path),
                                                      "iteration": ckpt.iteration},
                      tokenizer=ckpt.tokenizer, moments=ckpt.moments, optimizer_step=ckpt.step)
    if is_full(path):
        tensors, model, meta = load_full(path)
        ode = {k: meta["source"][k] for k in ("strategy", "selection") if meta.get("source", {}).get(k)}
        tokenizer = os.path.join(path, meta["tokenizer"]) if meta.get("tokenizer") else None
        return Source(tensors, model, meta.get("level", 0), meta.get("level_maps", []),
                      {"kind": "full", "path": os.path.abspath(path), **ode}, tokenizer=tokenizer)
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isdir(os.path.join(path, "checkpoints")):
        raise ValueError(f"{path} looks like a Hugging Face checkpoint; convert it with from-hf first")
    ckpt = open_checkpoint(path)
    shards = rank_state_dicts(ckpt)
    tensors = merge_tensor_parallel(shards, ckpt.model)
    state = ckpt.sidecar["state"]
    # The ODE strategy: which fine layers a coarse phase's model holds.
    ode = {k: ckpt.sidecar[k] for k in ("strategy", "selection") if ckpt.sidecar.get(k)}
    return Source(tensors, ckpt.model, ckpt.level, ckpt.sidecar["level_maps"],
                  {"kind": "deepspeed", "path": ckpt.path, "tag": ckpt.tag, "tensor_model_parallel_size": ckpt.tp,
                   "zero_stage": ckpt.zero_stage, "phase": state["phase"], "step": state["step"],
                   "global_step": state["global_step"], **ode}, shards,
                  tokenizer=run_tokenizer(ckpt.sidecar["config"], os.path.dirname(os.path.dirname(ckpt.path))))


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise VerificationError(f"verification failed: {what}")


def _check_round_trip(what: str, bad: list[str]) -> None:
    """Say whether a round trip gave back the same tensors bit for bit (``bad``: those it did not)."""
    print(f"round trip: {what} bit for bit: {'yes' if not bad else 'NO ' + str(bad[:4])}")
    _require(not bad, f"round trip {what}: tensors differ: {bad[:4]}")


def to_full(src: str, out: str, *, fmt: str = "safetensors", overwrite: bool = False) -> None:
    prepare_output(out, overwrite, src)
    source = load_source(src)
    tokens = verify.fixed_tokens(source.model)
    full_logits = verify.logits_full(source.tensors, source.model, tokens, step=source.step)
    if source.rank_shards is not None:
        plan = parameter_plan(source.model)
        tp = len(source.rank_shards)
        bad = [n for r, sd in enumerate(source.rank_shards) for n, t in sd.items()
               if not torch.equal(shard(source.tensors[n], plan.rule(n)[1], r, tp), t)]
        _check_round_trip(f"the full tensors, split again over {tp} tensor-parallel rank(s), equal the source shards",
                          bad)
        source_logits = (verify.logits_full(source.rank_shards[0], source.model, tokens, step=source.step) if tp == 1
                         else verify.logits_in_layout(source.rank_shards, source.model, tokens, step=source.step))
        _require(verify.compare([(f"source (TP={tp})", "consolidated (TP=1)", source_logits, full_logits)]),
                 "logits of the consolidated model differ from the source's")
    save_full(out, source.tensors, source.model, level=source.level, level_maps=source.level_maps,
              source=source.description, fmt=fmt, tokenizer=source.tokenizer)
    print(f"wrote {out}: {sum(t.numel() for t in source.tensors.values()):,} parameters, level {source.level}")


def coalesce_checkpoint(src: str, out: str, *, width: bool, depth: bool, width_pairing: str, depth_pairing: str,
                        depth_scaling: str, tensor_model_parallel_size: int, fmt: str, overwrite: bool) -> None:
    prepare_output(out, overwrite, src)
    source = load_source(src)
    lm = make_level_map(source.model, width=width, depth=depth, width_pairing=width_pairing,
                        depth_pairing=depth_pairing, depth_scaling=depth_scaling,
                        tensor_model_parallel_size=tensor_model_parallel_size)
    coarse = coalesce(source.tensors, lm)
    again = coalesce(decoalesce(coarse, lm), lm)
    _check_round_trip("coalesce(decoalesce(coarse)) == coarse", verify.mismatched(coarse, again))
    tokens = verify.fixed_tokens(source.model)
    coarse_logits = verify.logits_full(coarse, lm.coarse, tokens)
    rows = [("source (fine)", "coalesced (coarse)", verify.logits_full(source.tensors, source.model, tokens),
             coarse_logits),
            ("coalesced (coarse)", "its de-coalesced fine model", coarse_logits,
             verify.logits_full(decoalesce(coarse, lm), lm.fine, tokens))]
    # Width de-coalescing preserves the function; depth de-coalescing and coalescing do not.
    _require(verify.compare(rows, required=[False, not depth]), "width de-coalescing changed the logits")
    save_full(out, coarse, lm.coarse, level=source.level + 1, level_maps=source.level_maps + [lm.to_json()],
              source={**source.description, "operation": "coalesce"}, fmt=fmt, tokenizer=source.tokenizer)
    with open(os.path.join(out, "level_map.json"), "w") as f:
        f.write(lm.to_json())
    print(f"wrote {out}: {lm.coarse.num_layers} layers, hidden {lm.coarse.hidden_size} (grouping in level_map.json)")


def decoalesce_checkpoint(src: str, out: str, *, level_map: Optional[str], fmt: str, overwrite: bool) -> None:
    prepare_output(out, overwrite, src)
    source = load_source(src)
    if source.selection is not None:
        raise ValueError(f"{src} is a coarse model of the ODE strategy ({source.selection.describe()}); it is "
                         f"not de-coalesced: the run writes its change back into the fine model it was restricted "
                         f"from")
    if level_map is not None:
        with open(level_map) as f:
            lm = LevelMap.from_json(f.read())
        maps = source.level_maps
    else:
        # the most recent grouping that coarsens to this checkpoint's model
        fits = [i for i, text in enumerate(source.level_maps) if LevelMap.from_json(text).coarse == source.model]
        if not fits:
            raise ValueError(f"{src} records no level map that coarsens to its model; pass --level-map with the "
                             f"grouping it was coalesced with")
        lm = LevelMap.from_json(source.level_maps[fits[-1]])
        maps = source.level_maps[: fits[-1]] + source.level_maps[fits[-1] + 1 :]
    if lm.coarse != source.model:
        raise ValueError("the level map does not match the checkpoint: it coarsens to "
                         f"{lm.coarse.num_layers} layers x {lm.coarse.hidden_size}, the checkpoint has "
                         f"{source.model.num_layers} x {source.model.hidden_size}")
    fine = decoalesce(source.tensors, lm)
    _check_round_trip("coalesce(decoalesce(x)) == x", verify.mismatched(coalesce(fine, lm), source.tensors))
    tokens = verify.fixed_tokens(source.model)
    rows = [("source (coarse)", "de-coalesced (fine)", verify.logits_full(source.tensors, source.model, tokens),
             verify.logits_full(fine, lm.fine, tokens))]
    _require(verify.compare(rows, required=[not lm.depth]), "width de-coalescing changed the logits")
    save_full(out, fine, lm.fine, level=max(0, source.level - 1), level_maps=maps,
              source={**source.description, "operation": "decoalesce"}, fmt=fmt, tokenizer=source.tokenizer)
    print(f"wrote {out}: {lm.fine.num_layers} layers, hidden {lm.fine.hidden_size}")


def interpolate_checkpoint(src: str, out: str, *, alpha: float, other: str, fmt: str, overwrite: bool) -> None:
    """``(1 - alpha) * other + alpha * src`` (``other``: the model before coalescing)."""
    check_alpha(alpha, "--alpha")
    prepare_output(out, overwrite, src, other)
    a, b = load_source(src), load_source(other)
    if a.model != b.model:
        raise ValueError("interpolate: the two checkpoints are of different models")
    mixed = interpolate(b.tensors, a.tensors, alpha)
    ends = not verify.mismatched(interpolate(b.tensors, a.tensors, 0.0), b.tensors) and not verify.mismatched(
        interpolate(b.tensors, a.tensors, 1.0), a.tensors)
    print(f"endpoints: alpha 0 gives --with, alpha 1 gives the source, bit for bit: {'yes' if ends else 'NO'}")
    _require(ends, "interpolation endpoints are not exact")
    tokens = verify.fixed_tokens(a.model)
    la, lb, lm_ = (verify.logits_full(t, a.model, tokens) for t in (a.tensors, b.tensors, mixed))
    verify.compare([("--with", f"alpha {alpha}", lb, lm_), ("source", f"alpha {alpha}", la, lm_)], required=[False, False])
    save_full(out, mixed, a.model, level=a.level, level_maps=a.level_maps,
              source={"operation": "interpolate", "alpha": alpha, "source": a.description, "with": b.description},
              fmt=fmt, tokenizer=a.tokenizer or b.tokenizer)
    print(f"wrote {out}")


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging
    except ImportError:
        raise ValueError("to-hf and from-hf need transformers: pip install 'megatron-multilevel[hf]'") from None

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _progress(i: int, n: int, what: str) -> None:
    """One line per stage of a conversion (each takes seconds to minutes, silently)."""
    print(f"[{i}/{n}] {what}", flush=True)


def to_hf(src: str, out: str, *, overwrite: bool, tokenizer: Optional[str] = None) -> None:
    """Write a ``transformers`` model and, with it, its tokenizer: ``tokenizer`` (a SentencePiece model
    or a Hugging Face tokenizer directory), else the one the source records."""
    _quiet_transformers()
    _progress(1, 5, f"loading {src}")
    source = load_source(src)
    check_exportable(source.model)
    tokenizer = tokenizer or source.tokenizer
    if tokenizer is not None and not os.path.exists(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer!r} does not exist")
    prepare_output(out, overwrite, src)
    _progress(2, 5, "converting its tensors to Hugging Face names and back")
    # the plain model of the same function: an ODE step and a depth-muP multiplier folded in
    cfg = dataclasses.replace(source.model, depth_mup_base_layers=None)
    tensors = fold_branch_multiplier(source.plain_tensors(), source.model)
    hf_sd = to_hf_state_dict(tensors, cfg)
    _check_round_trip("Megatron -> Hugging Face -> Megatron tensors",
                      verify.mismatched(from_hf_state_dict(hf_sd, cfg), tensors))
    _progress(3, 5, "building both models and comparing their logits")
    model = hf_model(cfg, hf_sd)
    tokens = verify.fixed_tokens(cfg)
    rows = [("Megatron (source)", f"transformers {type(model).__name__}",
             verify.logits_full(source.tensors, source.model, tokens, step=source.step),
             hf_logits(model, cfg, tokens).float())]
    _require(verify.compare(rows), "the Hugging Face model's logits differ")
    _progress(4, 5, f"writing {out}")
    model.save_pretrained(out)
    if tokenizer is None:
        print(f"wrote {out} ({type(model).__name__}) without a tokenizer: the source records none; pass --tokenizer")
        return
    _progress(5, 5, "writing the tokenizer and checking a greedy continuation")
    write_tokenizer(tokenizer, out)
    check_generation(out, tensors, cfg, tokenizer)
    print(f"wrote {out} ({type(model).__name__} and its tokenizer)")


def hf_pickled_weights(src: str, config: dict) -> list[str]:
    """The torch pickles of the Hugging Face model ``src`` (its ``config.json`` holds ``config``) that
    ``from_pretrained`` reads: none where it has safetensors (preferred), else ``pytorch_model.bin``
    or the shards its index names."""
    named = config.get("transformers_weights")  # read by transformers instead of any other file
    if named is not None:
        names = [named]
    elif any(os.path.isfile(os.path.join(src, name)) for name in HF_SAFETENSORS):
        return []
    elif os.path.isfile(os.path.join(src, HF_PICKLE)):
        names = [HF_PICKLE]
    elif os.path.isfile(os.path.join(src, HF_PICKLE_INDEX)):
        shards = read_json_object(os.path.join(src, HF_PICKLE_INDEX)).get("weight_map")
        names = sorted(set(shards.values())) if isinstance(shards, dict) else [None]
    else:
        raise ValueError(f"{src} holds no weights transformers reads ({', '.join(HF_SAFETENSORS)}, {HF_PICKLE}, "
                         f"{HF_PICKLE_INDEX})")
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise ValueError(f"{src}: its config or index names the weights file {name!r}, not a file inside it")
    return [os.path.join(src, name) for name in names if not name.endswith((".safetensors", ".safetensors.index.json"))]


def from_hf(src: str, out: str, *, fmt: str, overwrite: bool) -> None:
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"{src} is not a Hugging Face checkpoint directory (no config.json)")
    pickled = hf_pickled_weights(src, read_json_object(os.path.join(src, "config.json")))
    prepare_output(out, overwrite, src)
    _quiet_transformers()
    from transformers import AutoConfig

    _progress(1, 4, f"loading {src}")
    for path in pickled:  # transformers reads them with weights_only too, but only refuses in a traceback
        load_restricted(path, (), "a Hugging Face model's weights", mmap=True)
    hf_cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    with only_safe_globals(()):
        model = hf_model_class(hf_cfg.model_type).from_pretrained(
            src, local_files_only=True, use_safetensors=not pickled).eval()
    hf_sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    cfg = model_config_from_hf(hf_cfg, hf_sd)
    _progress(2, 4, "converting its tensors to Megatron names and back")
    tensors = from_hf_state_dict(hf_sd, cfg)
    back = to_hf_state_dict(tensors, cfg)
    bad = [k for k in back if k in hf_sd and not torch.equal(back[k], hf_sd[k])]
    _check_round_trip("Hugging Face -> Megatron -> Hugging Face tensors", bad)
    _progress(3, 4, "building the Megatron model and comparing the logits")
    tokens = verify.fixed_tokens(cfg)
    rows = [(f"transformers {type(model).__name__} (source)", "Megatron", hf_logits(model, cfg, tokens).float(),
             verify.logits_full(tensors, cfg, tokens))]
    _require(verify.compare(rows), "the Megatron model's logits differ")
    from megatron_multilevel.data.tokenizer import HF_TOKENIZER_FILES

    has_tokenizer = any(os.path.isfile(os.path.join(src, f)) for f in HF_TOKENIZER_FILES)
    _progress(4, 4, f"writing {out}")
    save_full(out, tensors, cfg, source={"kind": "huggingface", "path": os.path.abspath(src),
                                         "model_type": hf_cfg.model_type}, fmt=fmt,
              tokenizer=src if has_tokenizer else None)
    with open(os.path.join(out, "model_config.json"), "w") as f:
        json.dump({"model": dataclasses.asdict(cfg)}, f, indent=1)
    print(f"wrote {out}: {cfg.num_layers} layers, hidden {cfg.hidden_size}; model block in model_config.json")


def check_target_tp(cfgs: list[ModelConfig], tp: int) -> None:
    for level, cfg in enumerate(cfgs):
        try:
            check_model_parallel(cfg, tp)
        except ValueError as e:
            raise ValueError(f"--target-tp {tp} cannot hold level {level}: {e}") from None
