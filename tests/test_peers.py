"""The published growth methods the recipe is measured against, as methods of this project."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from megatron_multilevel.config import load_config
from megatron_multilevel.level_maps import run_level_maps
from megatron_multilevel.operators import decoalesce
from megatron_multilevel.plan import layer_prefix
from megatron_multilevel.study.variants import compress, gstack_growth_tokens, variant_configs

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
