"""The savings benchmark: its arithmetic on made-up curves, and one tiny end-to-end run."""

import json
import subprocess
import sys

import pytest

from launch_helpers import ROOT, make_corpus, preprocess
from megatron_multilevel.benchmarking import first_crossing, run_savings, summarize, variant_configs
from megatron_multilevel.config import load_config


def test_first_crossing_interpolates_linearly():
    curve = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.5)]
    assert first_crossing(curve, 3.5) == pytest.approx(15.0)
    assert first_crossing(curve, 3.0) == pytest.approx(20.0)
    assert first_crossing(curve, 6.0) == 0
    assert first_crossing(curve, 2.0) is None
    # the first crossing counts, not a later one
    assert first_crossing([(0, 5.0), (10, 3.0), (20, 4.0), (30, 2.0)], 3.5) == pytest.approx(7.5)


def _records(points, level=0):
    return [{"type": "valid", "level": level, "flops": f, "seconds": 2 * f, "loss": l} for f, l in points]


def test_savings_against_the_baseline():
    baseline = _records([(0, 6.0), (50, 4.0), (100, 3.0)])
    # reaches 3.0 at 60 FLOPs (between 50 at 3.5 and 70 at 2.5): 40% saved
    method = _records([(10, 5.0), (30, 4.0)], level=1) + _records([(50, 3.5), (70, 2.5), (100, 2.4)])
    out = run_savings(method, baseline)
    assert out["target_loss"] == 3.0 and out["final_valid_loss"] == 2.4
    assert out["flops_to_target"] == pytest.approx(60.0)
    assert out["saving_flops"] == pytest.approx(0.4)
    assert out["saving_seconds"] == pytest.approx(0.4)
    # coarse levels below the target do not count: only the fine model's losses do
    coarse_only = _records([(10, 2.0)], level=1) + _records([(100, 3.2)])
    assert run_savings(coarse_only, baseline)["saving_flops"] is None
    assert run_savings(baseline, baseline)["saving_flops"] == 0.0


def test_summaries():
    assert summarize([0.1, 0.3, 0.2]) == {"median": 0.2, "min": 0.1, "max": 0.3, "n": 3, "reached": 3}
    assert summarize([None, 0.4])["reached"] == 1
    assert summarize([None])["median"] is None


def _budget(cfg):
    from megatron_multilevel.training.flops import flops_per_token
    from megatron_multilevel.training.schedule import build_phases

    parsed = load_config(cfg)
    models = parsed.level_models()
    seq = parsed.data.seq_length
    phases = build_phases(parsed)
    return sum(p.steps for p in phases), sum(p.steps * flops_per_token(models[p.level], seq) for p in phases)


BASE = {"train_batch_size": 8, "model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
                                         "max_sequence_length": 32}, "data": {"seq_length": 32}}


def test_variants_share_the_token_budget():
    configs = variant_configs(BASE, steps=100, fine_lr=1e-3, budget="tokens")
    assert {name: _budget(cfg)[0] for name, cfg in configs.items()} == {
        "scratch": 100, "vcycle2": 100, "vcycle3": 100, "stacking": 100}
    stack = load_config(configs["stacking"])
    assert stack.multilevel.cycle == "grow" and stack.level_models()[1].num_layers == 4
    assert stack.level_models()[1].hidden_size == 64


def test_variants_share_the_flops_budget():
    configs = variant_configs(BASE, steps=100, fine_lr=1e-3, budget="flops")
    steps, flops = _budget(configs["scratch"])
    one_step = flops / steps
    for name, cfg in configs.items():
        s, f = _budget(cfg)
        assert flops - one_step <= f <= flops, name  # the same compute, to within one fine step
        assert s >= steps  # cheaper steps: more of them
    assert _budget(configs["vcycle2"])[0] > 130


def test_variants_coalesce_the_shape_asked_for():
    for shape, (hidden, layers) in {"width+depth": (32, 4), "width": (32, 8), "depth": (64, 4)}.items():
        configs = variant_configs(BASE, steps=100, fine_lr=1e-3, shape=shape)
        scratch_flops = _budget(configs["scratch"])[1]
        for name in ("vcycle2", "vcycle3"):
            assert scratch_flops * 0.99 <= _budget(configs[name])[1] <= scratch_flops, (shape, name)
        coarse = load_config(configs["vcycle2"]).level_models()[1]
        assert (coarse.hidden_size, coarse.num_layers) == (hidden, layers), shape
        lr = configs["vcycle2"]["multilevel"]["levels"][1]["lr_before"]["peak"]
        assert lr == pytest.approx(3e-3 if hidden < 64 else 1e-3), shape  # the narrower level's rate only
    with pytest.raises(ValueError, match="invalid shape 'heads'.*'depth'"):
        variant_configs(BASE, steps=100, fine_lr=1e-3, shape="heads")


def test_benchmark_end_to_end(tmp_path):
    inputs = make_corpus(tmp_path / "corpus")
    assert preprocess(inputs, tmp_path / "gpt").returncode == 0
    out = tmp_path / "savings"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "benchmark_savings.py"), "--size", "tiny", "--steps", "12",
         "--data-prefix", str(tmp_path / "gpt"), "--tokenizer-model", str(tmp_path / "gpt.model"),
         "--evals", "4", "--eval-batches", "1", "--out", str(out), "--no-step-ratio"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["scratch", "vcycle2", "vcycle3", "stacking"]
    for name, m in results["methods"].items():
        run = m["repeats"][0]
        assert run["final_valid_loss"] > 0 and run["total_flops"] > 0
        assert set(m) >= {"saving_flops", "saving_seconds", "flops_to_target", "final_valid_loss"}
    assert results["methods"]["scratch"]["saving_flops"]["median"] == 0.0
    scratch_flops = results["methods"]["scratch"]["total_flops"]["median"]
    for name in ("vcycle2", "vcycle3", "stacking"):  # the same compute budget
        assert results["methods"][name]["total_flops"]["median"] <= scratch_flops
    table = (out / "results.md").read_text()
    assert table.startswith("| method |") and "| vcycle3 |" in table and "| stacking |" in result.stdout
    for plot in ("valid_loss_vs_flops.png", "valid_loss_vs_seconds.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
