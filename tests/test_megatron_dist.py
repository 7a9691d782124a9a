"""Megatron-Core distributed checkpoints (``torch_dist``) in and out.

The Megatron side of every check is Megatron-Core alone: a ``GPTModel`` built from its own
``TransformerConfig`` and local layer spec (not this project's ``build_model``), saved and loaded
with ``dist_checkpointing``, its optimizer state made by Megatron-Core's own
``optim_state_to_sharding_state`` as its ``FP32Optimizer`` saves it, with Megatron-LM's save layout
(``iter_0000007/``, ``latest_checkpointed_iteration.txt``, ``args`` in the common state).
"""

import argparse
import json
import os

import pytest
import torch

from distributed_helpers import run_ranks
from launch_helpers import convert, launch, ok, run_config

TOKENS = torch.arange(2 * 16).reshape(2, 16) % 509 + 1


def _mcore_model(model: dict):
    """A Megatron-Core GPTModel of ``model`` (this project's model block) on the current TP layout."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_multilevel.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    config = TransformerConfig(
        num_layers=model["num_layers"], hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"], ffn_hidden_size=4 * model["hidden_size"],
        activation_func=F.gelu, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=model["vocab_size"],
                    max_sequence_length=model["max_sequence_length"], share_embeddings_and_output_weights=True)


def _gathered_logits(model) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model.eval()
    with torch.no_grad():
        b, s = TOKENS.shape
        logits = model(TOKENS, torch.arange(s).expand(b, s), None)
        return gather_from_tensor_model_parallel_region(logits).float()


def _megatron_save_worker(rank, world, model: dict, save_dir: str, iteration: int):
    """Megatron-LM's save, by Megatron-Core: a perturbed GPT at TP ``world`` with an Adam state whose
    moments are known functions of the weights (0.5 W and W squared, step 3)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state)

    torch.manual_seed(0)
    net = _mcore_model(model)
    gen = torch.Generator().manual_seed(1)  # the same on every rank: replicated parameters stay equal
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    params = list(net.parameters())
    optimizer = torch.optim.Adam(params)
    for p in params:
        optimizer.state[p] = {"step": torch.tensor(3.0), "exp_avg": 0.5 * p.detach().clone(),
                              "exp_avg_sq": p.detach().square()}
    sharded = net.sharded_state_dict()
    optim = optimizer.state_dict()
    optim_state_to_sharding_state(optim, get_param_id_to_sharded_param_map(sharded, params), exclude_keys=("step",))
    optim["state"]["common_step"] = 3
    args = argparse.Namespace(num_layers=model["num_layers"], hidden_size=model["hidden_size"],
                              num_attention_heads=model["num_attention_heads"], tensor_model_parallel_size=world)
    directory = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save({"model": sharded, "optimizer": optim, "iteration": iteration, "args": args,
                             "checkpoint_version": 3.0}, directory)
    if rank == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    return _gathered_logits(net) if rank == 0 else None


def _megatron_load_worker(rank, world, model: dict, directory: str):
    """Megatron-Core's own loading of a torch_dist checkpoint at TP ``world``: its logits."""
    from megatron.core import dist_checkpointing

    net = _mcore_model(model)
    net.load_state_dict(dist_checkpointing.load({"model": net.sharded_state_dict()}, directory)["model"])
    return _gathered_logits(net) if rank == 0 else None


def _logits(tensors: dict, cfg) -> torch.Tensor:
    from megatron_multilevel.checkpoints import verify

    return verify.logits_full(tensors, cfg, TOKENS)


def test_megatron_tp2_to_a_run_at_tp1_to_megatron_tp4(corpus, tmp_path):
    """Megatron-Core at TP 2 -> this project's V-cycle at TP 1 (weights and Adam state imported),
    trained -> torch_dist -> Megatron-Core at TP 4: the logits are the run's to 1e-5."""
    from megatron_multilevel.checkpoints import megatron_dist
    from megatron_multilevel.checkpoints.convert import load_source

    config = run_config(tmp_path, corpus, "run", model={"max_sequence_length": 32})
    model = json.loads(config.read_text())["model"]
    save = tmp_path / "megatron"
    source_logits = run_ranks(_megatron_save_worker, 2, tmp_path / "save", model, str(save), 7)[0]

    out = ok(convert("init-run", save, tmp_path / "run", "--config", config)).stdout
    assert "optimizer state exp_avg, exp_avg_sq at step 3: the source's, exactly" in out, out
    start = load_source(str(tmp_path / "run"))
    torch.testing.assert_close(_logits(start.tensors, start.model), source_logits, atol=1e-5, rtol=0)
    # the imported optimizer state, exported again from the run's first checkpoint: 0.5 W and W^2
    first = tmp_path / "run" / "checkpoints" / "phase00-step0000000"
    ok(convert("to-megatron", first, tmp_path / "first"))
    back = megatron_dist.read(str(tmp_path / "first"))
    assert back.step == 3 and back.iteration == 0
    for name, w in start.tensors.items():
        torch.testing.assert_close(back.moments["exp_avg"][name], 0.5 * w, atol=1e-7, rtol=0)
        torch.testing.assert_close(back.moments["exp_avg_sq"][name], w.square(), atol=1e-7, rtol=0)

    run = ok(launch(tmp_path / "run" / "config.json"))
    assert "resuming from phase00-step0000000" in run.stdout
    trained = load_source(str(tmp_path / "run"))
    assert not torch.equal(trained.tensors["embedding.word_embeddings.weight"],
                           start.tensors["embedding.word_embeddings.weight"])
    out = ok(convert("to-megatron", tmp_path / "run", tmp_path / "export")).stdout
    assert "read back exactly" in out and "--ckpt-format torch_dist" in out
    assert (tmp_path / "export" / "tokenizer.model").is_file()
    directory, iteration = megatron_dist.iteration_dir(str(tmp_path / "export"))
    assert iteration == trained.description["global_step"]
    loaded = run_ranks(_megatron_load_worker, 4, tmp_path / "load", model, directory)[0]
    torch.testing.assert_close(loaded, _logits(trained.tensors, trained.model), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_growth_from_a_megatron_small_model_matches_one_from_the_same_weights_saved_here(corpus, tmp_path):
    """A growth schedule whose small model is a Megatron-Core checkpoint (TP 2) trains as the same
    schedule started from those weights consolidated by this project: the same losses."""
    grow = {"enabled": True, "cycle": "grow", "num_levels": 2, "alpha": 1.0, "coalesce_width": False,
            "coalesce_depth": True, "depth_pairing": "halves",
            "levels": [{"steps_before": 0, "lr_before": {"peak": 2e-3}, "steps_after": 4,
                        "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
                       {"steps_before": 4, "lr_before": {"peak": 2e-3, "warmup_steps": 1}}]}
    runs = {}
    for name in ("imported", "consolidated"):
        runs[name] = run_config(tmp_path, corpus, name, multilevel=grow)
    small = {**json.loads(runs["imported"].read_text())["model"], "num_layers": 2}
    run_ranks(_megatron_save_worker, 2, tmp_path / "save", small, str(tmp_path / "megatron"), 5)
    described = tmp_path / "small.json"  # a config whose model block is the small model
    described.write_text(json.dumps({**json.loads(runs["imported"].read_text()), "model": small}))
    ok(convert("from-megatron", tmp_path / "megatron", tmp_path / "full", "--config", described))
    ok(convert("init-run", tmp_path / "megatron", tmp_path / "imported", "--config", runs["imported"],
               "--fresh-optimizer"))
    ok(convert("init-run", tmp_path / "full", tmp_path / "consolidated", "--config", runs["consolidated"]))
    losses = {}
    for name in runs:
        result = ok(launch(tmp_path / name / "config.json"))
        assert "resuming from phase00-step0000000" in result.stdout
        losses[name] = [(r["type"], r["global_step"], r["loss"]) for r in map(json.loads, open(
            tmp_path / name / "metrics.jsonl")) if r.get("type") in ("train", "valid")]
    assert losses["imported"] == losses["consolidated"] and len(losses["imported"]) > 2


def test_torch_dist_round_trip_and_refusals(tmp_path, dist_single):
    """Written and read back: the same tensors and Adam state (a depth-muP model's function kept,
    its state not written); a checkpoint of another shape, or whose common state asks for a class
    beyond Megatron-LM's Namespace, is refused with the key or the class named."""
    import dataclasses

    from conftest import random_state_dict, small_config
    from megatron_multilevel.checkpoints import megatron_dist

    cfg = small_config("gpt_llama")
    tensors = random_state_dict(cfg)
    moments = {"exp_avg": {k: torch.randn_like(v) for k, v in tensors.items()},
               "exp_avg_sq": {k: torch.rand_like(v) for k, v in tensors.items()}}
    assert megatron_dist.write(str(tmp_path / "plain"), tensors, cfg, iteration=9, moments=moments, step=4) == []
    back = megatron_dist.read(str(tmp_path / "plain"))
    assert back.model == cfg and back.iteration == 9 and back.step == 4
    assert all(torch.equal(back.tensors[k], t) for k, t in tensors.items())
    assert all(torch.equal(back.moments[key][k], t) for key in moments for k, t in moments[key].items())
    # depth-muP: the multiplier folded into the branch outputs, so Megatron-Core computes the same
    mup = dataclasses.replace(cfg, depth_mup_base_layers=1)
    notes = megatron_dist.write(str(tmp_path / "mup"), tensors, mup, moments=moments, step=4)
    assert notes and "optimizer state not written" in notes[0]
    plain = megatron_dist.read(str(tmp_path / "mup"), cfg)
    torch.testing.assert_close(_logits(plain.tensors, cfg), _logits(tensors, mup), atol=1e-5, rtol=0)
    assert not plain.moments
    with pytest.raises(ValueError, match=r"decoder.layers.mlp.linear_fc1.weight is \(4, 512, 64\) in the checkpoint"):
        megatron_dist.read(str(tmp_path / "plain"), dataclasses.replace(cfg, ffn_hidden_size=128))
    # a common state that asks for a class: refused, nothing run (planted as common.pt, where
    # Megatron-Core 0.16 keeps it and 0.19, which keeps it among the shards, still reads it first)
    from megatron.core import dist_checkpointing

    directory = tmp_path / "plain" / "iter_0000009"
    state = dist_checkpointing.load_common_state_dict(str(directory))
    state["args"] = argparse.ArgumentParser  # any class beyond the Namespace
    torch.save(state, directory / "common.pt")
    with pytest.raises(ValueError, match=r"common\.pt: it asks to load argparse\.ArgumentParser, which is not among the "
                                         r"classes a torch_dist checkpoint's common state holds \(argparse\.Namespace\)"):
        megatron_dist.read(str(tmp_path / "plain"))


@pytest.mark.parametrize("variant", ["gpt_untied", "gpt_gqa_tied_rope", "bert_untied_binary", "bert_rms_swiglu"])
def test_every_model_variant_round_trips(variant, tmp_path, dist_single):
    """GPT and BERT, tied or not, GQA, RoPE, RMSNorm, SwiGLU (its input projection stored as two
    halves), BERT's binary head: written and read back bit for bit, the config recorded beside."""
    from conftest import random_state_dict, small_config
    from megatron_multilevel.checkpoints import megatron_dist

    cfg = small_config(variant)
    tensors = random_state_dict(cfg)
    megatron_dist.write(str(tmp_path / "out"), tensors, cfg, iteration=3)
    back = megatron_dist.read(str(tmp_path / "out" / "iter_0000003"))
    assert back.model == cfg and back.iteration == 3 and not back.moments
    assert sorted(back.tensors) == sorted(tensors)
    assert all(torch.equal(back.tensors[k], t) for k, t in tensors.items())
