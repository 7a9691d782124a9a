"""The tensor-parallel layout derived from the plan, and transitions in one process."""

import functools

import pytest
import torch

from conftest import VARIANTS, random_state_dict, small_config
from megatron_multilevel.level_maps import make_level_map
from megatron_multilevel.models import build_model, load_parameters, parameter_state_dict
from megatron_multilevel.operators import coalesce, decoalesce
from megatron_multilevel.parallel.tp_layout import partition_dim, shard, unshard
from megatron_multilevel.parallel.staging import Layout
from megatron_multilevel.parallel.transition import coarsen, prolong
from megatron_multilevel.plan import parameter_plan
from megatron_multilevel.training.engines import build_empty_model

pytestmark = pytest.mark.usefixtures("dist_single")


@pytest.mark.parametrize("variant", VARIANTS)
def test_plan_partition_dims_match_megatron_attributes(variant):
    cfg = small_config(variant)
    plan = parameter_plan(cfg)
    for name, p in build_model(cfg).named_parameters():
        _, rule = plan.rule(name)
        expected = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        assert partition_dim(rule) == expected, name


@pytest.mark.parametrize("variant", ["gpt_llama", "bert_untied_binary"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shard_unshard_round_trip(variant, tp):
    cfg = small_config(variant, num_attention_heads=8, num_query_groups=4 if variant == "gpt_llama" else None)
    plan = parameter_plan(cfg)
    for name, full in random_state_dict(cfg).items():
        _, rule = plan.rule(name)
        shards = [shard(full, rule, r, tp) for r in range(tp)]
        assert torch.equal(unshard(shards, rule), full), name
    fc1 = random_state_dict(cfg)["decoder.layers.0.mlp.linear_fc1.weight" if cfg.kind == "gpt" else "encoder.layers.0.mlp.linear_fc1.weight"]
    if cfg.gated:  # rank r holds [gate_r; up_r]
        _, rule = plan.rule("decoder.layers.0.mlp.linear_fc1.weight")
        gate, up = fc1.chunk(2)
        assert torch.equal(shard(fc1, rule, 1, 2), torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


@pytest.mark.parametrize(
    "layout, message",
    [
        (Layout(3, 0), "tensor_model_parallel_size = 3 does not divide the world size"),
        (Layout(1, 4), r"invalid ZeRO stage 4; valid choices are \[0, 1, 2, 3\]"),
    ],
)
def test_bad_layouts(layout, message):
    with pytest.raises(ValueError, match=message):
        layout.check(small_config("gpt_tied"), 6 if layout.tensor_model_parallel_size != 3 else 4, "coarse level layout")


def test_layout_that_cannot_hold_the_level():
    cfg = small_config("gpt_tied", vocab_size=90)
    with pytest.raises(ValueError, match="coarse level layout: .* does not divide model.vocab_size = 90"):
        Layout(4, 0).check(cfg, 4, "coarse level layout")
    lm = make_level_map(small_config("gpt_tied"))
    model = build_model(lm.fine)
    before = {k: v.clone() for k, v in parameter_state_dict(model).items()}
    # a layout that does not fit is refused before anything is built or touched
    with pytest.raises(ValueError, match="coarse level layout: .*tensor_model_parallel_size = 4"):
        coarsen(model, lm, fine_layout=Layout(1, 0), coarse_layout=Layout(4, 0),
                build_target=functools.partial(build_empty_model, lm.coarse, Layout(4, 0)))
    after = parameter_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _target(cfg):
    """The ``build_target`` of a one-process transition into a model of ``cfg``."""
    return functools.partial(build_empty_model, cfg, Layout())


@pytest.mark.parametrize("keep", ["memory", "cpu", "disk"])
def test_single_process_transition_matches_operators(keep, tmp_path):
    cfg = small_config("gpt_llama", num_attention_heads=8, num_query_groups=4)
    lm = make_level_map(cfg)
    fine = build_model(cfg)
    load_parameters(fine, random_state_dict(cfg, seed=3))
    fine_sd = {k: v.clone() for k, v in parameter_state_dict(fine).items()}
    staged, before = coarsen(fine, lm, fine_layout=Layout(), coarse_layout=Layout(), build_target=_target(lm.coarse),
                             keep=keep, keep_dir=str(tmp_path))
    coarse_sd = parameter_state_dict(staged.model)
    expected = coalesce(fine_sd, lm)
    assert all(torch.equal(coarse_sd[k], expected[k]) for k in expected)
    # the source is only read
    assert all(torch.equal(v, fine_sd[k]) for k, v in parameter_state_dict(fine).items())
    with torch.no_grad():
        for p in staged.model.parameters():
            p.add_(0.01)
    coarse_sd = {k: v.clone() for k, v in parameter_state_dict(staged.model).items()}
    # alpha 0.3, not 0.5: the two directions of the interpolation differ by more than rounding
    fine_again = prolong(staged.model, before, lm, 0.3, coarse_layout=Layout(), fine_layout=Layout(),
                         build_target=_target(lm.fine))
    decoalesced = decoalesce(coarse_sd, lm)
    got = parameter_state_dict(fine_again.model)
    assert got.keys() == decoalesced.keys()
    for k, t in decoalesced.items():
        torch.testing.assert_close(got[k], 0.7 * fine_sd[k] + 0.3 * t, msg=k)
    carried_none = r"moments \['exp_avg'\] need the fine level's, kept only for those coarsen carried \(\[\]\)"
    with pytest.raises(ValueError, match=carried_none):
        prolong(staged.model, before, lm, 0.5, coarse_layout=Layout(), fine_layout=Layout(), build_target=_target(lm.fine),
                moments=("exp_avg",))


def test_uninitialised_models_carry_tensor_parallel_attributes():
    cfg = small_config("gpt_llama")
    ref = {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None))
           for n, p in build_model(cfg).named_parameters()}
    got = {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None))
           for n, p in build_model(cfg, perform_initialization=False).named_parameters()}
    assert got == ref


def test_growing_prolongs_without_a_model_before():
    """Progressive stacking: depth de-coalescing with halves pairing stacks the layers."""
    cfg = small_config("gpt_tied")
    lm = make_level_map(cfg, width=False, depth_pairing="halves")
    coarse = build_model(lm.coarse)
    load_parameters(coarse, random_state_dict(lm.coarse, seed=9))
    coarse_sd = parameter_state_dict(coarse)
    grown = prolong(coarse, None, lm, 1.0, coarse_layout=Layout(), fine_layout=Layout(), build_target=_target(lm.fine))
    got = parameter_state_dict(grown.model)
    for j in range(4):  # fine layer j copies coarse layer j mod 2
        name = "mlp.linear_fc1.weight"
        assert torch.equal(got[f"decoder.layers.{j}.{name}"], coarse_sd[f"decoder.layers.{j % 2}.{name}"])
    with pytest.raises(ValueError, match="alpha 0.5 interpolates with the model before coalescing"):
        prolong(coarse, None, lm, 0.5, coarse_layout=Layout(), fine_layout=Layout(), build_target=_target(lm.fine))
