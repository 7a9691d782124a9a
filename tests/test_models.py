import pytest
import torch

from conftest import VARIANTS, small_config
from megatron_multilevel.config import ModelConfig
from megatron_multilevel.distributed import set_seed
from megatron_multilevel.level_maps import make_level_map
from megatron_multilevel.models import build_model, load_parameters, model_logits, parameter_state_dict
from megatron_multilevel.operators import coalesce
from megatron_multilevel.plan import parameter_plan

pytestmark = pytest.mark.usefixtures("dist_single")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_is_planned(variant):
    cfg = small_config(variant)
    model = build_model(cfg)
    plan = parameter_plan(cfg)
    names = set(parameter_state_dict(model))
    for name in names:
        plan.rule(name)  # raises if unknown
    assert {n for n in names if ".layers." not in n} == set(plan.model)


def test_variants_build_what_they_say():
    model = build_model(small_config("gpt_llama"))
    sd = parameter_state_dict(model)
    assert "output_layer.weight" in sd and "embedding.position_embeddings.weight" not in sd
    assert sd["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 256, 64)  # [gate; up]
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in sd
    assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)
    tied = parameter_state_dict(build_model(small_config("gpt_tied")))
    assert "output_layer.weight" not in tied


def _lm_loss(model, cfg, tokens):
    logits = model_logits(model, cfg, tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _train(model, cfg, tokens, steps, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = _lm_loss(model, cfg, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_coarse_model_trains_after_coalescing_a_trained_fine_model():
    set_seed(0)
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=96, max_sequence_length=17)
    tokens = torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(0))
    fine = build_model(cfg)
    fine_losses = _train(fine, cfg, tokens, 10, 3e-3)
    assert fine_losses[-1] < fine_losses[0]
    lm = make_level_map(cfg)
    coarse = build_model(lm.coarse)
    load_parameters(coarse, coalesce(parameter_state_dict(fine), lm))
    losses = _train(coarse, lm.coarse, tokens, 10, 3e-3)
    assert losses[-1] < losses[0] - 0.05
