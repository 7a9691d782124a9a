"""A tensor-parallel size per level: which layouts each shipped config accepts, the table of them in
docs/layouts.md, and transitions across a TP change on 4 gloo ranks against one process.

Print the table for the docs with ``python tests/test_tp_change.py``.
"""

import itertools
import json
import math
import re
from pathlib import Path

import pytest

from distributed_helpers import run_ranks
from megatron_multilevel.config import load_config, valid_tp_sizes
from megatron_multilevel.level_maps import run_level_maps
from megatron_multilevel.config.parsing import apply_overrides
from test_transitions import _cases, _check, _key, _worker

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.json"))
DOCS = ROOT / "docs" / "layouts.md"
TP_SIZES = (1, 2, 4, 8)


def _level_key(data: dict, level: int) -> str:
    """The override that gives ``level`` of a config (as a JSON dict) its own TP size."""
    ml = data.get("multilevel", {})
    if not ml.get("enabled", False) or (level == 0 and ml.get("strategy") == "ode"):
        return "parallel.tensor_model_parallel_size"
    if ml.get("strategy") == "ode":
        return "multilevel.ode.coarse_tensor_model_parallel_size"
    return f"multilevel.levels.{level}.tensor_model_parallel_size"


def _walk(path: Path) -> list[dict[int, "str | None"]]:
    """For each level of the config at ``path``, each TP size of ``TP_SIZES`` -> None if config
    validation accepts the level at that size (the other levels as shipped), else its message."""
    data = json.loads(path.read_text())
    out = []
    for level in range(len(load_config(data).level_models())):
        results = {}
        for tp in TP_SIZES:
            override = f"{_level_key(data, level)}={tp}"
            try:
                cfg = load_config(apply_overrides(json.loads(path.read_text()), [override]))
            except ValueError as e:
                results[tp] = str(e)
            else:
                run_level_maps(cfg)  # the groupings are made as a run makes them, with no error
                results[tp] = None
        out.append(results)
    return out


def _pipeline_sizes(path: Path) -> list[int]:
    """The pipeline sizes of ``TP_SIZES`` that config validation accepts for every level at once
    (``parallel.pipeline_model_parallel_size``, split evenly, the rest as shipped)."""
    accepted = []
    for pp in TP_SIZES:
        try:
            load_config(apply_overrides(json.loads(path.read_text()), [f"parallel.pipeline_model_parallel_size={pp}"]))
        except ValueError:
            continue
        accepted.append(pp)
    return accepted


def layout_table() -> str:
    """The markdown table of docs/layouts.md: the TP sizes of ``TP_SIZES`` each level accepts, and
    the pipeline sizes every level accepts together."""
    walks = {path.name: _walk(path) for path in CONFIGS}
    width = max(len(levels) for levels in walks.values())
    rows = ["| config | " + " | ".join(f"level {i} TP" for i in range(width)) + " | PP (every level) |",
            "|---" * (width + 2) + "|"]
    for path in CONFIGS:
        levels = walks[path.name]
        cells = [", ".join(str(tp) for tp, error in lv.items() if error is None) for lv in levels]
        pipeline = ", ".join(map(str, _pipeline_sizes(path)))
        rows.append(f"| `{path.name}` | " + " | ".join(cells + ["-"] * (width - len(cells)) + [pipeline]) + " |")
    return "\n".join(rows)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_level_is_accepted_or_rejected_naming_its_key(path):
    """Config validation alone (nothing built): a level's TP size is accepted exactly when it
    splits that level's heads, query groups, FFN and vocabulary; otherwise the error names the
    level, the key to change, and the sizes that would work."""
    data = json.loads(path.read_text())
    models = load_config(data).level_models()
    for level, results in enumerate(_walk(path)):
        valid = valid_tp_sizes(models[level])
        key = _level_key(data, level)
        for tp, error in results.items():
            if tp in valid:
                assert error is None, (level, tp, error)
                continue
            assert error is not None, (level, tp)
            if key.startswith("multilevel.ode."):  # the ODE strategy's own check of its coarse key
                pattern = rf"^{re.escape(key)} = {tp} does not divide .*; valid values are {re.escape(str(valid))}$"
            else:
                pattern = (rf"^level {level}: {re.escape(key)} = {tp} does not divide .*; "
                           rf"set {re.escape(key)} to one of {re.escape(str(valid))}$")
            assert re.match(pattern, error), (level, tp, error)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_accepted_combination_makes_its_groupings(path):
    """Levels at any accepted TP sizes together (e.g. fine TP=4, coarse TP=2): the run's
    groupings are made without error, and pair partners inside the shards the two levels share."""
    data = json.loads(path.read_text())
    accepted = [[tp for tp, error in results.items() if error is None] for results in _walk(path)]
    for sizes in itertools.product(*accepted):
        overrides = [f"{_level_key(data, level)}={tp}" for level, tp in enumerate(sizes)]
        cfg = load_config(apply_overrides(json.loads(path.read_text()), overrides))
        assert cfg.level_tp_sizes() == list(sizes)
        for level, level_map in enumerate(run_level_maps(cfg)):
            if level_map.width:
                shared = math.gcd(sizes[level], sizes[level + 1])
                assert all(level_map.shard(r, shared) is not None for r in range(shared)), (sizes, level)


def test_a_coarse_level_that_inherits_a_size_it_cannot_split_names_its_own_key():
    """GPT-Base at TP=4, the paper's schedule: its width-coalesced level's 6 heads need a TP size of their own."""
    data = json.loads((ROOT / "configs" / "gpt_base_paper.json").read_text())
    with pytest.raises(ValueError, match=re.escape(
            "level 1: tensor_model_parallel_size = 4 (from parallel.tensor_model_parallel_size) does not divide "
            "num_attention_heads = 6 at this level (model.num_attention_heads = 12 at level 0); "
            "set multilevel.levels.1.tensor_model_parallel_size to one of [1, 2, 3, 6]")):
        load_config(apply_overrides(data, ["parallel.tensor_model_parallel_size=4"]))
    cfg = load_config(apply_overrides(data, ["multilevel.levels.1.tensor_model_parallel_size=2"]))
    (level_map,) = run_level_maps(cfg)
    assert level_map.coarse.num_attention_heads == 6


def test_docs_table_matches_config_validation():
    text = DOCS.read_text()
    table = layout_table()
    assert table in text, f"docs/layouts.md is out of date; its table is now:\n{table}"


# --- transitions across a TP change, 4 ranks against one process -------------------------------
# (fine TP, fine ZeRO stage, coarse TP, coarse ZeRO stage); groupings made as a run makes them
TP_CHANGE = _cases("gpt", [(4, 1, 2, 3)], groupings=(4, 2))  # TP=4 -> TP=2 x DP=2 under ZeRO-3, and back
SAME_TP4 = _cases("wide", [(4, 0, 4, 0)], groupings=(4, 4))  # TP=4 at both levels: the fast path


@pytest.mark.slow
def test_four_ranks_across_a_tp_change(tmp_path):
    cases = TP_CHANGE + SAME_TP4
    (one,) = run_ranks(_worker, 1, tmp_path / "one", [dict(c, fine_tp=1, fine_stage=0, coarse_tp=1, coarse_stage=0)
                                                      for c in cases])
    reference = {_key(c): r for c, r in zip(cases, one)}
    results = run_ranks(_worker, 4, tmp_path / "four", cases)
    _check(results, cases, reference)
    assert results[0][0]["collectives"] > 0  # gathered, projected and resharded
    assert results[0][1]["collectives"] == 0  # every rank maps its own shards


if __name__ == "__main__":
    print(layout_table())
