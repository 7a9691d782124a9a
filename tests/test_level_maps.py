import json
import re

import pytest
import torch

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.level_maps import Grouping, LevelMap, grouping_shards, make_level_map, make_level_maps


def test_halves_and_adjacent():
    assert Grouping.halves(6).assignment == (0, 1, 2, 0, 1, 2)
    assert Grouping.adjacent(6).assignment == (0, 0, 1, 1, 2, 2)


def test_shard_local_partners_stay_in_shard():
    g = Grouping.make(16, "halves", shards=4)
    for j, i in enumerate(g.assignment):
        # fine shard of j == coarse shard of i (contiguous splits of 16 and 8 units over 4 ranks)
        assert j // 4 == i // 2
    assert Grouping.make(16, "halves", shards=1) == Grouping.halves(16)


def test_blocks_keep_units_together():
    g = Grouping.make(8, "halves", block=2)
    assert g.assignment == (0, 1, 2, 3, 0, 1, 2, 3)
    g = Grouping.make(8, "adjacent", block=2)
    assert g.assignment == (0, 1, 0, 1, 2, 3, 2, 3)


def test_expand_with_stacks():
    g = Grouping.adjacent(4).expand(1, stacks=2)
    assert g.assignment == (0, 0, 1, 1, 2, 2, 3, 3)


@pytest.mark.parametrize("pairing", ["halves", "adjacent"])
def test_F_times_C_is_identity_and_CF_is_projection(pairing):
    g = Grouping.make(12, pairing, shards=2)
    F, C = g.averaging_matrix(), g.copy_matrix()
    torch.testing.assert_close(F @ C, torch.eye(6, dtype=torch.float64), rtol=0, atol=0)
    P = C @ F
    torch.testing.assert_close(P @ P, P, rtol=0, atol=0)
    torch.testing.assert_close(F.sum(1), torch.ones(6, dtype=torch.float64))


@pytest.mark.parametrize("bad", [(0, 0, 0, 1), (0, 1, 2), (0, 0, 1, 2), (0, 0, -1, -1), ()])
def test_invalid_grouping(bad):
    with pytest.raises(ValueError, match="exactly two"):
        Grouping(bad)


def test_cannot_pair_odd_or_unshardable():
    with pytest.raises(ValueError, match="cannot be paired"):
        Grouping.make(12, "halves", shards=4)
    with pytest.raises(ValueError, match="valid choices"):
        Grouping.make(12, "random")


def _cfg(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=96, max_sequence_length=16)
    base.update(kw)
    return ModelConfig(**base)


def test_level_map_json_round_trip():
    cfg = _cfg(num_query_groups=2, activation="swiglu")
    lm = make_level_map(cfg, width_pairing="adjacent", depth_pairing="halves", depth_scaling="ode")
    again = LevelMap.from_json(lm.to_json(), cfg)
    assert again == lm
    assert again.coarse.hidden_size == 32 and again.coarse.num_layers == 2
    assert again.coarse.num_query_groups == 1 and again.coarse.kv_channels == 16


def test_level_map_rejects_other_model():
    lm = make_level_map(_cfg())
    with pytest.raises(ValueError, match="model.hidden_size"):
        LevelMap.from_json(lm.to_json(), _cfg(hidden_size=128))
    with pytest.raises(ValueError, match="model.num_layers"):
        LevelMap.from_json(lm.to_json(), _cfg(num_layers=8))


def test_level_map_rejects_bad_json():
    lm = make_level_map(_cfg())
    data = json.loads(lm.to_json())
    data["ffn"] = list(Grouping.halves(128).assignment)
    with pytest.raises(ValueError, match="128 units for model.ffn_hidden_size = 256"):
        LevelMap.from_json(json.dumps(data))
    data["ffn"] = data["ffn"][:-1]
    with pytest.raises(ValueError, match="level map 'ffn'.*exactly two"):
        LevelMap.from_json(json.dumps(data))
    data = json.loads(lm.to_json())
    data["extra"] = 1
    with pytest.raises(ValueError, match="expected keys"):
        LevelMap.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not valid JSON"):
        LevelMap.from_json("{")


def test_width_only_and_depth_only():
    cfg = _cfg()
    w = make_level_map(cfg, depth=False)
    assert w.layers is None and w.coarse.num_layers == 4 and w.coarse.hidden_size == 32
    d = make_level_map(cfg, width=False)
    assert d.hidden is None and d.coarse.num_layers == 2 and d.coarse.hidden_size == 64


def test_k_levels_recurse():
    maps = make_level_maps(_cfg(num_layers=8, hidden_size=128, num_attention_heads=8), 3)
    assert [m.fine.hidden_size for m in maps] == [128, 64]
    assert maps[1].coarse.hidden_size == 32 and maps[1].coarse.num_layers == 2


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(hidden_size=48, num_attention_heads=3), "num_attention_heads"),
        (dict(num_query_groups=1), "num_query_groups"),
        (dict(ffn_hidden_size=255), "ffn_hidden_size"),
        (dict(num_layers=3), "num_layers"),
    ],
)
def test_unhalvable_shapes(kw, key):
    with pytest.raises(ValueError, match=key):
        make_level_map(_cfg(**kw))


def test_tp_size_must_divide_heads_at_both_levels():
    with pytest.raises(ValueError, match="^fine level: tensor_model_parallel_size = 3"):
        make_level_map(_cfg(), tensor_model_parallel_size=3)
    # 4 heads split over 4 ranks, but the coarse level's 2 heads cannot be.
    with pytest.raises(ValueError, match=re.escape(
            "coarse level: tensor_model_parallel_size = 4 does not divide its num_attention_heads = 2; "
            "set coarse_tensor_model_parallel_size to one of [1, 2]")):
        make_level_map(_cfg(), tensor_model_parallel_size=4)


def _shard_of(unit: int, num_units: int, tp: int) -> int:
    return unit // (num_units // tp)


def test_a_tp_change_pairs_inside_the_shards_both_levels_share():
    """GPT-Base: 12 heads at TP=4, its coarse level's 6 heads at TP=2."""
    gpt_base = ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12)
    assert grouping_shards(4, 4) == 4 and grouping_shards(4, 2) == 2 and grouping_shards(1, 2) == 1
    lm = make_level_map(gpt_base, tensor_model_parallel_size=4, coarse_tensor_model_parallel_size=2)
    assert lm.coarse.num_attention_heads == 6
    assert lm.query_groups == Grouping.make(12, "halves", shards=2)
    for grouping in (lm.query_groups, lm.ffn):
        n = grouping.num_fine
        # the two fine units of a coarse unit lie in the coarse unit's TP=2 shard ...
        assert all(_shard_of(j, n, 2) == _shard_of(i, n // 2, 2) for j, i in enumerate(grouping.assignment))
        # ... and not in one TP=4 shard: the step gathers, projects and reshards
        assert not all(_shard_of(j, n, 4) == _shard_of(i, n // 2, 4) for j, i in enumerate(grouping.assignment))
    assert lm.shard(0, 2) is not None and lm.shard(0, 4) is None
    # the same TP size at both levels keeps each rank's own shards
    same = make_level_map(_cfg(num_attention_heads=8), tensor_model_parallel_size=4)
    assert all(same.shard(r, 4) is not None for r in range(4))
