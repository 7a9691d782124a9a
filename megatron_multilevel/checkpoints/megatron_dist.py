"""Megatron-Core distributed checkpoints (``torch_dist``) in and out.

Megatron-LM saves ``DIR/iter_0000100/`` (a ``megatron.core.dist_checkpointing`` directory) and
``DIR/latest_checkpointed_iteration.txt``. Inside, the model's sharded state dict is stored under
Megatron-Core's own keys (``decoder.layers.self_attention.linear_qkv.weight``: every layer stacked
along a leading axis, fused names whatever the layer spec), each tensor with its global shape:
that is what lets any tensor or pipeline layout load it. The optimizer's state, where present,
is ``optimizer.state.<exp_avg|exp_avg_sq|...>.<model key>`` (the layout of Megatron-Core's
reshardable optimizer formats), its master weights ``optimizer.state.fp32_param`` (or ``param``).

Nothing here names a key or a shard by hand: a one-rank TP=1 Megatron-Core model of the config says,
through its own ``sharded_state_dict()``, what to read and write, ``dist_checkpointing.load`` /
``save`` do the rest (any source layout is read as full tensors), and the optimizer's entries are
made by Megatron-Core's ``optim_state_to_sharding_state`` from a torch optimizer holding the state,
as its ``FP32Optimizer`` does. A depth-muP model's branch multiplier, which Megatron-Core's layers
do not have, is folded into the branch outputs on the way out and taken out on the way in, so both
sides compute the same function; its optimizer state does not cross (the parametrisations differ).
Its pickles are read through ``safe_dist``, which runs nothing a checkpoint names.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import tempfile
from typing import Optional

import torch

from megatron_multilevel.checkpoints import safe_dist
from megatron_multilevel.config import ModelConfig
from megatron_multilevel.config.parsing import parse_dataclass, read_json_object
from megatron_multilevel.data.tokenizer import keep_tokenizer, run_tokenizer_copy
from megatron_multilevel.distributed import init_single_process, set_tensor_model_parallel_size
from megatron_multilevel.models import build_model, load_parameters
from megatron_multilevel.ode_operators import fold_branch_multiplier, unfold_branch_multiplier

LATEST_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's
INFO_FILE = "megatron_multilevel.json"  # ours, beside it: the model config and the flags Megatron-LM needs
# the fp32 master weights of a 16-bit run (Float16Optimizer's, the distributed optimizer's)
MASTER_KEYS = ("fp32_param", "param")
# Muon's state is a momentum for the layers' matrices and Adam's moments for the rest; Megatron-Core
# saves its own Muon as a ChainedOptimizer, each sub-optimizer's state under ``chained_<i>.``, the
# split into sub-optimizers its own (``get_megatron_muon_optimizer``): nothing here could say which
# index a Megatron-LM run would give each parameter, so the state is not written
MUON_NOT_WRITTEN = ("optimizer state not written: Muon's (momentum_buffer for the layers' matrices, exp_avg and "
                    "exp_avg_sq for the rest) has no place in this format; Megatron-Core keeps its own Muon as a "
                    "chained optimizer whose split this converter cannot reproduce")


@dataclasses.dataclass
class MegatronCheckpoint:
    tensors: dict  # full tensors by this project's (the model's state-dict) names
    model: ModelConfig
    iteration: Optional[int]
    moments: dict  # {state key: {name: full tensor}}; empty without an optimizer state
    step: Optional[int]  # the optimizer's step count (None: unknown, and then no moments)
    notes: list  # what was not carried, one line each
    tokenizer: Optional[str]  # the tokenizer kept beside it, where one is


def iteration_dir(path: str) -> tuple[str, Optional[int]]:
    """The ``dist_checkpointing`` directory of ``path`` and its iteration: a Megatron-LM save
    directory (its latest iteration) or one iteration's directory."""
    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            text = f.read().strip()
        if text == "release":
            return os.path.join(path, "release"), None
        if not text.isdigit():
            raise ValueError(f"{latest} holds {text!r}, not an iteration number or 'release'")
        return os.path.join(path, f"iter_{int(text):07d}"), int(text)
    match = re.fullmatch(r"iter_(\d+)", os.path.basename(os.path.normpath(path)))
    return path, int(match.group(1)) if match else None


def is_torch_dist(path: str) -> bool:
    """Whether ``path`` is a ``torch_dist`` checkpoint (a save directory or one iteration's); a
    ``metadata.json`` that is no JSON object of a few MB is a ``ValueError``."""
    try:
        directory, _ = iteration_dir(path)
    except (OSError, ValueError):
        return False
    config = os.path.join(directory, "metadata.json")
    return os.path.isfile(config) and read_json_object(config).get("sharded_backend") == "torch_dist"


def _save_root(path: str) -> str:
    """The save directory of ``path`` (where ``INFO_FILE`` and the tokenizer lie)."""
    return path if os.path.isfile(os.path.join(path, LATEST_FILE)) else os.path.dirname(os.path.normpath(path))


def _single_process_model(cfg: ModelConfig) -> torch.nn.Module:
    """A TP=1 Megatron-Core model of ``cfg`` without depth-muP's multiplier, uninitialised."""
    init_single_process()
    set_tensor_model_parallel_size(1)
    return build_model(dataclasses.replace(cfg, depth_mup_base_layers=None), perform_initialization=False)


def _sharded_tensors(model: torch.nn.Module) -> dict:
    """The model's sharded state dict without its ``_extra_state`` objects (layer metadata: a
    Transformer Engine checkpoint's FP8 scales, which a model of another spec does not read)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {k: v for k, v in model.sharded_state_dict().items() if not isinstance(v, ShardedObject)}


def _built(entry) -> list:
    """The sharded tensors an entry of a sharded state dict stands for: itself, or what a factory
    (a gated MLP's input projection, stored as its two halves) builds."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        return list(nested_values(entry.build()))
    return [entry]


def megatron_flags(cfg: ModelConfig) -> list[str]:
    """The Megatron-LM flags that build this model (``pretrain_gpt.py`` / ``pretrain_bert.py``)."""
    flags = [f"--num-layers {cfg.num_layers}", f"--hidden-size {cfg.hidden_size}",
             f"--num-attention-heads {cfg.num_attention_heads}", f"--ffn-hidden-size {cfg.ffn_hidden_size}",
             f"--kv-channels {cfg.kv_channels}", f"--max-position-embeddings {cfg.max_sequence_length}",
             f"--position-embedding-type {cfg.position_embedding_type}",
             f"--normalization {cfg.normalization}", f"--norm-epsilon {cfg.layernorm_epsilon}",
             f"--make-vocab-size-divisible-by 1  # vocabulary {cfg.vocab_size}"]
    if cfg.num_query_groups != cfg.num_attention_heads:
        flags.append(f"--group-query-attention --num-query-groups {cfg.num_query_groups}")
    if cfg.activation == "swiglu":
        flags.append("--swiglu")
    if not cfg.add_bias_linear:
        flags.append("--disable-bias-linear")
    if not cfg.share_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if cfg.fp8 is not None:
        flags.append(f"--fp8-format {cfg.fp8}")
    if cfg.position_embedding_type == "rope":
        flags.append(f"--rotary-base {cfg.rotary_base}")
    return flags


def write(out: str, tensors: dict, cfg: ModelConfig, *, iteration: int = 0, moments: Optional[dict] = None,
          step: Optional[int] = None, tokenizer: Optional[str] = None, source: Optional[dict] = None) -> list[str]:
    """Write ``tensors`` (full, of a model of ``cfg``) as a Megatron-LM save directory ``out``
    (written elsewhere and renamed: never half a checkpoint), with the optimizer state ``moments``
    at ``step`` where given; returns the notes of what was not carried."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state)

    notes = []
    model = _single_process_model(cfg)
    load_parameters(model, fold_branch_multiplier(tensors, cfg))
    # all of it, the layers' ``_extra_state`` objects too: Megatron-Core's loading of a model asks
    # for every entry of its sharded state dict
    sharded = model.sharded_state_dict()
    state = {"model": sharded, "iteration": iteration, "checkpoint_version": 3.0}
    if moments and cfg.branch_multiplier != 1.0:
        notes.append("optimizer state not written: it belongs to the depth-muP parametrisation, which the "
                     "exported model (its multiplier folded into its weights) does not have")
    elif moments and {"momentum_buffer", "exp_avg"} <= set(moments):
        notes.append(MUON_NOT_WRITTEN)
    elif moments:
        params = dict(model.named_parameters())
        optimizer = torch.optim.Adam(list(params.values()))  # a holder of the state, never stepped
        for name, p in params.items():
            optimizer.state[p] = {"step": torch.tensor(float(step)),
                                  **{key: per_name[name].to(p.dtype) for key, per_name in moments.items()}}
        optim = optimizer.state_dict()
        optim_state_to_sharding_state(optim, get_param_id_to_sharded_param_map(sharded, params.values()),
                                      exclude_keys=("step",))
        optim["state"]["common_step"] = int(step)  # as Megatron-Core's FP32Optimizer saves it
        state["optimizer"] = optim
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".megatron-", dir=parent)
    try:
        name = f"iter_{iteration:07d}"
        os.makedirs(os.path.join(work, name))
        dist_checkpointing.save(state, os.path.join(work, name))
        with open(os.path.join(work, LATEST_FILE), "w") as f:
            f.write(str(iteration))
        if tokenizer:  # as a run directory keeps it, and as Megatron-LM's --tokenizer-model takes it
            keep_tokenizer(tokenizer, work)
        written = "optimizer" in state
        info = {"model": dataclasses.asdict(cfg), "branch_multiplier_folded": cfg.branch_multiplier,
                "optimizer": sorted(moments) if written else [], "step": step if written else None,
                "megatron_lm_flags": megatron_flags(cfg), "source": source or {}}
        with open(os.path.join(work, INFO_FILE), "w") as f:
            json.dump(info, f, indent=1)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return notes


def _config_of(root: str, directory: str, common: dict, keys) -> Optional[ModelConfig]:
    """The model config a checkpoint records: ours (``INFO_FILE``), else Megatron-LM's ``args`` in
    its ``common`` state (a BERT by its masked-LM head among the tensor ``keys``)."""
    info = os.path.join(root, INFO_FILE)
    if os.path.isfile(info):
        return parse_dataclass(ModelConfig, read_json_object(info).get("model"), f"{info}: model")
    args = common.get("args")
    if args is None:
        return None
    if not isinstance(args, argparse.Namespace):
        raise ValueError(f"{directory}: its common state's args is a {type(args).__name__}, not Megatron-LM's "
                         f"argparse.Namespace; pass --config")
    a = vars(args)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                           "max_position_embeddings") if a.get(k) is None]
    if missing or (a.get("padded_vocab_size") or a.get("vocab_size")) is None:
        raise ValueError(f"{directory}: Megatron-LM's args in the checkpoint lack {missing or ['padded_vocab_size']}; "
                         f"pass --config (a run config whose model block describes the checkpoint)")
    kind = "bert" if any(k.startswith("lm_head.") for k in keys) else "gpt"
    binary = kind == "bert" and bool(a.get("bert_binary_head", True))
    return ModelConfig(
        kind=kind, num_layers=a["num_layers"], hidden_size=a["hidden_size"],
        num_attention_heads=a["num_attention_heads"],
        num_query_groups=a.get("num_query_groups") if a.get("group_query_attention") else a["num_attention_heads"],
        kv_channels=a.get("kv_channels") or a["hidden_size"] // a["num_attention_heads"],
        ffn_hidden_size=a["ffn_hidden_size"], vocab_size=a.get("padded_vocab_size") or a["vocab_size"],
        max_sequence_length=a["max_position_embeddings"],
        position_embedding_type=a.get("position_embedding_type", "learned_absolute"),
        rotary_base=a.get("rotary_base", 10000),
        share_embeddings_and_output_weights=not a.get("untie_embeddings_and_output_weights", False),
        normalization=a.get("normalization", "LayerNorm"), activation="swiglu" if a.get("swiglu") else "gelu",
        add_bias_linear=a.get("add_bias_linear", True), layernorm_epsilon=a.get("norm_epsilon", 1e-5),
        num_tokentypes=2 if binary else 0, add_binary_head=binary, fp8=a.get("fp8"))


def _find_step(optimizer_state) -> Optional[int]:
    """The optimizer's step in its common state: Megatron-Core's ``common_step``, or a param
    group's ``step`` (the distributed optimizer's)."""
    if isinstance(optimizer_state, dict):
        if "common_step" in optimizer_state:
            return int(optimizer_state["common_step"])
        for group in optimizer_state.get("param_groups", []) or []:
            if isinstance(group, dict) and "step" in group:
                return int(group["step"])
        for value in optimizer_state.values():
            found = _find_step(value)
            if found is not None:
                return found
    elif isinstance(optimizer_state, (list, tuple)):
        for value in optimizer_state:
            found = _find_step(value)
            if found is not None:
                return found
    return None


def read(path: str, model: Optional[ModelConfig] = None, *, optimizer: bool = True) -> MegatronCheckpoint:
    """A ``torch_dist`` checkpoint as full tensors of a model of ``model`` (default: the config it
    records), with its optimizer state where it has one (and ``optimizer``)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    directory, iteration = iteration_dir(path)
    if not is_torch_dist(path):
        raise ValueError(f"{path} is not a Megatron-Core torch_dist checkpoint (no metadata.json naming torch_dist)")
    stored = safe_dist.tensor_shapes(safe_dist.read_metadata(directory))  # before any other pickle of it
    common = safe_dist.load_common(directory)
    cfg = model or _config_of(_save_root(path), directory, common, stored)
    if cfg is None:
        raise ValueError(f"{path} records no model config (neither {INFO_FILE} nor Megatron-LM's args): pass --config")
    net = _single_process_model(cfg)
    sharded = _sharded_tensors(net)
    for name, entry in sharded.items():
        for sh in _built(entry):
            if sh.key not in stored:
                raise ValueError(f"{path} has no tensor {sh.key!r}: the model of the config has it ({name}); is it "
                                 f"a checkpoint of this architecture (model.kind {cfg.kind!r})?")
            if stored[sh.key] != tuple(sh.global_shape):
                raise ValueError(f"{path}: {sh.key} is {stored[sh.key]} in the checkpoint, "
                                 f"{tuple(sh.global_shape)} in the model of the config (model.num_layers, "
                                 f"hidden_size, vocab_size, ffn_hidden_size ...)")
    notes = []
    request = {"model": sharded}
    master = next((k for k in MASTER_KEYS if all(f"optimizer.state.{k}.{sh.key}" in stored
                                                   for sh in sharded.values())), None)
    keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer")
            if all(f"optimizer.state.{k}.{sh.key}" in stored for sh in sharded.values())]
    step = None
    if optimizer and not keys and any(".momentum_buffer." in k for k in stored):
        notes.append("optimizer state not read: it keeps a momentum for some parameters only (a Muon "
                     "optimizer's, Megatron-Core's chained one), which this reader does not map")
    if optimizer and keys:
        step = _find_step(common.get("optimizer"))
        if step is None:
            notes.append(f"optimizer state {keys} not read: the checkpoint records no step count for it")
            keys = []
        elif cfg.branch_multiplier != 1.0:
            notes.append("optimizer state not read: the config's depth-muP parametrisation is not the checkpoint's")
            keys = []
    for key in keys + ([master] if master else []):
        request[key] = {name: make_sharded_optimizer_tensor(sh, torch.empty_like(sh.data), f"optimizer.state.{key}")
                        for name, sh in sharded.items()}
    loaded = safe_dist.load(request, directory)
    weights = {name: t.float() for name, t in (loaded[master] if master else loaded["model"]).items()}
    if master:
        notes.append(f"weights from the optimizer's fp32 master copy (optimizer.state.{master})")
    tensors = unfold_branch_multiplier(weights, cfg)
    moments = {key: {name: t.float() for name, t in loaded[key].items()} for key in keys}
    return MegatronCheckpoint(tensors, cfg, iteration, moments, step if keys else None, notes,
                              run_tokenizer_copy(_save_root(path)))
