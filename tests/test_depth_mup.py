"""Depth-muP as an option of the model: each residual branch's output times (base / L) ** a, the
transformer layers' learning rate times (base / L) ** (1 - a); what a run of it trains (the
optimizer's groups read straight from DeepSpeed's checkpoint file), its Hugging Face export, and
the same run in another layout."""

import json

import pytest
import torch

from conftest import random_state_dict, small_config
from launch_helpers import KEEP_ALL, assert_close_to_reference, launch, ok, run_config
from megatron_multilevel.config import ModelConfig
from megatron_multilevel.training.engines import parameter_groups


def test_the_multiplier_and_the_layers_rate_follow_depth():
    def cfg(**kw):
        return ModelConfig(num_layers=16, hidden_size=32, num_attention_heads=4, vocab_size=64, **kw)

    assert (cfg().branch_multiplier, cfg().layer_lr_factor) == (1.0, 1.0)
    complete = cfg(depth_mup_base_layers=1)  # CompleteP: 1/16, the rate unchanged
    assert (complete.branch_multiplier, complete.layer_lr_factor) == (0.0625, 1.0)
    depth = cfg(depth_mup_base_layers=4, depth_mup_exponent=0.5)  # sqrt(4 / 16) for both
    assert (depth.branch_multiplier, depth.layer_lr_factor) == (0.5, 0.5)
    at_base = cfg(depth_mup_base_layers=16, depth_mup_exponent=0.5)
    assert (at_base.branch_multiplier, at_base.layer_lr_factor) == (1.0, 1.0)


@pytest.mark.parametrize("change, key", [(dict(depth_mup_exponent=0.25), "model.depth_mup_exponent"),
                                         (dict(depth_mup_base_layers=0), "model.depth_mup_base_layers")])
def test_invalid_depth_mup_is_one_clear_error(change, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig(num_layers=4, **{"depth_mup_base_layers": 1, **change})


def test_parameter_groups_put_the_layers_apart_at_their_rate():
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
             "decoder.final_layernorm.weight", "output_layer.bias"]
    params = {n: torch.nn.Parameter(torch.zeros(1)) for n in names}
    plain = parameter_groups(params.items(), 0.1, 1e-3)
    assert [([id(p) for p in g["params"]], g["weight_decay"], g.get("lr")) for g in plain] == [
        ([id(params[names[0]]), id(params[names[1]])], 0.1, None),
        ([id(params[n]) for n in names[2:]], 0.0, None)]
    mup = parameter_groups(params.items(), 0.1, 1e-3, 0.25)
    assert [([id(p) for p in g["params"]], g["weight_decay"], g.get("lr")) for g in mup] == [
        ([id(params[names[0]])], 0.1, None),
        ([id(params[n]) for n in names[4:]], 0.0, None),
        ([id(params[names[1]])], 0.1, 2.5e-4),
        ([id(params[n]) for n in names[2:4]], 0.0, 2.5e-4)]


def _folded_by_hand(state: dict, factor: float) -> dict:
    """The residual branches' output projections (weights and biases) times ``factor``."""
    return {k: v * factor if (".linear_proj." in k or ".linear_fc2." in k) else v.clone() for k, v in state.items()}


@pytest.mark.usefixtures("dist_single")
@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_llama", "bert_tied"])
def test_a_depth_mup_model_computes_its_folded_plain_model(variant):
    """Built with depth-muP (4 layers at base 1, exponent 0.5: branches times 1/2), a model computes
    what the plain model computes with its output projections halved by hand; folding by
    ``fold_branch_multiplier`` gives those weights."""
    from megatron_multilevel.checkpoints.verify import logits_full
    from megatron_multilevel.models import build_model, load_parameters, model_logits
    from megatron_multilevel.ode_operators import fold_branch_multiplier

    plain = small_config(variant)
    mup = small_config(variant, depth_mup_base_layers=1, depth_mup_exponent=0.5)
    state = random_state_dict(plain, seed=3)
    tokens = torch.randint(0, plain.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model = build_model(mup, perform_initialization=False)
    load_parameters(model, state)
    with torch.no_grad():
        ours = model_logits(model.eval(), mup, tokens).float()
    assert torch.allclose(logits_full(state, mup, tokens), ours, atol=1e-5)
    by_hand = logits_full(_folded_by_hand(state, 0.5), plain, tokens)
    assert torch.allclose(ours, by_hand, atol=1e-5)
    assert not torch.allclose(ours, logits_full(state, plain, tokens), atol=1e-2)
    folded = fold_branch_multiplier(state, mup)
    for name, t in _folded_by_hand(state, 0.5).items():
        assert torch.equal(folded[name], t), name


WSD = {"peak": 2e-3, "decay": "1-sqrt", "decay_fraction": 0.5, "min_ratio": 0.0}
# depth-muP at base 1, exponent 0.5: the 1-layer model is the standard one; the 4-layer model's
# branches take 1/2 and its layers train at half the rate. Copies of the trained layer, 8 steps of
# the 1-layer model, the 2-layer level trains none, 6 of the full model.
MUP = {"depth_mup_base_layers": 1, "depth_mup_exponent": 0.5}
LATE = {"enabled": True, "cycle": "grow", "num_levels": 3, "alpha": 1.0, "coalesce_width": False,
        "coalesce_depth": True, "depth_pairing": "halves", "growth_operator": "copy",
        "optimizer_state": "map", "grown_moments": "zero", "lr_schedule": "continue",
        "levels": [{"steps_before": 0, "steps_after": 6, "lr_after": WSD}, {"steps_before": 0, "lr_before": WSD},
                   {"steps_before": 8, "lr_before": {**WSD, "warmup_steps": 2}}]}


def _grown_logits_under_mup(variant: str, growth: str, exponent: float, base: int):
    """Logits of a random coarse depth-muP model (2 layers) and of the 4-layer model grown from it
    (``identity`` layers, or MSG's copies under their mask at 0), each with its own multiplier."""
    from megatron_multilevel.growth.mask import growth_mask
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.models import build_model, load_parameters, model_logits
    from megatron_multilevel.operators import decoalesce

    cfg = small_config(variant, num_layers=4, depth_mup_base_layers=base, depth_mup_exponent=exponent)
    lm = make_level_map(cfg, width=False, depth_pairing="halves",
                        depth_scaling="identity" if growth == "identity" else "none")
    assert lm.coarse.branch_multiplier != cfg.branch_multiplier  # each depth its own multiplier
    coarse = random_state_dict(lm.coarse, seed=21)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_sequence_length), generator=torch.Generator().manual_seed(0))
    logits = []
    grown = decoalesce(coarse, lm, keep_branches=growth == "msg")
    for c, state in ((lm.coarse, coarse), (cfg, grown)):
        model = build_model(c)
        load_parameters(model, state)
        if c is cfg and growth == "msg":
            assert growth_mask(model, lm, 10).at(0) == 0.0
        with torch.no_grad():
            logits.append(model_logits(model.eval(), c, tokens))
    return logits


@pytest.mark.usefixtures("dist_single")
@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_llama", "bert_tied"])
@pytest.mark.parametrize("growth", ["msg", "identity"])
@pytest.mark.parametrize("exponent, base", [(1.0, 1), (0.5, 1), (0.75, 2)])
def test_a_growth_that_preserves_the_function_does_under_depth_mup(variant, growth, exponent, base):
    """The kept layers' branches are rescaled by the multipliers' ratio: the grown model computes
    the small one, whatever the exponent and base depth."""
    a, b = _grown_logits_under_mup(variant, growth, exponent, base)
    assert a.abs().max() > 0.1
    assert (a - b).abs().max().item() < 1e-6 * max(1.0, a.abs().max().item())


def test_depth_mup_growth_rescales_branches_and_states_by_the_multipliers_ratio():
    """CompleteP at base 1, 2 -> 4 layers: the multiplier goes 1/2 -> 1/4, so MSG's kept layers and
    their copies double their residual-branch outputs (the function kept); Adam's first moment
    (gradient units) halves, its second quarters; the rest is copied. Plain copies (no mask: Bu's
    expansion) copy the weights, each level's multiplier acting on them."""
    from megatron_multilevel.config import STATE_DEGREE
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.operators import coalesce, decoalesce

    cfg = small_config("gpt_tied", num_layers=4, depth_mup_base_layers=1, depth_mup_exponent=1.0)
    lm = make_level_map(cfg, width=False, depth_pairing="halves")
    coarse = random_state_dict(lm.coarse, seed=22)
    cases = [(key, factor, True) for key, factor in ((None, 2.0), ("exp_avg", 0.5), ("exp_avg_sq", 0.25))]
    for key, factor, keep in cases + [(None, 1.0, False), ("exp_avg_sq", 1.0, False)]:
        degree = 1 if key is None else STATE_DEGREE[key]
        fine = decoalesce(coarse, lm, degree=degree, keep_branches=keep)
        for j, k in ((0, 0), (1, 1), (2, 0), (3, 1)):  # halves: fine layer j copies coarse layer k
            for name, t in coarse.items():
                prefix = f"decoder.layers.{k}."
                if not name.startswith(prefix):
                    continue
                got = fine[f"decoder.layers.{j}." + name[len(prefix):]]
                residual = ".linear_proj." in name or ".linear_fc2." in name
                assert torch.equal(got, t * factor if residual else t), (key, j, name)
    identity = make_level_map(cfg, width=False, depth_pairing="halves", depth_scaling="identity")
    for degree in (1, -1, -2):  # identity layers keep their branches: coalescing is the inverse
        back = coalesce(decoalesce(coarse, identity, degree=degree), identity, degree=degree)
        assert all(torch.allclose(back[n], coarse[n], rtol=0, atol=1e-6) for n in coarse), degree


def test_each_level_of_a_run_takes_its_own_depths_multiplier():
    """The run's levels (4, 2 and 1 layers at base 1, exponent 0.5) multiply their branches by
    sqrt(1/4), sqrt(1/2) and 1."""
    from megatron_multilevel.config import load_config
    from megatron_multilevel.training.engines import LevelEngines

    cfg = load_config({"train_batch_size": 8, "model": _model(), "data": {"seq_length": 32}, "multilevel": LATE})
    engines = LevelEngines(cfg, 1)
    assert [engines.residual_step(level) for level in range(3)] == pytest.approx([0.5, 0.5 ** 0.5, 1.0], abs=1e-12)


def _model(**blocks) -> dict:
    return {"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512,
            "max_sequence_length": 32, **MUP, **blocks}


@pytest.fixture(scope="module")
def mup_run(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("mup")
    ok(launch(run_config(tmp, corpus, "run", model=_model(), multilevel=LATE, training=KEEP_ALL)))
    return {"dir": tmp / "run"}


def _groups(run_dir, tag: str) -> list[tuple[int, float]]:
    """(parameter count, learning rate) of each optimizer group of a one-process checkpoint."""
    (path,) = (run_dir / "checkpoints" / tag).glob("mp_rank_00_model_states.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return [(len(g["params"]), g["lr"]) for g in saved["optimizer"]["param_groups"]]


def test_a_depth_mup_growth_trains_each_depth_at_its_layers_rate(mup_run):
    """The 1-layer model (at its base depth) trains every parameter at one rate; the 4-layer model
    it grows into trains its layers at half the rest's rate, and the loss goes down."""
    from launch_helpers import records

    one = _groups(mup_run["dir"], "phase00-step0000006")
    assert len(one) == 2, one  # decayed weights, biases and norms: no layer group at the base depth
    four = _groups(mup_run["dir"], "phase02-step0000004")
    assert len(four) == 4, four
    (_, rest), (_, rest_nd), (_, layers), (_, layers_nd) = four
    assert rest > 0 and rest == rest_nd and layers == layers_nd
    assert layers == pytest.approx(0.5 * rest, rel=1e-6)
    train = records(mup_run["dir"], "train")
    assert train[-1]["loss"] < train[0]["loss"]


def test_a_depth_mup_model_exports_to_hugging_face_as_its_plain_model(mup_run, tmp_path):
    """``to-hf`` folds the multiplier into the weights: the export's own logits check (against the
    Megatron model with its multiplier) passes, and its projections are the checkpoint's halved."""
    import subprocess
    import sys

    from megatron_multilevel.checkpoints.convert import load_source

    src = mup_run["dir"] / "checkpoints" / "final"
    if not src.exists():
        src = mup_run["dir"] / "checkpoints" / "phase02-step0000006"
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "to-hf", str(src), str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    from safetensors.torch import load_file

    hf = load_file(str(out / "model.safetensors"))
    tensors = load_source(str(src)).tensors
    (proj,) = (k for k in hf if k.endswith("h.0.attn.c_proj.weight"))
    assert torch.allclose(hf[proj].t(),
                          0.5 * tensors["decoder.layers.0.self_attention.linear_proj.weight"].float(), atol=1e-6)


def _zero3_after_growth() -> dict:
    """The 1-layer model at DP=2 under ZeRO-2, the models it grows into under ZeRO-3 (their layers'
    group at its own rate in DeepSpeed's partitioned optimizer)."""
    levels = json.loads(json.dumps(LATE["levels"]))
    for i, stage in ((0, 3), (1, 3), (2, 2)):
        levels[i].update(tensor_model_parallel_size=1, deepspeed={"zero_optimization": {"stage": stage}})
    return {"multilevel": {**LATE, "levels": levels}}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"multilevel": LATE, "parallel": {"tensor_model_parallel_size": 2}},
                                    _zero3_after_growth()], ids=["tp2", "dp2-zero3"])
def test_a_depth_mup_growth_in_two_layouts_is_the_one_process_run(mup_run, corpus, tmp_path, layout):
    """The multiplier's hooks see each branch's output after its tensor-parallel reduction, and the
    layers' groups keep their rate under TP 2 and under ZeRO-3: the run trains the one-process
    run's model."""
    config = run_config(tmp_path, corpus, "run", model=_model(), training=KEEP_ALL, **layout)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", mup_run, abs=2e-4)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [p["level"] for p in summary["phases"]] == [2, 1, 0]


# MSG under depth-muP (exponent 0.5, base 1): 2 layers (branches x sqrt(1/2)) grown to 4 (x 1/2),
# the copies masked in over 4 steps, the moments mapped (the kept branches' rescaled with them)
MSG_MUP = {"enabled": True, "cycle": "grow", "num_levels": 2, "alpha": 1.0, "coalesce_width": False,
           "coalesce_depth": True, "depth_pairing": "halves", "depth_scaling": "none", "growth_mask_steps": 4,
           "optimizer_state": "map", "levels": [{"steps_after": 6, "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
                                                {"steps_before": 5, "lr_before": {"peak": 2e-3, "warmup_steps": 2}}]}


def test_msg_under_depth_mup_keeps_the_small_models_loss_and_ramps_its_mask(corpus, tmp_path):
    """A real run: the transition check (tolerance 1e-3, stopping the run) passes, the grown
    model's loss on the check batch and its validation loss before its first step are the small
    model's, and the grown phase's steps train with the mask at 0, 1/4, 2/4, 3/4, then 1."""
    from launch_helpers import records

    config = run_config(tmp_path, corpus, "run", model=_model(), multilevel=MSG_MUP,
                        training={**KEEP_ALL, "log_interval": 1})
    ok(launch(config))
    (jump,) = records(tmp_path / "run", "transition")
    assert jump["preserves_function"] and abs(jump["loss_after"] - jump["loss_before"]) < 1e-5, jump
    valid = {(r["phase"], r["step"]): r["loss"] for r in records(tmp_path / "run", "valid")}
    assert valid[(1, 0)] == pytest.approx(valid[(0, 5)], rel=1e-6)
    masks = [r.get("mask") for r in records(tmp_path / "run", "train") if r["phase"] == 1]
    assert masks == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0], masks


def test_a_megatron_export_of_a_depth_mup_run_reads_back_under_its_own_config(mup_run, tmp_path):
    """``to-megatron`` folds the multiplier (1/2 at 4 layers) into the output projections, a plain
    model of the same function; ``from-megatron`` with the run's own depth-muP config unfolds it
    again (the run's weights), with a plain config it keeps the folded ones."""
    from launch_helpers import convert

    from megatron_multilevel.checkpoints.convert import load_source

    src = mup_run["dir"] / "checkpoints" / "final"
    if not src.exists():
        src = mup_run["dir"] / "checkpoints" / "phase02-step0000006"
    run = load_source(str(src)).tensors
    ok(convert("to-megatron", src, tmp_path / "megatron"))
    config = json.loads((mup_run["dir"] / "config.json").read_text())
    plain = {**config, "model": {k: v for k, v in config["model"].items() if not k.startswith("depth_mup")}}
    for name, cfg in (("mup", config), ("plain", plain)):
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        out = ok(convert("from-megatron", tmp_path / "megatron", tmp_path / name, "--config",
                         tmp_path / f"{name}.json")).stdout
        assert "| torch_dist | loaded by Megatron-Core (TP=1), against the consolidated checkpoint |" in out, out
    back, folded = (load_source(str(tmp_path / name)).tensors for name in ("mup", "plain"))
    proj = "decoder.layers.3.self_attention.linear_proj.weight"
    assert torch.allclose(folded[proj].float(), 0.5 * run[proj].float(), atol=1e-6)
    assert run[proj].abs().max() > 1e-3
    for name, t in run.items():
        assert torch.allclose(back[name].float(), t.float(), atol=1e-6), name
