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


# ---------------------------------------------------------------- bert2BERT's AKI width growth
def _move(w, dim, matrix):
    """``matrix`` applied along ``dim`` of ``w``."""
    return torch.movedim(torch.tensordot(matrix, torch.movedim(w, dim, 0), dims=1), 0, dim)


def _new_units(copy_matrix):
    """The units growth adds: the later of the two fine units of each coarse unit (a column of C)."""
    new = torch.zeros(copy_matrix.shape[0], dtype=torch.bool)
    for i in range(copy_matrix.shape[1]):
        new[copy_matrix[:, i].nonzero().flatten()[1]] = True
    return new


def _aki_by_hand(own, above, rule, mats):
    """AKI by the paper's two steps, with dense matrices: the tensor of this layer and of the layer
    above, each expanded on its in side (``F_in``: an in-unit's weights halved between its two
    copies), then on the out side the units the small model had from this layer, the new ones from
    the layer above."""
    wide = []
    for t in (own, above):
        w = t.double()
        for dim, d in enumerate(rule.dims):
            if d.side == "in":
                w = _move(w, dim, mats[d.kind][0].T)
        wide.append(w)
    w, w_above = wide
    for dim, d in enumerate(rule.dims):
        if d.side == "out":
            C = mats[d.kind][1]
            shape = [1] * w.dim()
            shape[dim] = -1
            w = torch.where(_new_units(C).view(shape), _move(w_above, dim, C), _move(w, dim, C))
    return w


@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_untied", "gpt_llama", "bert_tied", "bert_untied_binary"])
@pytest.mark.parametrize("pairing", ["halves", "adjacent"])
def test_aki_matches_its_definition_by_hand(variant, pairing):
    """Every tensor of every grown layer is bert2BERT's AKI built with dense matrices from the small
    model's layer and the one above it (the top layer: itself, so FPI); outside the layers, FPI."""
    cfg = small_config(variant, num_layers=8, num_attention_heads=8,
                       num_query_groups=4 if variant == "gpt_llama" else None)
    lm = make_level_map(cfg, width_pairing=pairing, depth_pairing=pairing)
    mats = _reference_matrices(lm)
    plan = parameter_plan(cfg)
    coarse = random_state_dict(lm.coarse, seed=6)
    grown, fpi = decoalesce(coarse, lm, width_growth="aki"), decoalesce(coarse, lm)
    stack = "decoder" if cfg.kind == "gpt" else "encoder"
    q = lm.coarse.num_layers
    changed = set()
    for name, t in grown.items():
        layer, rule = plan.rule(name)
        if layer is None:
            assert torch.equal(t, fpi[name]), name
            continue
        local = name.split(".", 3)[3]
        k = lm.layers.assignment[layer]
        above = min(k + 1, q - 1)
        own, upper = (coarse[f"{stack}.layers.{i}.{local}"] for i in (k, above))
        expected = _aki_by_hand(own, upper, rule, mats)
        assert torch.equal(t.double(), expected), name
        if not torch.equal(t, fpi[name]):
            changed.add(k)
    assert changed == set(range(q - 1))  # every layer but the top one draws from the one above


@pytest.mark.parametrize("variant", ["gpt_tied", "bert_untied_binary"])
def test_aki_new_units_rows_are_the_next_layers(variant):
    """Halves pairing, stacked (depth halves): fine unit ``j + n/2`` is the new copy of unit ``j``,
    fine layer ``l`` the small model's layer ``l mod q``. The FFN input rows of a new FFN unit and
    the FFN output rows of a new hidden unit are the next small layer's (halved on their in side);
    the columns that read a new unit are this layer's own, halved."""
    cfg = small_config(variant, num_layers=8)
    lm = make_level_map(cfg, depth_pairing="halves")
    coarse = random_state_dict(lm.coarse, seed=7)
    grown = decoalesce(coarse, lm, width_growth="aki")
    stack = "decoder" if cfg.kind == "gpt" else "encoder"
    q, hc, fc = lm.coarse.num_layers, lm.coarse.hidden_size, lm.coarse.ffn_hidden_size
    for layer in range(cfg.num_layers):
        k = layer % q
        up = min(k + 1, q - 1)

        def fine(local):
            return grown[f"{stack}.layers.{layer}.mlp.{local}"]

        def small(i, local):
            return coarse[f"{stack}.layers.{i}.mlp.{local}"]

        fc1, fc2 = fine("linear_fc1.weight"), fine("linear_fc2.weight")  # [F, H], [H, F]
        assert torch.equal(fc1[:fc], 0.5 * small(k, "linear_fc1.weight").repeat(1, 2))
        assert torch.equal(fc1[fc:], 0.5 * small(up, "linear_fc1.weight").repeat(1, 2))
        assert torch.equal(fine("linear_fc1.bias")[fc:], small(up, "linear_fc1.bias"))
        assert torch.equal(fc2[:hc], 0.5 * small(k, "linear_fc2.weight").repeat(1, 2))
        assert torch.equal(fc2[hc:], 0.5 * small(up, "linear_fc2.weight").repeat(1, 2))
        assert torch.equal(fine("linear_fc2.bias")[hc:], small(up, "linear_fc2.bias"))
        if k < q - 1:
            assert not torch.equal(fc1[fc:], fc1[:fc])  # the copies' symmetry is broken


def test_aki_needs_width():
    cfg = small_config("gpt_tied")
    coarse = random_state_dict(make_level_map(cfg).coarse, seed=8)
    with pytest.raises(ValueError, match=r"valid choices are \['fpi', 'aki'\]"):
        decoalesce(coarse, make_level_map(cfg), width_growth="copy")
    depth_only = make_level_map(cfg, width=False)
    with pytest.raises(ValueError, match="does not widen"):
        decoalesce(random_state_dict(depth_only.coarse, seed=8), depth_only, width_growth="aki")


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
