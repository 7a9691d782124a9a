"""LiGO's learned depth operator: the copy growth at its start, its gradients against the weights'
own, the loss it lowers, and a run that grows with it."""

import json

import pytest
import torch

from conftest import random_state_dict, small_config
from launch_helpers import KEEP_ALL, ROOT, SAME_RUN, assert_close_to_reference, launch, ok, records, run_config
from megatron_multilevel.config import load_config
from megatron_multilevel.level_maps import make_level_map
from megatron_multilevel.operators import coalesce, decoalesce
from megatron_multilevel.plan import layer_prefix
from megatron_multilevel.study.variants import variant_configs
from megatron_multilevel.growth.ligo import initial_coefficients, learn_depth_operator


def _grown(variant: str, scaling: str):
    """A model of 4 layers grown by copying from a random 2-layer one, and its level map."""
    from megatron_multilevel.models import build_model, load_parameters

    cfg = small_config(variant)
    level_map = make_level_map(cfg, width=False, depth_pairing="halves", depth_scaling=scaling)
    coarse = coalesce(random_state_dict(cfg, seed=3), level_map)
    grown = decoalesce(coarse, level_map)
    model = build_model(cfg)
    load_parameters(model, grown)
    return cfg, level_map, model, grown


def _batch(cfg, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_sequence_length), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _loss(cfg):
    from megatron_multilevel.models import language_model_loss

    def loss(model, batch):
        tokens, labels = batch
        return language_model_loss(model, cfg, tokens, labels, torch.ones_like(tokens))
    return loss


@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_llama", "bert_tied"])
@pytest.mark.parametrize("scaling", ["none", "ode", "identity"])
def test_the_operator_starts_at_the_copy_growth(dist_single, variant, scaling):
    """Before any step the learned operator writes the copy growth back, bit for bit; its
    coefficients are 1 where a grown layer copies a coarse layer (worked out from the pairing:
    halves, coarse layer j -> grown layers j and j + 2), 0 elsewhere and on the residual branch of
    the second copy under identity scaling."""
    cfg, level_map, model, grown = _grown(variant, scaling)
    c = initial_coefficients(level_map, ["self_attention.linear_proj.weight", "mlp.linear_fc1.weight"])
    second = 0.0 if scaling == "identity" else 1.0
    assert c["self_attention.linear_proj.weight"].tolist() == [[1, 0], [0, 1], [second, 0], [0, second]]
    assert c["mlp.linear_fc1.weight"].tolist() == [[1, 0], [0, 1], [1, 0], [0, 1]]
    losses = learn_depth_operator(model, level_map, lambda s, m: _batch(cfg, 0), _loss(cfg), steps=0, lr=1e-2)
    assert losses == []
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), grown[name]), name


def test_its_gradient_is_the_weights_gradient_projected(dist_single):
    """One step at a tiny rate: the coefficients' gradients (read through Adam's first moment)
    equal sum over elements of dL/dW_l * B_j, with dL/dW_l from a plain backward pass of the
    copy-grown model, independently of the operator's reparametrisation."""
    cfg, level_map, model, grown = _grown("gpt_tied", "none")
    batch = _batch(cfg, 1)
    loss = _loss(cfg)(model, batch)
    loss.backward()
    params = dict(model.named_parameters())
    name = "mlp.linear_fc2.weight"
    weight_grads = [params[layer_prefix(cfg, layer) + name].grad for layer in range(4)]
    basis = [grown[layer_prefix(cfg, layer) + name] for layer in (0, 1)]  # halves: coarse j is in layers j, j + 2
    expected = torch.tensor([[float((g * b).sum()) for b in basis] for g in weight_grads])
    model.zero_grad()
    seen = {}
    original = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        for group in self.param_groups:
            for p in group["params"]:
                seen.setdefault("grads", []).append(p.grad.clone())
        return original(self, *args, **kwargs)

    torch.optim.Adam.step = spy
    try:
        learn_depth_operator(model, level_map, lambda s, m: batch, _loss(cfg), steps=1, lr=1e-12)
    finally:
        torch.optim.Adam.step = original
    names = [n[len(layer_prefix(cfg, 0)):] for n in params if n.startswith(layer_prefix(cfg, 0))]
    got = seen["grads"][names.index(name)]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_training_the_operator_lowers_the_loss(dist_single):
    """Trained on one batch, the operator lowers that batch's loss, and the grown layers are then
    combinations of the coarse ones (no longer copies)."""
    cfg, level_map, model, grown = _grown("gpt_tied", "identity")
    batch = _batch(cfg, 2)
    losses = learn_depth_operator(model, level_map, lambda s, m: batch, _loss(cfg), steps=20, lr=2e-2)
    assert losses[-1] < losses[0] - 0.01, losses
    with torch.no_grad():
        after = _loss(cfg)(model, batch).item()
    assert after < losses[0]
    name = layer_prefix(cfg, 2) + "mlp.linear_fc1.weight"
    assert not torch.equal(dict(model.named_parameters())[name].detach(), grown[name])


LIGO = {"enabled": True, "cycle": "f", "num_levels": 2, "alpha": 1.0, "coalesce_width": False, "depth_pairing": "halves",
        "depth_scaling": "identity", "growth_operator": "ligo", "ligo_steps": 3, "ligo_lr": 1e-2,
        "levels": [{"steps_before": 4, "lr_before": {"peak": 2e-3, "warmup_steps": 0},
                    "steps_after": 8, "lr_after": {"peak": 2e-3, "warmup_steps": 0}},
                   {"steps_before": 6, "lr_before": {"peak": 4e-3, "warmup_steps": 2}}]}


@pytest.fixture(scope="module")
def ligo_run(tmp_path_factory, corpus):
    """An uninterrupted one-process F-cycle grown by LiGO."""
    tmp = tmp_path_factory.mktemp("ligo")
    out = ok(launch(run_config(tmp, corpus, "run", multilevel=LIGO, training=KEEP_ALL))).stdout
    return {"dir": tmp / "run", "stdout": out}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel": {"tensor_model_parallel_size": 2}}, {"zero_optimization": {"stage": 1}}],
                         ids=["tp2", "dp2-zero1"])
def test_ligo_in_two_layouts_is_the_one_process_run(ligo_run, corpus, tmp_path, layout):
    """The operator's gradients summed over tensor-parallel shards (split parameters only) and
    averaged over data-parallel ranks: TP=2, or DP=2 under ZeRO-1, trains the one-process run."""
    config = run_config(tmp_path, corpus, "run", multilevel=LIGO, training=KEEP_ALL, **layout)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", ligo_run, abs=2e-4)


@pytest.mark.slow
def test_a_run_grows_with_ligo_and_resumes_after_it(ligo_run, corpus, tmp_path):
    """An F-cycle grown by LiGO: the growth says what the operator did, its steps count in FLOPs
    (3 steps of the full model), and a run killed during or after the growth resumes on the same
    losses."""
    assert "LiGO's depth operator trained 3 steps (loss" in ligo_run["stdout"], ligo_run["stdout"][-3000:]
    summary = json.loads((ligo_run["dir"] / "summary.json").read_text())
    plain = {k: v for k, v in LIGO.items() if not k.startswith("ligo_")}  # LiGO's own keys: refused without it
    copy = run_config(tmp_path, corpus, "copy", multilevel={**plain, "growth_operator": "copy"}, training=KEEP_ALL)
    ok(launch(copy))
    copied = json.loads((tmp_path / "copy" / "summary.json").read_text())
    # phases: coarse 6 steps, grown 4, coarse 6, fine 8
    assert [(p["level"], p["steps"]) for p in copied["phases"]] == [(1, 6), (0, 4), (1, 6), (0, 8)]
    fine_step = copied["phases"][3]["flops"] / 8
    assert summary["totals"]["flops"] == pytest.approx(copied["totals"]["flops"] + 3 * fine_step)
    # the runs differ from the growth on: the operator changed the grown weights
    ours, theirs = records(ligo_run["dir"], "train"), records(tmp_path / "copy", "train")
    assert ours[0]["loss"] == theirs[0]["loss"] and ours[-1]["loss"] != theirs[-1]["loss"]
    assert summary["phases"][1]["extra_flops"] == pytest.approx(3 * fine_step)
    # killed in the growth itself (the operator trained, the grown level's engine not built yet)
    # and after it: the resumed runs follow the uninterrupted one
    for where in ("transition1", "step10"):
        killed = run_config(tmp_path, corpus, f"killed-{where}", multilevel=LIGO, training=KEEP_ALL)
        assert launch(killed, env={"MEGATRON_MULTILEVEL_CRASH_AT": where}).returncode != 0
        ok(launch(killed))
        assert_close_to_reference(tmp_path / f"killed-{where}", ligo_run, **SAME_RUN)


def test_ligo_config_errors():
    base = {"train_batch_size": 4, "model": {"kind": "gpt", "num_layers": 4, "hidden_size": 64,
                                             "num_attention_heads": 4, "vocab_size": 128, "max_sequence_length": 16},
            "data": {"seq_length": 16}}
    with pytest.raises(ValueError, match=r"growth_operator: invalid value 'learned'; valid choices are \['copy', 'ligo', 'random'\]"):
        load_config({**base, "multilevel": {**LIGO, "growth_operator": "learned"}})
    with pytest.raises(ValueError, match="ligo_steps must be a positive integer"):
        load_config({**base, "multilevel": {**LIGO, "ligo_steps": 0}})
    with pytest.raises(ValueError, match="grows no level"):
        load_config({**base, "multilevel": {**LIGO, "cycle": "v", "levels": [
            {"steps_before": 2, "steps_after": 2}, {"steps_before": 2}]}})
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        load_config({**base, "zero_optimization": {"stage": 3}, "multilevel": LIGO})


def test_the_benchmark_variant_takes_the_operators_steps_from_the_budget():
    """``ligo``: stacking's schedule with the operator trained 1% of the steps (10 of 1000), those
    full-model steps taken from the steps after growth; a valid config."""
    base = json.loads((ROOT / "configs" / "gpt_tiny_cpu.json").read_text())
    base.pop("multilevel")
    made = variant_configs(base, steps=1000, fine_lr=1e-3, methods=["stacking", "ligo"], coarse_share=0.5)
    ligo, stacking = made["ligo"]["multilevel"], made["stacking"]["multilevel"]
    assert (ligo["growth_operator"], ligo["ligo_steps"]) == ("ligo", 10)
    assert ligo["levels"][0]["steps_after"] == stacking["levels"][0]["steps_after"] - 10
    assert ligo["levels"][1] == stacking["levels"][1]
    assert load_config(made["ligo"]).multilevel.grown_levels() == [0]
