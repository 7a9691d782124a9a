"""Width de-coalescing preserves the function exactly (up to float rounding); depth does with the
``identity`` depth scaling only."""

import pytest
import torch

from conftest import VARIANTS, random_state_dict, small_config
from megatron_multilevel.level_maps import make_level_map, make_level_maps
from megatron_multilevel.models import build_model, load_parameters, model_logits
from megatron_multilevel.operators import decoalesce

pytestmark = pytest.mark.usefixtures("dist_single")


def _logits(cfg, state_dict, tokens):
    model = build_model(cfg)
    load_parameters(model, state_dict)
    model.eval()
    with torch.no_grad():
        return model_logits(model, cfg, tokens)


def _tokens(cfg):
    return torch.randint(0, cfg.vocab_size, (2, cfg.max_sequence_length), generator=torch.Generator().manual_seed(0))


def _grown_logits(cfg, lm, seed):
    """Logits of a random coarse model of ``lm`` and of the fine model de-coalesced from it."""
    coarse = random_state_dict(lm.coarse, seed=seed)
    tokens = _tokens(cfg)
    return _logits(lm.coarse, coarse, tokens), _logits(cfg, decoalesce(coarse, lm), tokens)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pairing", ["halves", "adjacent"])
def test_width_decoalescing_preserves_logits(variant, pairing):
    cfg = small_config(variant)
    a, b = _grown_logits(cfg, make_level_map(cfg, depth=False, width_pairing=pairing), seed=11)
    assert a.shape == b.shape and a.abs().max() > 0.1
    assert (a - b).abs().max().item() < 1e-5


def test_bert_binary_head_is_preserved():
    cfg = small_config("bert_untied_binary")
    lm = make_level_map(cfg, depth=False)
    coarse = random_state_dict(lm.coarse, seed=12)
    tokens = _tokens(cfg)
    outs = []
    for c, sd in ((lm.coarse, coarse), (cfg, decoalesce(coarse, lm))):
        model = build_model(c)
        load_parameters(model, sd)
        model.eval()
        with torch.no_grad():
            _, binary = model(tokens, torch.ones_like(tokens, dtype=torch.float), torch.zeros_like(tokens))
        outs.append(binary)
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


def test_width_decoalescing_over_three_levels_preserves_logits():
    cfg = small_config("gpt_tied", hidden_size=128, num_attention_heads=8)
    maps = make_level_maps(cfg, 3, depth=False)
    coarsest = random_state_dict(maps[-1].coarse, seed=13)
    tokens = _tokens(cfg)
    a = _logits(maps[-1].coarse, coarsest, tokens)
    b = _logits(cfg, decoalesce(decoalesce(coarsest, maps[1]), maps[0]), tokens)
    assert (a - b).abs().max().item() < 1e-5


def test_depth_decoalescing_is_not_function_preserving():
    cfg = small_config("gpt_tied")
    a, b = _grown_logits(cfg, make_level_map(cfg, width=False), seed=14)
    assert (a - b).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pairing", ["halves", "adjacent"])
@pytest.mark.parametrize("width", [False, True], ids=["depth", "width+depth"])
def test_identity_depth_scaling_preserves_logits(variant, pairing, width):
    cfg = small_config(variant)
    a, b = _grown_logits(cfg, make_level_map(cfg, width=width, depth_pairing=pairing, depth_scaling="identity"), 15)
    assert a.shape == b.shape and a.abs().max() > 0.1
    assert (a - b).abs().max().item() < 1e-5
    # the same coarse model grown with ode scaling computes another function
    _, c = _grown_logits(cfg, make_level_map(cfg, width=width, depth_pairing=pairing, depth_scaling="ode"), 15)
    assert (a - c).abs().max().item() > 1e-3


def test_identity_depth_scaling_over_three_levels_preserves_logits():
    cfg = small_config("gpt_llama", num_layers=8)
    maps = make_level_maps(cfg, 3, width=False, depth_pairing="halves", depth_scaling="identity")
    coarsest = random_state_dict(maps[-1].coarse, seed=16)
    tokens = _tokens(cfg)
    a = _logits(maps[-1].coarse, coarsest, tokens)
    b = _logits(cfg, decoalesce(decoalesce(coarsest, maps[1]), maps[0]), tokens)
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_untied", "bert_tied", "bert_untied_binary"])
def test_aki_width_growth_is_not_function_preserving(variant):
    """Grown in width from the same small model, FPI (the default) computes its logits, AKI (each
    layer's new units from the layer above) other ones."""
    cfg = small_config(variant)
    lm = make_level_map(cfg, depth=False)
    coarse = random_state_dict(lm.coarse, seed=17)
    tokens = _tokens(cfg)
    small = _logits(lm.coarse, coarse, tokens)
    fpi = _logits(cfg, decoalesce(coarse, lm), tokens)
    aki = _logits(cfg, decoalesce(coarse, lm, width_growth="aki"), tokens)
    assert small.abs().max() > 0.1
    assert (small - fpi).abs().max().item() < 1e-5
    assert (small - aki).abs().max().item() > 1e-3
