"""The ODE strategy's maths, config and phases: restriction, prolongation, validation."""

import pytest
import torch

from conftest import random_state_dict, small_config
from megatron_multilevel.config import load_config
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.ode_operators import (
    prolong,
    prolongation_sources,
    restrict,
    restrict_layer,
    unrestrict_layer,
)
from megatron_multilevel.training.schedule import build_phases

pytestmark = pytest.mark.usefixtures("dist_single")

# The residual-branch outputs, named independently of the plan.
RESIDUAL = ("linear_proj.weight", "linear_proj.bias", "linear_fc2.weight", "linear_fc2.bias")
SHARED_PREFIXES = ("embedding.", "output_layer.", "decoder.final_layernorm.", "encoder.final_layernorm.",
                   "lm_head.", "pooler.", "binary_head.")


def _stack(cfg):
    return "decoder" if cfg.kind == "gpt" else "encoder"


def _fine_name(cfg, layer, local):
    return f"{_stack(cfg)}.layers.{layer}.{local}"


def _locals(sd, cfg):
    prefix = f"{_stack(cfg)}.layers.0."
    return [k[len(prefix):] for k in sd if k.startswith(prefix)]


def _simulated_change(coarse, seed):
    """A coarse model after "training": every tensor moved by a random amount."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in coarse.items()}


@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_llama", "bert_untied_binary"])
@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("scale", [1, 2])
@pytest.mark.parametrize("prolongation", ["correction", "constant", "linear"])
@pytest.mark.parametrize("parametrisation", ["folded", "explicit"])
def test_no_coarse_training_gives_the_fine_model_back_bit_for_bit(variant, parity, scale, prolongation,
                                                                  parametrisation):
    cfg = small_config(variant, num_layers=6)
    sel = LayerSelection(cfg, parity, scale, parametrisation)
    fine = random_state_dict(cfg, seed=1)
    coarse = restrict(fine, sel)
    assert coarse["embedding.word_embeddings.weight"].shape == fine["embedding.word_embeddings.weight"].shape
    assert not any(k.startswith(f"{_stack(cfg)}.layers.3.") for k in coarse)
    for local in _locals(fine, cfg):  # the explicit step is in the forward pass: the weights are copies
        factor = scale if parametrisation == "folded" and local.endswith(RESIDUAL) else 1
        assert torch.equal(coarse[_fine_name(cfg, 1, local)], factor * fine[_fine_name(cfg, 2 + parity, local)])
    again = prolong(fine, coarse, sel, prolongation=prolongation)
    assert again.keys() == fine.keys()
    for k in fine:
        assert torch.equal(again[k], fine[k]), k
        assert again[k].data_ptr() != fine[k].data_ptr()


@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_untied", "bert_tied"])
@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("correction_scale", [1.0, 0.5])
def test_a_coarse_change_moves_exactly_the_selected_layers_and_the_shared_parameters(variant, parity,
                                                                                     correction_scale):
    cfg = small_config(variant, num_layers=6)
    sel = LayerSelection(cfg, parity, 2)
    fine = random_state_dict(cfg, seed=2)
    start = restrict(fine, sel)
    end = _simulated_change(start, seed=3)
    new = prolong(fine, end, sel, correction_scale=correction_scale)
    selected = {parity + 2 * i: i for i in range(3)}
    for name, before in fine.items():
        if name.startswith(SHARED_PREFIXES):
            expected = before + correction_scale * (end[name] - start[name])
        else:
            layer, local = int(name.split(".")[2]), name.split(".", 3)[3]
            if layer not in selected:
                assert torch.equal(new[name], before), name  # untouched, bit for bit
                continue
            coarse = _fine_name(cfg, selected[layer], local)
            assert torch.equal(start[coarse], 2 * before if local.endswith(RESIDUAL) else before), name
            delta = end[coarse] - start[coarse]
            expected = before + correction_scale * (delta / 2 if local.endswith(RESIDUAL) else delta)
        torch.testing.assert_close(new[name], expected, rtol=0, atol=1e-7, msg=name)
        assert not torch.equal(new[name], before), name


@pytest.mark.parametrize("scale", [1, 2])
@pytest.mark.parametrize("degree", [1, 2])
def test_residual_scale_round_trip_is_exact(scale, degree):
    cfg = small_config("gpt_tied")
    sel = LayerSelection(cfg, 1, scale)
    fine = random_state_dict(cfg, seed=4)
    layer = {local: fine[_fine_name(cfg, 1, local)] for local in _locals(fine, cfg)}
    coarse = restrict_layer(layer, sel, degree=degree)
    for local, t in layer.items():
        factor = scale**degree if local.endswith(RESIDUAL) else 1
        assert torch.equal(coarse[local], t * factor), local
    back = unrestrict_layer(coarse, sel, degree=degree)
    assert all(torch.equal(back[k], layer[k]) for k in layer)


@pytest.mark.parametrize(
    "parity, prolongation, expected",
    [
        (0, "correction", [[(0, 1.0)], [], [(1, 1.0)], [], [(2, 1.0)], []]),
        (1, "correction", [[], [(0, 1.0)], [], [(1, 1.0)], [], [(2, 1.0)]]),
        (0, "constant", [[(0, 1.0)], [(0, 1.0)], [(1, 1.0)], [(1, 1.0)], [(2, 1.0)], [(2, 1.0)]]),
        (1, "constant", [[(0, 1.0)], [(0, 1.0)], [(1, 1.0)], [(1, 1.0)], [(2, 1.0)], [(2, 1.0)]]),
        (0, "linear", [[(0, 1.0)], [(0, 0.5), (1, 0.5)], [(1, 1.0)], [(1, 0.5), (2, 0.5)], [(2, 1.0)], [(2, 1.0)]]),
        (1, "linear", [[(0, 1.0)], [(0, 1.0)], [(0, 0.5), (1, 0.5)], [(1, 1.0)], [(1, 0.5), (2, 0.5)], [(2, 1.0)]]),
    ],
)
def test_prolongation_sources(parity, prolongation, expected):
    assert prolongation_sources(LayerSelection(small_config("gpt_tied", num_layers=6), parity), prolongation) == expected


@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("prolongation", ["constant", "linear"])
def test_constant_and_linear_prolongations_give_the_skipped_layers_their_neighbours_change(parity, prolongation):
    cfg = small_config("gpt_tied", num_layers=6)
    sel = LayerSelection(cfg, parity, 2)
    fine = random_state_dict(cfg, seed=5)
    start = restrict(fine, sel)
    end = _simulated_change(start, seed=6)
    new = prolong(fine, end, sel, prolongation=prolongation)
    corrected = prolong(fine, end, sel)  # correction: the selected layers only

    def change(j, local):
        return corrected[_fine_name(cfg, j, local)] - fine[_fine_name(cfg, j, local)]

    for local in _locals(fine, cfg):
        for j in range(6):
            name = _fine_name(cfg, j, local)
            if j % 2 == parity:
                assert torch.equal(new[name], corrected[name]), name
                continue
            if prolongation == "constant":  # the selected layer of the pair (2k, 2k + 1)
                expected = fine[name] + change(j + 1 if parity else j - 1, local)
            else:
                neighbours = [n for n in (j - 1, j + 1) if 0 <= n < 6]
                expected = fine[name] + sum(change(n, local) for n in neighbours) / len(neighbours)
            torch.testing.assert_close(new[name], expected, rtol=0, atol=1e-6, msg=name)
            assert not torch.equal(new[name], fine[name])


def test_moments_restrict_in_gradient_units():
    """Residual scale 2: a residual-branch output's parameter doubles, its moments (gradient units)
    halve and its second moment quarters, as the optimizer-state map uses them; other tensors copy."""
    from megatron_multilevel.parallel.ode_transition import DEGREE

    cfg = small_config("bert_tied", num_layers=4)
    sel = LayerSelection(cfg, 0, 2)
    grads = random_state_dict(cfg, seed=7)
    squared = {k: v * v for k, v in grads.items()}
    params = restrict(grads, sel)
    r1, r2 = restrict(grads, sel, degree=DEGREE["exp_avg"]), restrict(squared, sel, degree=DEGREE["exp_avg_sq"])
    assert DEGREE["momentum_buffer"] == DEGREE["exp_avg"]
    name = "encoder.layers.1.mlp.linear_fc2.weight"  # coarse layer 1 is fine layer 2, a residual-branch output
    assert torch.equal(params[name], 2 * grads["encoder.layers.2.mlp.linear_fc2.weight"])
    assert torch.equal(r1[name], 0.5 * grads["encoder.layers.2.mlp.linear_fc2.weight"])
    assert torch.equal(r2[name], 0.25 * squared["encoder.layers.2.mlp.linear_fc2.weight"])
    other = "encoder.layers.1.mlp.linear_fc1.weight"
    assert torch.equal(r1[other], grads["encoder.layers.2.mlp.linear_fc1.weight"])


def test_layer_selection_json_and_errors():
    cfg = small_config("gpt_llama")
    sel = LayerSelection(cfg, 1, 1)
    assert LayerSelection.from_json(sel.to_json()) == sel
    assert sel.layers == (1, 3) and sel.coarse.num_layers == 2 and sel.coarse.hidden_size == cfg.hidden_size
    assert "odd fine layers [1, 3] of 4" in sel.describe()
    with pytest.raises(ValueError, match=r"num_layers = 3 is odd"):
        LayerSelection(small_config("gpt_tied", num_layers=3), 0)
    with pytest.raises(ValueError, match=r"invalid residual_scale 3; valid choices are \[1, 2\]"):
        LayerSelection(cfg, 0, 3)
    with pytest.raises(ValueError, match=r"invalid prolongation 'cubic'; valid choices are"):
        prolongation_sources(sel, "cubic")
    sd = random_state_dict(cfg)
    del sd["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match="lacks parameters"):
        restrict(sd, sel)


# ------------------------------------------------------------------ config and phases
def _ode(**ode):
    return {"model": {"num_layers": 4}, "multilevel": {"enabled": True, "strategy": "ode", "ode": ode}}


def test_ode_phase_list():
    cfg = load_config(_ode(cycles=2, pre_steps=2, coarse_steps=3, post_steps=2, final_steps=4,
                           fine_lr={"peak": 0.1}, coarse_lr={"peak": 0.3}, final_lr={"peak": 0.4}))
    phases = build_phases(cfg)
    assert [(p.level, p.steps, p.name, p.arrival, p.cycle, p.parity, p.lr.peak) for p in phases] == [
        (0, 2, "pre", "fresh", 0, None, 0.1), (1, 3, "coarse", "restrict", 0, 0, 0.3),
        (0, 2, "post", "prolong", 0, None, 0.1), (0, 2, "pre", "continue", 1, None, 0.1),
        (1, 3, "coarse", "restrict", 1, 1, 0.3), (0, 2, "post", "prolong", 1, None, 0.1),
        (0, 4, "final", "continue", None, None, 0.4),
    ]
    assert cfg.level_models()[1].num_layers == 2 and cfg.level_models()[1].hidden_size == cfg.model.hidden_size
    # empty fine phases are kept only where the model passes through the fine level
    bare = build_phases(load_config(_ode(cycles=3, pre_steps=0, post_steps=0, coarse="odd")))
    assert [(p.level, p.steps, p.name, p.parity) for p in bare] == [
        (0, 0, "pre", None), (1, 10, "coarse", 1), (0, 0, "pre", None), (1, 10, "coarse", 1), (0, 0, "pre", None),
        (1, 10, "coarse", 1), (0, 0, "final", None)]
    assert [p.parity for p in build_phases(load_config(_ode(cycles=2, coarse="even"))) if p.level] == [0, 0]
    # first_lr: the first phase that trains, and no other
    first = {"peak": 0.5, "warmup_steps": 3}
    with_pre = build_phases(load_config(_ode(cycles=2, pre_steps=2, fine_lr={"peak": 0.1}, first_lr=first)))
    assert [(p.name, p.lr.peak, p.lr.warmup_steps) for p in with_pre][:4] == [
        ("pre", 0.5, 3), ("coarse", 1e-3, 0), ("post", 0.1, 0), ("pre", 0.1, 0)]
    coarse_first = build_phases(load_config(_ode(cycles=2, pre_steps=0, first_lr=first)))
    assert [(p.name, p.steps, p.lr.peak) for p in coarse_first][:3] == [("pre", 0, 1e-3), ("coarse", 10, 0.5),
                                                                        ("post", 10, 1e-3)]


def test_ode_block_round_trips_and_defaults():
    from megatron_multilevel.config import config_to_dict

    cfg = load_config({"model": {"num_layers": 4}, "multilevel": {"enabled": True, "strategy": "ode"}})
    assert cfg.multilevel.ode.residual_scale == 2 and cfg.multilevel.ode.prolongation == "correction"
    assert load_config(config_to_dict(cfg)) == cfg
    assert load_config({"model": {"num_layers": 3}, "multilevel": {"strategy": "ode"}})  # disabled: scratch


@pytest.mark.parametrize(
    "data, message",
    [
        ({"model": {"num_layers": 5}, "multilevel": {"enabled": True, "strategy": "ode"}},
         r"model.num_layers = 5: the ODE strategy's coarse models keep every other layer and need an even number"),
        ({"multilevel": {"ode": {"cycles": 2}}},
         r"multilevel.ode is the ODE strategy's block; set multilevel.strategy = \"ode\".*valid choices are "
         r"\['coalesce', 'ode'\]"),
        ({"multilevel": {"strategy": "ode", "levels": [{}, {}], "alpha": 0.25}},
         r"multilevel: alpha, levels belong\(s\) to the coalesce strategy and mean nothing with strategy 'ode'"),
        ({"multilevel": {"strategy": "ode", "optimizer_state": "map"}},
         r"optimizer_state belong\(s\) to the coalesce strategy.*'optimizer_state'"),
        ({"multilevel": {"strategy": "multigrid"}}, r"valid choices are \['coalesce', 'ode'\]"),
        (_ode(cyles=2), r"config.multilevel.ode: unknown key\(s\) \['cyles'\]; valid keys are \[.*'cycles'"),
        (_ode(residual_scale=3), r"multilevel.ode.residual_scale: invalid value 3; valid choices are \[1, 2\]"),
        (_ode(residual_scale=2.0), r"multilevel.ode.residual_scale: expected an integer"),
        (_ode(parametrisation="implicit"),
         r"multilevel.ode.parametrisation: invalid value 'implicit'; valid choices are \['folded', 'explicit'\]"),
        (_ode(prolongation="cubic"), r"valid choices are \['correction', 'constant', 'linear'\]"),
        (_ode(coarse="both"), r"valid choices are \['alternate', 'even', 'odd'\]"),
        (_ode(optimizer_state="zero"), r"valid choices are \['reset', 'keep', 'map'\]"),
        (_ode(coherence="second_order"), r"valid choices are \['none', 'first_order'\]"),
        (_ode(coarse_steps=0), r"multilevel.ode.coarse_steps must be a positive integer"),
        (_ode(cycles=0), r"multilevel.ode.cycles must be a positive integer"),
        (_ode(coherence_batches=0), r"multilevel.ode.coherence_batches must be a positive integer"),
        (_ode(coarse_steps=3, coherence_batches=4),
         r"multilevel.ode.coherence_batches \(4\) must not exceed multilevel.ode.coarse_steps \(3\)"),
        (_ode(pre_steps=-1), r"multilevel.ode.pre_steps must be >= 0"),
        (_ode(correction_scale=0), r"multilevel.ode.correction_scale must be positive"),
        (_ode(fine_lr={"peak": 0}), r"lr.peak must be in \(0, 10\], got 0"),
        ({**_ode(), "optimizer": {"type": "Lamb"}}, r"optimizer.type = 'Lamb'.*valid choices are \['Adam', 'AdamW', 'Muon', 'SGD'\]"),
        ({**_ode(), "optimizer": {"type": "sgd"}}, r"valid choices are \['Adam', 'AdamW', 'Muon', 'SGD'\]"),
        ({**_ode(), "optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 2}},
         r"\"zero_allow_untested_optimizer\": true for SGD under ZeRO"),
        ({**_ode(coherence="first_order", line_search=True), "fp16": {"enabled": True}}, r"not supported with fp16"),
        (_ode(coherence="first_order"),
         r"multilevel.ode.coherence = \"first_order\" needs multilevel.ode.line_search = true.*coherence \"none\""),
        (_ode(coherence_max_ratio=0), r"multilevel.ode.coherence_max_ratio must be a positive number or null, got 0"),
        (_ode(coherence_max_ratio="high"), r"multilevel.ode.coherence_max_ratio"),
        (_ode(trust_radius=-1.0), r"multilevel.ode.trust_radius must be a positive number or null, got -1.0"),
        ({**_ode(optimizer_state="keep"), "bf16": {"enabled": True}},
         r"optimizer_state = 'keep' with bf16/fp16 needs zero_optimization.stage >= 1"),
        # the coarse models' layout
        (_ode(coarse_tensor_model_parallel_size=3),
         r"^multilevel.ode.coarse_tensor_model_parallel_size = 3 does not divide model.num_attention_heads = 4 "
         r"\(the coarse models keep the fine width\); valid values are \[1, 2, 4\]$"),
        ({**_ode(coarse_tensor_model_parallel_size=8), "model": {"num_layers": 4, "num_attention_heads": 8,
                                                                 "ffn_hidden_size": 100}},
         r"coarse_tensor_model_parallel_size = 8 does not divide model.ffn_hidden_size = 100 .*valid values are "
         r"\[1, 2, 4\]"),
        (_ode(coarse_tensor_model_parallel_size=0),
         r"multilevel.ode.coarse_tensor_model_parallel_size must be a positive"),
        (_ode(coarse_tensor_model_parallel_size=1.0),
         r"multilevel.ode.coarse_tensor_model_parallel_size: expected an integer"),
        (_ode(coarse_deepspeed={"zero_optimisation": {"stage": 3}}),
         r"multilevel.ode.coarse_deepspeed: unknown DeepSpeed key\(s\) \['zero_optimisation'\]; valid keys are .*"
         r"'zero_optimization'"),
        (_ode(coarse_deepspeed={"zero_optimization": {"stage": 4}}),
         r"^multilevel.ode.coarse_deepspeed \(merged into the top-level DeepSpeed keys\): zero_optimization.stage = 4; "
         r"valid choices are \[0, 1, 2, 3\]$"),
        ({**_ode(coarse_deepspeed={"zero_optimization": {"stage": 2}}), "optimizer": {"type": "SGD"}},
         r"^multilevel.ode.coarse_deepspeed .*\"zero_allow_untested_optimizer\": true for SGD under ZeRO"),
        ({**_ode(optimizer_state="map", coarse_deepspeed={"zero_optimization": {"stage": 0}}),
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
         r"^multilevel.ode.coarse_deepspeed .*optimizer_state = 'map' with bf16/fp16 needs zero_optimization.stage"),
        (_ode(optimizer_state="map", coarse_deepspeed={"optimizer": {"type": "SGD", "params": {"momentum": 0.9}},
                                                       "zero_allow_untested_optimizer": True}),
         r"optimizer_state = 'map' carries the fine optimizer's state \['exp_avg', 'exp_avg_sq'\] into the coarse "
         r"optimizer and back, .* with state \['momentum_buffer'\]"),
        (_ode(coarse_deepspeed={"optimizer": {"type": "SGD", "params": {"eps": 1e-8}}}),
         r"^multilevel.ode.coarse_deepspeed .*optimizer.params.eps is not a parameter of optimizer.type = 'SGD'"),
    ],
)
def test_bad_ode_configs(data, message):
    with pytest.raises(ValueError, match=message):
        load_config(data)


def test_sgd_under_zero_with_deepspeed_s_switch():
    cfg = load_config({**_ode(), "optimizer": {"type": "SGD", "params": {"momentum": 0.9}},
                       "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    assert cfg.deepspeed["optimizer"]["type"] == "SGD"


def test_ode_coarse_layout():
    """The coarse models' TP size and DeepSpeed overrides give level 1 its own layout and batch split;
    a TP size the world cannot hold is refused before anything is built, naming the key."""
    from megatron_multilevel.parallel.staging import Layout
    from megatron_multilevel.training.engines import LevelEngines

    layout = {"coarse_tensor_model_parallel_size": 1, "coarse_deepspeed": {"zero_optimization": {"stage": 3}}}
    cfg = load_config({**_ode(**layout), "parallel": {"tensor_model_parallel_size": 2}, "train_batch_size": 8,
                       "zero_optimization": {"stage": 1}})
    assert cfg.level_tp_sizes() == [2, 1]
    assert cfg.level_deepspeed(0)["zero_optimization"] == {"stage": 1}
    assert cfg.level_deepspeed(1)["zero_optimization"] == {"stage": 3}
    levels = LevelEngines(cfg, 2)
    assert (levels.layout(0), levels.layout(1)) == (Layout(2, 1), Layout(1, 3))
    assert (levels.micro_batch(0), levels.micro_batch(1)) == (8, 4)  # the coarse models have DP=2
    assert load_config(_ode()).level_tp_sizes() == [1, 1]
    # keep: the coarse optimizer starts afresh, so it may be another one
    keep = load_config(_ode(optimizer_state="keep", coarse_deepspeed={"optimizer": {"type": "SGD"}}))
    assert keep.level_deepspeed(1)["optimizer"] == {"type": "SGD"}
    with pytest.raises(ValueError, match=r"^level 1: multilevel.ode.coarse_tensor_model_parallel_size = 4 does not "
                                         r"divide the world size 2; valid values are \[1, 2\]$"):
        LevelEngines(load_config({**_ode(coarse_tensor_model_parallel_size=4), "train_batch_size": 8}), 2)
