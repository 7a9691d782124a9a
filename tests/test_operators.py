import pytest
import torch

from conftest import VARIANTS, random_state_dict, small_config
from megatron_multilevel.level_maps import make_level_map, make_level_maps
from megatron_multilevel.operators import coalesce, correct, correct_model, decoalesce, interpolate
from megatron_multilevel.plan import parameter_plan

pytestmark = pytest.mark.usefixtures("dist_single")

SHAPES = [
    dict(width=True, depth=True),
    dict(width=True, depth=False),
    dict(width=False, depth=True),
]


def assert_equal_dicts(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=["width+depth", "width", "depth"])
@pytest.mark.parametrize("scaling", ["none", "ode", "identity"])
def test_round_trip_is_exact(variant, shape, scaling):
    cfg = small_config(variant)
    lm = make_level_map(cfg, depth_scaling=scaling, width_pairing="adjacent", **shape)
    coarse = random_state_dict(lm.coarse, seed=1)
    # coalesce(decoalesce(x)) == x, bit for bit
    assert_equal_dicts(coalesce(decoalesce(coarse, lm), lm), coarse)
    # decoalesce(coalesce(.)) is idempotent
    fine = random_state_dict(cfg, seed=2)
    once = decoalesce(coalesce(fine, lm), lm)
    assert_equal_dicts(decoalesce(coalesce(once, lm), lm), once)
    assert not all(torch.equal(once[k], fine[k]) for k in fine)  # it is a real projection


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=["width+depth", "width", "depth"])
def test_decoalesced_tensors_share_no_storage(variant, shape):
    """Every fine tensor is its own (the transitions' writers adopt them), none the coarse one's."""
    cfg = small_config(variant)
    lm = make_level_map(cfg, depth_scaling="identity", **shape)
    coarse = random_state_dict(lm.coarse, seed=10)
    tensors = list(decoalesce(coarse, lm).values()) + list(coarse.values())
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == len(tensors)


def test_k_levels_round_trip():
    cfg = small_config("gpt_llama", num_layers=8, hidden_size=128, num_attention_heads=8, num_query_groups=4)
    maps = make_level_maps(cfg, 3, depth_pairing="halves")
    coarsest = random_state_dict(maps[-1].coarse, seed=3)
    fine = decoalesce(decoalesce(coarsest, maps[1]), maps[0])
    assert fine["embedding.word_embeddings.weight"].shape == (96, 128)
    assert_equal_dicts(coalesce(coalesce(fine, maps[0]), maps[1]), coarsest)


def _reference_matrices(lm):
    """Dense F and C per dimension kind, built from the paper's per-unit definitions."""
    cfg = lm.fine
    hn, r = cfg.kv_channels, cfg.heads_per_group
    maps = {"hidden": list(lm.hidden.assignment), "ffn": list(lm.ffn.assignment)}
    groups = lm.query_groups.assignment
    maps["qkv"] = [
        groups[g] * (r + 2) * hn + s * hn + c
        for g in range(cfg.num_query_groups) for s in range(r + 2) for c in range(hn)
    ]
    maps["heads"] = [
        (groups[h // r] * r + h % r) * hn + c for h in range(cfg.num_attention_heads) for c in range(hn)
    ]
    f = cfg.ffn_hidden_size
    maps["ffn_glu"] = maps["ffn"] + [i + f // 2 for i in maps["ffn"]]
    out = {}
    for kind, pi in maps.items():
        n = len(pi)
        F = torch.zeros(n // 2, n, dtype=torch.float64)
        C = torch.zeros(n, n // 2, dtype=torch.float64)
        for j, i in enumerate(pi):
            F[i, j] = 0.5
            C[j, i] = 1.0
        out[kind] = (F, C)
    return out


def _dense_coalesce(t, rule, mats, decoalesce=False):
    w = t.double()
    for dim, d in enumerate(rule.dims):
        if d.side is None:
            continue
        F, C = mats[d.kind]
        if decoalesce:  # C_out W F_in
            M = C if d.side == "out" else F.T
        else:  # F_out W C_in
            M = F if d.side == "out" else C.T
        w = torch.movedim(torch.tensordot(M, torch.movedim(w, dim, 0), dims=1), 0, dim)
    if rule.tied_output_norm:
        w = w * (0.5 if decoalesce else 2.0)
    return w


@pytest.mark.parametrize("variant", ["gpt_llama", "bert_untied_binary", "gpt_tied"])
@pytest.mark.parametrize("pairing", ["halves", "adjacent"])
def test_matches_dense_F_W_C(variant, pairing):
    cfg = small_config(variant, num_attention_heads=8, num_query_groups=4 if variant == "gpt_llama" else None)
    lm = make_level_map(cfg, width_pairing=pairing, depth_pairing=pairing)
    mats = _reference_matrices(lm)
    plan = parameter_plan(cfg)
    fine = random_state_dict(cfg, seed=4)
    coarse = coalesce(fine, lm)
    stack = "decoder" if cfg.kind == "gpt" else "encoder"
    pairs = lm.layers.partners
    for name, t in coarse.items():
        layer, rule = plan.rule(name)
        if layer is None:
            expected = _dense_coalesce(fine[name], rule, mats)
        else:
            local = name.split(".", 3)[3]
            a, b = pairs[0][layer].item(), pairs[1][layer].item()
            expected = 0.5 * (
                _dense_coalesce(fine[f"{stack}.layers.{a}.{local}"], rule, mats)
                + _dense_coalesce(fine[f"{stack}.layers.{b}.{local}"], rule, mats)
            )
        torch.testing.assert_close(t.double(), expected, rtol=1e-6, atol=1e-7, msg=name)
    fine_again = decoalesce(coarse, lm)
    for name, t in fine_again.items():
        layer, rule = plan.rule(name)
        if layer is None:
            src = coarse[name]
        else:
            local = name.split(".", 3)[3]
            src = coarse[f"{stack}.layers.{lm.layers.assignment[layer]}.{local}"]
        expected = _dense_coalesce(src, rule, mats, decoalesce=True)
        torch.testing.assert_close(t.double(), expected, rtol=1e-6, atol=1e-7, msg=name)


def test_ode_depth_scaling_doubles_residual_outputs():
    cfg = small_config("gpt_tied")
    plain = make_level_map(cfg, width=False)
    ode = make_level_map(cfg, width=False, depth_scaling="ode")
    fine = random_state_dict(cfg, seed=5)
    a, b = coalesce(fine, plain), coalesce(fine, ode)
    for name in a:
        residual = name.endswith(("linear_proj.weight", "linear_proj.bias", "linear_fc2.weight", "linear_fc2.bias"))
        assert torch.equal(b[name], 2 * a[name] if residual else a[name]), name
    # layer 0 of the coarse model averages fine layers 0 and 1 (adjacent pairing)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    torch.testing.assert_close(
        a[name], 0.5 * (fine[name] + fine["decoder.layers.1.mlp.linear_fc1.weight"]), rtol=0, atol=0
    )


def test_identity_depth_scaling_zeroes_the_second_layers_residual_outputs():
    cfg = small_config("gpt_tied")
    lm = make_level_map(cfg, width=False, depth_pairing="halves", depth_scaling="identity")
    coarse = random_state_dict(lm.coarse, seed=9)
    fine = decoalesce(coarse, lm)
    for name, t in fine.items():
        if ".layers." not in name:
            continue
        layer, local = int(name.split(".")[2]), name.split(".", 3)[3]
        src = coarse[f"decoder.layers.{layer % 2}.{local}"]  # halves: layer i and i + 2 share coarse layer i
        residual = local.endswith(("linear_proj.weight", "linear_proj.bias", "linear_fc2.weight", "linear_fc2.bias"))
        assert torch.equal(t, torch.zeros_like(src) if residual and layer >= 2 else src), name


def test_interpolate_endpoints_and_midpoint():
    cfg = small_config("gpt_tied")
    x, y = random_state_dict(cfg, seed=6), random_state_dict(cfg, seed=7)
    assert_equal_dicts(interpolate(x, y, 0.0), x)
    assert_equal_dicts(interpolate(x, y, 1.0), y)
    mid = interpolate(x, y, 0.25)
    for k in x:
        torch.testing.assert_close(mid[k], 0.75 * x[k] + 0.25 * y[k])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=["width+depth", "width", "depth"])
@pytest.mark.parametrize("scaling", ["none", "ode", "identity"])
def test_correction_of_an_unchanged_coarse_model_returns_the_fine_one(variant, shape, scaling):
    """A coarse visit that changes nothing corrects nothing, bit for bit: the fine model's own
    detail, which coalescing averages away and interpolation would blend away, is kept."""
    cfg = small_config(variant)
    lm = make_level_map(cfg, depth_scaling=scaling, width_pairing="adjacent", **shape)
    fine = random_state_dict(cfg, seed=3)
    assert_equal_dicts(correct_model(fine, coalesce(fine, lm), lm, 0.7), fine)
    blended = interpolate(fine, decoalesce(coalesce(fine, lm), lm), 0.7)
    assert not all(torch.equal(blended[k], fine[k]) for k in fine)


def test_correction_by_hand():
    """Depth only, halves, identity growth: fine layers 0 and 2 form coarse layer 0. A change ``d``
    of the coarse model is added, times alpha, to both layers of its pair, but for the residual
    outputs, which the first layer takes whole; the rest of the model takes alpha ``d``."""
    cfg = small_config("gpt_tied")
    lm = make_level_map(cfg, width=False, depth_pairing="halves", depth_scaling="identity")
    fine = random_state_dict(cfg, seed=11)
    change = random_state_dict(lm.coarse, seed=12)
    start = coalesce(fine, lm)
    end = {k: start[k] + change[k] for k in start}
    out = correct_model(fine, end, lm, 0.5)
    for name, t in out.items():
        if ".layers." not in name:
            torch.testing.assert_close(t, fine[name] + 0.5 * change[name], rtol=0, atol=1e-6)
            continue
        layer, local = int(name.split(".")[2]), name.split(".", 3)[3]
        d = change[f"decoder.layers.{layer % 2}.{local}"]
        residual = local.endswith(("linear_proj.weight", "linear_proj.bias", "linear_fc2.weight", "linear_fc2.bias"))
        expected = fine[name] + (0 if residual and layer >= 2 else 0.5 * d)
        torch.testing.assert_close(t, expected, rtol=0, atol=1e-6, msg=name)
    # the two layers of a pair keep their difference (but for the first's residual outputs)
    a, b = out["decoder.layers.0.mlp.linear_fc1.weight"], out["decoder.layers.2.mlp.linear_fc1.weight"]
    torch.testing.assert_close(a - b, fine["decoder.layers.0.mlp.linear_fc1.weight"]
                               - fine["decoder.layers.2.mlp.linear_fc1.weight"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("alpha", [-0.01, 1.5])
def test_interpolate_rejects_alpha(alpha):
    cfg = small_config("gpt_tied")
    x = random_state_dict(cfg)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        interpolate(x, x, alpha)


def test_interpolate_rejects_different_models():
    x = random_state_dict(small_config("gpt_tied"))
    y = dict(x)
    y.pop("decoder.final_layernorm.bias")
    with pytest.raises(ValueError, match="interpolate: the models differ in parameters"):
        interpolate(x, y, 0.5)
    with pytest.raises(ValueError, match="correct: the models differ in parameters"):
        correct(x, x, y, 1.0)
    z = dict(x)
    z["decoder.final_layernorm.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"interpolate: 'decoder.final_layernorm.bias' has shapes \(64,\) and \(3,\)"):
        interpolate(x, z, 0.5)
    with pytest.raises(ValueError, match=r"correct: 'decoder.final_layernorm.bias' has shapes \(64,\) and \(64,\) and \(3,\)"):
        correct(x, x, z, 1.0)


def test_unknown_parameter_is_an_error():
    cfg = small_config("gpt_tied")
    lm = make_level_map(cfg)
    sd = random_state_dict(cfg)
    sd["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match="q_layernorm.weight.*not in the multilevel plan"):
        coalesce(sd, lm)
    sd = random_state_dict(cfg)
    sd["output_layer.weight"] = torch.ones(96, 64)  # a tied model has no output weight
    with pytest.raises(ValueError, match="output_layer.weight"):
        coalesce(sd, lm)


def test_state_dict_of_another_model_is_an_error():
    lm = make_level_map(small_config("gpt_tied"))
    with pytest.raises(ValueError, match="does not match the model"):
        coalesce(random_state_dict(small_config("gpt_tied", hidden_size=128)), lm)
    with pytest.raises(ValueError, match="layers"):
        coalesce(random_state_dict(small_config("gpt_tied", num_layers=2)), lm)
    sd = random_state_dict(small_config("gpt_tied"))
    del sd["decoder.layers.1.mlp.linear_fc1.bias"]
    with pytest.raises(ValueError, match="lacks parameters"):
        coalesce(sd, lm)


def test_transformer_engine_names_are_planned():
    cfg = small_config("gpt_tied")
    lm = make_level_map(cfg, depth=False)
    sd = random_state_dict(cfg)
    te = {}
    for k, v in sd.items():
        k = k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
        te[k.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")] = v
    out = coalesce(te, lm)
    assert out["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"].shape == (32,)
    assert_equal_dicts(coalesce(decoalesce(out, lm), lm), out)
