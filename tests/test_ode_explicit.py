"""The ODE strategy's explicit parametrisation: the coarse step ``h`` in the forward pass (hooks on
every layer's residual branches), the coarse weights copied unscaled. Its coarse model computes the
folded one's function; its maps carry nothing scaled."""

import pytest
import torch

from conftest import random_state_dict, small_config
from megatron_multilevel.config import load_config
from megatron_multilevel.level_maps import LayerSelection
from megatron_multilevel.checkpoints import verify
from megatron_multilevel.ode_operators import fold_step, restrict, unrestrict_layer
from megatron_multilevel.residual_step import residual_step, set_residual_step

pytestmark = pytest.mark.usefixtures("dist_single")


def _coarse_model(tensors, sel):
    """The coarse model of ``sel`` holding ``tensors``, with the forward step its parametrisation takes."""
    from megatron_multilevel.models import build_model, load_parameters

    model = build_model(sel.coarse, perform_initialization=False)
    load_parameters(model, tensors)
    return set_residual_step(model, sel.forward_step).eval()


def _logits(model, cfg, seed=0):
    from megatron_multilevel.models import model_logits

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_sequence_length), generator=gen)
    with torch.no_grad():
        return model_logits(model, cfg, tokens)


@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_llama", "bert_tied", "bert_untied_binary"])
@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("scale", [1, 2])
def test_the_explicit_coarse_model_computes_the_folded_ones_function(variant, parity, scale):
    """From the same random fine weights, each through its own restriction: the same logits, GPT
    and BERT, with and without biases. At scale 2 the weights differ and the step is what makes up
    for it: without the hooks the explicit model computes something else."""
    cfg = small_config(variant, num_layers=6)
    fine = random_state_dict(cfg, seed=parity + 10 * scale)
    folded, explicit = (LayerSelection(cfg, parity, scale, p) for p in ("folded", "explicit"))
    weights = restrict(fine, explicit)
    model = _coarse_model(weights, explicit)
    assert residual_step(model) == scale
    expected = _logits(_coarse_model(restrict(fine, folded), folded), cfg)
    torch.testing.assert_close(_logits(model, cfg), expected, rtol=1e-5, atol=1e-5)
    # the step folded into the explicit weights (to-hf exports so) gives the folded weights bit for bit
    assert not verify.mismatched(fold_step(weights, explicit), restrict(fine, folded))
    if scale == 2:
        name = ("decoder" if cfg.kind == "gpt" else "encoder") + ".layers.0.mlp.linear_fc2.weight"
        assert torch.equal(2 * weights[name], restrict(fine, folded)[name])
        assert (_logits(set_residual_step(model, 1), cfg) - expected).abs().max() > 1e-2


def test_the_explicit_restriction_copies_and_its_moments_carry_over_unscaled():
    """Every coarse tensor is its fine one bit for bit, parameters and optimizer moments alike (the
    degrees of ``parallel.ode_transition.DEGREE`` act on a factor 1)."""
    from megatron_multilevel.parallel.ode_transition import DEGREE

    cfg = small_config("bert_tied", num_layers=4)
    sel = LayerSelection(cfg, 1, 2, "explicit")
    fine = random_state_dict(cfg, seed=7)
    for degree in (1, *DEGREE.values()):
        coarse = restrict(fine, sel, degree=degree)
        for i, j in enumerate(sel.layers):
            prefix = f"encoder.layers.{i}."
            layer = {n[len(prefix):]: t for n, t in coarse.items() if n.startswith(prefix)}
            for local, t in layer.items():
                assert torch.equal(t, fine[f"encoder.layers.{j}.{local}"]), (degree, local)
            back = unrestrict_layer(layer, sel, degree=degree)
            assert all(torch.equal(back[n], layer[n]) for n in layer)


def test_the_hooks_are_idempotent_and_removable():
    from megatron_multilevel.models import build_model

    cfg = small_config("gpt_tied")
    model = build_model(cfg).eval()
    plain = _logits(model, cfg)
    once = _logits(set_residual_step(model, 2), cfg)
    assert not torch.equal(once, plain)
    assert torch.equal(_logits(set_residual_step(model, 2), cfg), once)  # not applied twice
    assert residual_step(model) == 2
    assert torch.equal(_logits(set_residual_step(model, 1), cfg), plain)
    assert residual_step(model) == 1
    assert not any(m._forward_hooks for m in model.modules())


def _ode(**ode):
    return {"model": {"num_layers": 4}, "train_batch_size": 8,
            "multilevel": {"enabled": True, "strategy": "ode", "ode": ode}}


@pytest.mark.parametrize("parametrisation, scale, step", [("folded", 2, 1), ("explicit", 2, 2), ("explicit", 1, 1)])
def test_the_coarse_level_is_built_with_its_step(parametrisation, scale, step):
    """Every model the trainer builds for a coarse phase (fresh, or to be filled by a transition or a
    checkpoint) takes the step; the fine level's never does."""
    from megatron_multilevel.training.engines import LevelEngines

    levels = LevelEngines(load_config(_ode(parametrisation=parametrisation, residual_scale=scale)), 1)
    assert [levels.residual_step(level) for level in (0, 1)] == [1, step]
    assert residual_step(levels.build_empty_model(1)) == step
    assert residual_step(levels.build_initial_model(1)) == step
    assert residual_step(levels.build_empty_model(0)) == 1


def test_the_parametrisation_is_recorded():
    """(A bad ``multilevel.ode.parametrisation`` is in ``test_ode.py::test_bad_ode_configs``.)"""
    assert load_config(_ode()).multilevel.ode.parametrisation == "folded"
    cfg = small_config("gpt_tied")
    sel = LayerSelection(cfg, 0, 2, "explicit")
    assert LayerSelection.from_json(sel.to_json()) == sel
    assert sel.describe().endswith("residual-branch outputs x2 in the forward pass")
    assert (sel.weight_scale, sel.forward_step) == (1, 2)
    # a selection recorded before the parametrisation existed is the folded one
    old = sel.to_json().replace(', "parametrisation": "explicit"', "")
    assert LayerSelection.from_json(old) == LayerSelection(cfg, 0, 2)
    with pytest.raises(ValueError, match=r"invalid parametrisation 'implicit'; valid choices are \['folded', "):
        LayerSelection(cfg, 0, 2, "implicit")


def test_a_coarse_checkpoint_resumes_only_into_the_same_coarse_model():
    """A checkpoint of a coarse phase records its selection; a config that would build the coarse
    model with the other parametrisation (or another step) is refused, naming the key. Old
    checkpoints, without the parametrisation, are folded; fine phases hold no coarse model."""
    from megatron_multilevel.training.context import RunContext
    from megatron_multilevel.training.engines import LevelEngines
    from megatron_multilevel.training.ode_cycle import OdeCycle
    from megatron_multilevel.training.schedule import build_phases

    def cycle(**ode):
        cfg = load_config(_ode(**ode))
        return OdeCycle(RunContext(cfg, build_phases(cfg), LevelEngines(cfg, 1)))

    explicit, folded = cycle(parametrisation="explicit"), cycle()
    coarse = explicit.ctx.phases[1]
    assert coarse.parity == 0
    saved = {"state": {"phase": 1}, "selection": explicit.selection(coarse).to_json()}
    explicit.check_resumable(saved)
    with pytest.raises(ValueError, match=r"holds a coarse model of multilevel.ode.parametrisation = 'explicit', the "
                                         r"config says 'folded'; set it back to resume"):
        folded.check_resumable(saved)
    with pytest.raises(ValueError, match=r"multilevel.ode.residual_scale = 2, the config says 1"):
        cycle(parametrisation="explicit", residual_scale=1).check_resumable(saved)
    old = {"state": {"phase": 1}, "selection": folded.selection(coarse).to_json().replace(
        ', "parametrisation": "folded"', "")}
    folded.check_resumable(old)
    with pytest.raises(ValueError, match=r"parametrisation = 'folded', the config says 'explicit'"):
        explicit.check_resumable(old)
    explicit.check_resumable({"state": {"phase": 0}, "selection": None})
