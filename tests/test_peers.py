"""The published growth methods the recipe is measured against, as methods of this project."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import VARIANTS, random_state_dict, small_config
from megatron_multilevel.config import load_config
from megatron_multilevel.level_maps import make_level_map, run_level_maps
from megatron_multilevel.operators import decoalesce
from megatron_multilevel.plan import layer_prefix
from megatron_multilevel.study.variants import compress, gstack_growth_tokens, variant_configs
from megatron_multilevel.growth.mask import growth_mask, grown_layers, transformer_layers

ROOT = Path(__file__).resolve().parents[1]


def _base(layers: int = 8) -> dict:
    base = json.loads((ROOT / "configs" / "gpt_tiny_cpu.json").read_text())
    base.pop("multilevel")
    base["model"].update(num_layers=layers, vocab_size=64, hidden_size=32, num_attention_heads=4,
                         max_sequence_length=16)
    base["data"] = {**base.get("data", {}), "seq_length": 16}
    return base


def test_gstack_growth_timing_is_the_papers_rule():
    """log10(d) = 0.88 log10(N) + 163.27 / log10(C) - 5.74, worked out by hand at N = 1e9, C = 1e21:
    7.92 + 7.7748 - 5.74 = 9.9548, so d = 9.01e9 tokens; more parameters grow later, more compute earlier."""
    assert gstack_growth_tokens(1e9, 1e21) == pytest.approx(10 ** (7.92 + 163.27 / 21 - 5.74))
    assert gstack_growth_tokens(1e9, 1e21) == pytest.approx(9.011e9, rel=1e-3)
    assert gstack_growth_tokens(7e9, 1e21) > gstack_growth_tokens(1e9, 1e21)
    assert gstack_growth_tokens(1e9, 1e22) < gstack_growth_tokens(1e9, 1e21)
    with pytest.raises(ValueError, match="positive"):
        gstack_growth_tokens(0, 1e21)


@pytest.mark.parametrize("factor", [2, 4])
def test_gstack_stacks_the_whole_small_model(factor):
    """Grown by the gstack config's own level maps, layer k of the full model is layer k mod (L / g)
    of the small one, every parameter of it; embeddings, final norm and output are the small
    model's (checked by indexing the small model's state dict, not through the operators)."""
    cfg = load_config(variant_configs(_base(8), steps=100, fine_lr=1e-3, methods=["gstack"], coarse_share=0.5,
                                      gstack_factor=factor)["gstack"])
    models = cfg.level_models()
    assert [m.num_layers for m in models] == ([8, 4] if factor == 2 else [8, 4, 2])
    small_cfg = models[-1]
    torch.manual_seed(0)
    from megatron_multilevel.distributed import init_single_process
    from megatron_multilevel.models import build_model

    init_single_process()
    small = {k: v for k, v in build_model(small_cfg).state_dict().items() if "_extra_state" not in k}
    for name, t in small.items():  # every entry distinct, so a wrong source layer shows
        small[name] = torch.randn_like(t) if t.is_floating_point() else t
    state = small
    for level_map in reversed(run_level_maps(cfg)):
        state = decoalesce(state, level_map)
    q = small_cfg.num_layers
    layer = re.compile(re.escape(layer_prefix(models[0], 0)).replace("0", r"(\d+)", 1) + "(.*)")
    assert layer.match(layer_prefix(models[0], 7) + "x").groups() == ("7", "x")
    grown = 0
    for name, t in state.items():
        match = layer.match(name)
        if match:  # fine layer k <- small layer k mod q
            k, rest = int(match.group(1)), match.group(2)
            assert torch.equal(t, small[layer_prefix(small_cfg, k % q) + rest]), name
            grown += 1
        else:
            assert torch.equal(t, small[name]), name
    assert grown == 8 * sum(1 for name in small if layer.match(name)) // q


def test_gstack_budget_and_schedule():
    """The small model's steps are the share asked for; the quarter-depth steps cost their FLOPs
    ratio of the budget; as published, growth restarts the optimizer and the schedule, warmed up."""
    base = _base(8)
    made = variant_configs(base, steps=1000, fine_lr=1e-3, warmup=40, methods=["gstack"], coarse_share=0.8,
                           gstack_share=0.25)["gstack"]
    ml = made["multilevel"]
    assert ml["levels"][2]["steps_before"] == 250 and ml["levels"][1].get("steps_after", 0) == 0
    cfg = load_config(made)
    from megatron_multilevel.flops import flops_per_token

    seq = cfg.data.seq_length
    ratio = flops_per_token(cfg.level_models()[2], seq) / flops_per_token(cfg.model, seq)
    assert ml["levels"][0]["steps_after"] == int(1000 - 250 * ratio)
    assert (ml["optimizer_state"], ml["lr_schedule"], ml["depth_scaling"]) == ("reset", "restart", "none")
    assert ml["levels"][0]["lr_after"]["warmup_steps"] == 20  # after_warmup's default
    # compressed for the equal-quality measure, the phase of no steps stays empty
    assert compress(made, 0.5)["multilevel"]["levels"][1].get("steps_after", 0) == 0
    for bad, message in (({"gstack_factor": 3}, r"valid choices are \[2, 4\]"), ({"gstack_share": 1.0}, r"\(0, 1\)")):
        with pytest.raises(ValueError, match=message):
            variant_configs(base, steps=1000, fine_lr=1e-3, methods=["gstack"], **bad)
    assert math.isclose(ratio, 0.25, rel_tol=0.5)  # a quarter of the layers, plus the output layer's share


# ---------------------------------------------------------------- MSG: masked layer growth
def _logits(model, cfg, tokens):
    from megatron_multilevel.models import model_logits

    with torch.no_grad():
        return model_logits(model, cfg, tokens).float()


@pytest.mark.usefixtures("dist_single")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pairing", ["halves", "adjacent"])
def test_msg_mask_makes_depth_growth_function_preserving(variant, pairing):
    """Grown by plain copies (depth_scaling none), the full model computes another function than the
    small one; with the layers growth added masked at 0 it computes the small one (1e-5, fp32), at 1
    the unmasked full model exactly, and in between neither."""
    from megatron_multilevel.models import build_model, load_parameters

    cfg = small_config(variant)
    lm = make_level_map(cfg, width=False, depth_pairing=pairing, depth_scaling="none")
    coarse = random_state_dict(lm.coarse, seed=21)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_sequence_length), generator=torch.Generator().manual_seed(3))
    small = build_model(lm.coarse)
    load_parameters(small, coarse)
    small.eval()
    want = _logits(small, lm.coarse, tokens)
    model = build_model(cfg)
    load_parameters(model, decoalesce(coarse, lm))
    model.eval()
    plain = _logits(model, cfg, tokens)
    assert want.abs().max() > 0.1 and (plain - want).abs().max() > 1e-3
    mask = growth_mask(model, lm, steps=4)
    assert mask.at(0) == 0.0
    assert (_logits(model, cfg, tokens) - want).abs().max().item() < 1e-5
    assert mask.at(2) == 0.5
    half = _logits(model, cfg, tokens)
    assert min((half - want).abs().max(), (half - plain).abs().max()) > 1e-4
    assert mask.at(4) == 1.0 and mask.at(9) == 1.0
    assert torch.equal(_logits(model, cfg, tokens), plain)
    mask.at(0)
    mask.remove()
    assert torch.equal(_logits(model, cfg, tokens), plain)


@pytest.mark.usefixtures("dist_single")
def test_msg_mask_scales_the_new_layers_gradients():
    """At 0 the layers growth added get no gradient (the others do); at 0.5 they do: the mask is on
    their output, not on anything the kept layers compute."""
    from megatron_multilevel.models import build_model, load_parameters, model_logits

    cfg = small_config("gpt_tied")
    lm = make_level_map(cfg, width=False, depth_pairing="halves", depth_scaling="none")
    model = build_model(cfg)
    load_parameters(model, decoalesce(random_state_dict(lm.coarse, seed=22), lm))
    mask = growth_mask(model, lm, steps=2)
    assert grown_layers(lm) == [2, 3]
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_sequence_length), generator=torch.Generator().manual_seed(4))

    def grad_norms(value_step):
        model.zero_grad()
        mask.at(value_step)
        model_logits(model, cfg, tokens).float().square().mean().backward()
        return [sum(p.grad.norm().item() for p in layer.parameters() if p.grad is not None)
                for layer in transformer_layers(model)]

    at0 = grad_norms(0)
    assert at0[2] == 0.0 and at0[3] == 0.0 and at0[0] > 0 and at0[1] > 0
    assert all(g > 0 for g in grad_norms(1))
    mask.remove()


def test_msg_config_checks():
    """growth_mask_steps: a non-negative integer, depth growth only, within the grown level's visit."""
    made = variant_configs(_base(8), steps=1000, fine_lr=1e-3, methods=["msg", "stacking"], coarse_share=0.5,
                           msg_mask_share=0.05)
    ml = made["msg"]["multilevel"]
    assert (ml["growth_mask_steps"], ml["depth_scaling"], ml["cycle"]) == (50, "none", "grow")
    assert ml["levels"] == made["stacking"]["multilevel"]["levels"]  # stacking's schedule
    assert load_config(made["msg"]).multilevel.growth_mask_steps == 50
    after = ml["levels"][0]["steps_after"]
    for change, message in (
        ({"growth_mask_steps": -1}, "non-negative integer"),
        ({"growth_mask_steps": 2.5}, "growth_mask_steps: expected an integer"),
        ({"coalesce_width": True}, "coalesce_width false"),
        ({"depth_scaling": "ode"}, r"\['none', 'identity'\]"),
        ({"growth_mask_steps": after + 1}, f"longer than the {after} steps"),
    ):
        bad = json.loads(json.dumps(made["msg"]))
        bad["multilevel"].update(change)
        with pytest.raises(ValueError, match=message):
            load_config(bad)
    vcycle = variant_configs(_base(8), steps=1000, fine_lr=1e-3, methods=["vcycle2"], shape="depth")["vcycle2"]
    vcycle["multilevel"]["growth_mask_steps"] = 5
    with pytest.raises(ValueError, match="grows no level"):
        load_config(vcycle)
    with pytest.raises(ValueError, match="msg_mask_share"):
        variant_configs(_base(8), steps=1000, fine_lr=1e-3, methods=["msg"], coarse_share=0.5, msg_mask_share=0.9)


# ---------------------------------------------------------------- bert2BERT: FPI width growth with stacking
@pytest.mark.usefixtures("dist_single")
def test_bert2bert_grows_width_by_fpi_and_depth_by_stacking():
    """The bert2bert config's small model is half as wide and deep, at 3 times the rate; grown by its
    own level maps, fine layer k is small layer k mod (L / 2) widened by FPI, which is what a
    width-only de-coalescing (function-preserving: tests/test_function_preservation.py) makes of it."""
    from megatron_multilevel.flops import flops_per_token

    made = variant_configs(_base(8), steps=1000, fine_lr=1e-3, warmup=40, methods=["bert2bert"], coarse_share=0.5)
    cfg = load_config(made["bert2bert"])
    fine, small = cfg.level_models()
    assert (small.num_layers, small.hidden_size) == (fine.num_layers // 2, fine.hidden_size // 2)
    ml = made["bert2bert"]["multilevel"]
    assert ml["levels"][1]["steps_before"] == 500 and ml["levels"][1]["lr_before"]["peak"] == pytest.approx(3e-3)
    seq = cfg.data.seq_length
    ratio = flops_per_token(small, seq) / flops_per_token(fine, seq)
    assert ml["levels"][0]["steps_after"] == int(1000 - 500 * ratio)
    (level_map,) = run_level_maps(cfg)
    small_state = random_state_dict(small, seed=23)
    grown = decoalesce(small_state, level_map)
    q = small.num_layers
    wide_small = dataclasses.replace(fine, num_layers=q)  # the small model's depth at the full width
    widened = decoalesce(small_state, make_level_map(wide_small, depth=False, width_pairing=cfg.multilevel.width_pairing))
    for name, t in grown.items():
        if name.startswith(layer_prefix(fine, 0)[: -len("0.")]):
            k, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            source = layer_prefix(small, int(k) % q) + rest
            assert torch.equal(t, widened[source]), name
        else:
            assert torch.equal(t, widened[name]), name


@pytest.mark.usefixtures("dist_single")
def test_bert2bert_aki_grows_width_by_aki_and_depth_by_stacking():
    """``bert2bert_init="aki"``: the same config but ``multilevel.width_growth`` (the FPI config
    carries no such key, as before); grown by its own level maps, fine layer k is small layer
    k mod (L / 2) widened by AKI from the small layer above it (the top one: itself)."""
    fpi = variant_configs(_base(8), steps=1000, fine_lr=1e-3, warmup=40, methods=["bert2bert"],
                          coarse_share=0.5)["bert2bert"]
    made = variant_configs(_base(8), steps=1000, fine_lr=1e-3, warmup=40, methods=["bert2bert"], coarse_share=0.5,
                           bert2bert_init="aki")["bert2bert"]
    assert "width_growth" not in fpi["multilevel"] and load_config(fpi).multilevel.width_growth == "fpi"
    assert made["multilevel"] == {**fpi["multilevel"], "width_growth": "aki"}
    cfg = load_config(made)
    assert cfg.multilevel.width_growth == "aki"
    fine, small = cfg.level_models()
    (level_map,) = run_level_maps(cfg)
    small_state = random_state_dict(small, seed=24)
    grown = decoalesce(small_state, level_map, width_growth="aki")
    q = small.num_layers
    wide_small = dataclasses.replace(fine, num_layers=q)
    widening = make_level_map(wide_small, depth=False, width_pairing=cfg.multilevel.width_pairing)
    widened = decoalesce(small_state, widening, width_growth="aki")
    by_fpi = decoalesce(small_state, widening)
    assert any(not torch.equal(t, by_fpi[name]) for name, t in widened.items())
    for name, t in grown.items():
        if name.startswith(layer_prefix(fine, 0)[: -len("0.")]):
            k, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            assert torch.equal(t, widened[layer_prefix(small, int(k) % q) + rest]), name
        else:
            assert torch.equal(t, widened[name]), name


def test_width_growth_checks():
    """``multilevel.width_growth``: 'fpi' or 'aki', 'aki' only where a level grows in width; a clear
    error at config load otherwise, naming the key and the valid choices."""
    made = variant_configs(_base(8), steps=1000, fine_lr=1e-3, coarse_share=0.5, bert2bert_init="aki",
                           methods=["bert2bert", "stacking", "vcycle2", "ode2"])
    for method, change, message in (
        ("bert2bert", {"width_growth": "copy"}, r"multilevel.width_growth: invalid value 'copy'; valid choices are "
                                                r"\['fpi', 'aki'\]"),
        ("bert2bert", {"coalesce_width": False}, "width_growth 'aki'.*needs coalesce_width true"),
        ("stacking", {"width_growth": "aki"}, "width_growth 'aki'.*needs coalesce_width true"),
        ("vcycle2", {"width_growth": "aki"}, r"width_growth 'aki': cycle 'v' grows no level.*\['fpi', 'aki'\]"),
        ("ode2", {"width_growth": "aki"}, "width_growth belong.* to the coalesce strategy"),
    ):
        bad = json.loads(json.dumps(made[method]))
        bad["multilevel"].update(change)
        with pytest.raises(ValueError, match=message):
            load_config(bad)
    fcycle = variant_configs(_base(8), steps=1000, fine_lr=1e-3, methods=["fcycle2"])["fcycle2"]
    fcycle["multilevel"]["width_growth"] = "aki"  # an F-cycle grows the fine level once
    assert load_config(fcycle).multilevel.width_growth == "aki"
    with pytest.raises(ValueError, match=r"bert2bert_init 'copy'; valid choices are \['fpi', 'aki'\]"):
        variant_configs(_base(8), steps=1000, fine_lr=1e-3, methods=["bert2bert"], bert2bert_init="copy")
