"""The savings benchmark: its arithmetic on made-up curves, and one tiny end-to-end run."""

import json
import subprocess
import sys

import pytest

from launch_helpers import ROOT, load_tool, make_corpus, preprocess
from megatron_multilevel.config import load_config
from megatron_multilevel.methods import family
from megatron_multilevel.study.report import collect, normalized_at_flops, normalized_seconds, table
from megatron_multilevel.study.runs import kept_runs, reusable
from megatron_multilevel.study.savings import at_fraction, equal_quality, first_crossing, run_savings, summarize
from megatron_multilevel.study.variants import compress, variant_configs


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


def test_savings_by_hand_on_both_axes():
    """FLOPs and seconds are separate curves: each crossing is worked out on its own axis."""
    def rec(level, flops, seconds, loss):
        return {"type": "valid", "level": level, "flops": flops, "seconds": seconds, "loss": loss}

    # the baseline ends at 3.0, first reached at its last point: 100 FLOPs, 200 seconds
    baseline = [rec(0, 0, 0, 6.0), rec(0, 40, 80, 3.5), rec(0, 80, 160, 3.2), rec(0, 100, 200, 3.0)]
    # the method: a coarse record below the target (ignored), then fine records that cross 3.0
    # half way between 3.2 and 2.8: FLOPs 60 + 0.5 * 10 = 65 (35% saved), seconds 90 + 0.5 * 40 =
    # 110 (45% saved)
    method = [rec(1, 10, 10, 2.0), rec(0, 20, 50, 4.0), rec(0, 60, 90, 3.2), rec(0, 70, 130, 2.8),
              rec(0, 90, 170, 2.7)]
    out = run_savings(method, baseline)
    assert out["target_loss"] == 3.0 and out["final_valid_loss"] == 2.7
    assert out["flops_to_target"] == pytest.approx(65.0) and out["saving_flops"] == pytest.approx(0.35)
    assert out["seconds_to_target"] == pytest.approx(110.0) and out["saving_seconds"] == pytest.approx(0.45)
    # a method slower than the baseline has a negative saving: 3.0 reached at 125 FLOPs
    slow = [rec(0, 100, 200, 3.5), rec(0, 150, 300, 2.5)]
    assert run_savings(slow, baseline)["saving_flops"] == pytest.approx(-0.25)
    # equal quality between two compressed runs: 2.95 lies 1/4 of the way from 3.05 (at 0.6) to
    # 2.65 (at 1.0): fraction 0.7; the seconds at 0.7 lie half way from 120 to 160
    points = [(0.6, 3.05), (1.0, 2.65), (0.4, 3.30), (0.8, 2.85)]
    out = equal_quality(points, 2.95)
    assert out["bound"] == "interpolated" and out["fraction"] == pytest.approx(0.7)
    assert out["saving"] == pytest.approx(0.3)
    assert at_fraction([(0.4, 80.0), (0.6, 120.0), (0.8, 160.0), (1.0, 200.0)], 0.7) == pytest.approx(140.0)


def test_equal_quality_on_made_up_budget_curves():
    # final losses at 50, 65, 80 and 100% of the budget; the target 3.10 lies between 65% (3.20)
    # and 80% (3.00): half way, at 72.5%, so 27.5% saved
    points = [(1.0, 2.90), (0.5, 3.40), (0.8, 3.00), (0.65, 3.20)]
    out = equal_quality(points, 3.10)
    assert out["fraction"] == pytest.approx(0.725) and out["saving"] == pytest.approx(0.275)
    assert out["bound"] == "interpolated" and out["gap"] is None
    # reached at the smallest budget tried: only a bound on the fraction needed
    assert equal_quality(points, 3.50) == {"fraction": 0.5, "saving": 0.5, "bound": "at_most", "gap": None}
    # never reached: how far above the target the full budget ends
    missed = equal_quality(points, 2.80)
    assert missed["saving"] is None and missed["bound"] == "not_reached" and missed["gap"] == pytest.approx(0.10)
    # exactly at a run's loss: that run's fraction
    assert equal_quality(points, 3.00)["fraction"] == pytest.approx(0.8)
    # the wall-clock at that fraction, interpolated between the same runs
    seconds = [(0.5, 100.0), (0.65, 130.0), (0.8, 160.0), (1.0, 200.0)]
    assert at_fraction(seconds, 0.725) == pytest.approx(145.0)
    assert at_fraction(seconds, 0.4) == 100.0 and at_fraction(seconds, 1.0) == 200.0


def _phase_steps(cfg):
    from megatron_multilevel.training.schedule import build_phases

    return [p.steps for p in build_phases(load_config(cfg))]


def test_budget_compression_keeps_the_phases_proportions():
    configs = variant_configs(BASE, steps=400, fine_lr=1e-3, ea=0.1)
    for name in ("scratch", "vcycle2", "vcycle3", "stacking", "stacking3", "ode2"):
        full = _phase_steps(configs[name])
        half = _phase_steps(compress(configs[name], 0.5))
        assert half == [round(s / 2) for s in full], name
        assert sum(half) == pytest.approx(sum(full) / 2, abs=len(full)), name
    scratch = compress(configs["scratch"], 0.25)["training"]
    assert scratch["train_steps"] == 100 and scratch["lr"]["warmup_steps"] == 5  # of 20
    v = compress(configs["vcycle2"], 0.5)["multilevel"]["levels"]
    assert v[0]["lr_before"]["warmup_steps"] == 10 and v[0]["lr_after"]["warmup_steps"] == 10
    assert configs["vcycle2"]["multilevel"]["levels"][0]["steps_before"] == 40  # the input is not changed
    # a phase keeps at least one step; a phase of none stays empty
    tiny = compress(configs["stacking"], 0.001)["multilevel"]["levels"]
    assert tiny[0]["steps_before"] == 0 and tiny[0]["steps_after"] == 1 and tiny[1]["steps_before"] == 1
    ode = compress(configs["ode2"], 0.5)["multilevel"]["ode"]
    assert ode["cycles"] == 4 and ode["pre_steps"] == 10 and ode["coarse_steps"] == 25  # of 20 and 50
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="budget fraction"):
            compress(configs["scratch"], bad)


def test_summaries():
    assert summarize([0.1, 0.3, 0.2]) == {"median": 0.2, "min": 0.1, "max": 0.3, "n": 3, "reached": 3}
    assert summarize([None, 0.4])["reached"] == 1
    assert summarize([None])["median"] is None


def _budget(cfg):
    from megatron_multilevel.flops import flops_per_token
    from megatron_multilevel.training.schedule import build_phases

    parsed = load_config(cfg)
    models = parsed.level_models()
    seq = parsed.data.seq_length
    phases = build_phases(parsed)
    ml = parsed.multilevel
    ligo = ml.ligo_steps if ml.enabled and ml.growth_operator == "ligo" else 0  # full-model steps of its operator
    return (sum(p.steps for p in phases),
            sum(p.steps * flops_per_token(models[p.level], seq) for p in phases) + ligo * flops_per_token(models[0], seq))


BASE = {"train_batch_size": 8, "model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
                                         "max_sequence_length": 32}, "data": {"seq_length": 32}}


def test_variants_share_the_token_budget():
    from megatron_multilevel.training.schedule import build_phases

    configs = variant_configs(BASE, steps=100, fine_lr=1e-3, budget="tokens")
    assert {name: _budget(cfg)[0] for name, cfg in configs.items()} == {
        "scratch": 100, "coarse": 100, "vcycle2": 100, "vcycle3": 100, "wcycle2": 100, "fcycle2": 100,
        "stacking": 100, "stacking3": 100, "gstack": 100, "msg": 100, "ligo": 100, "bert2bert": 100, "ode2": 100}
    stack = load_config(configs["stacking"])
    assert stack.multilevel.cycle == "grow" and stack.level_models()[1].num_layers == 4
    assert stack.level_models()[1].hidden_size == 64
    stack3 = load_config(configs["stacking3"])
    assert [m.num_layers for m in stack3.level_models()] == [8, 4, 2]
    assert [p.level for p in build_phases(stack3)] == [2, 1, 0]
    assert [p.steps for p in build_phases(stack3)] == [25, 25, 50]  # half the coarse share each


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


def test_the_coarse_model_alone_is_the_cycles_coarse_model_on_the_whole_budget():
    """The control: the cycles' coarse model trained from scratch, on scratch's FLOPs (or tokens),
    with its own warm-up, the same share of its steps as scratch's, at the coarse rate."""
    for shape, rate in (("depth", 1e-3), ("width+depth", 3e-3)):
        configs = variant_configs(BASE, steps=100, fine_lr=1e-3, warmup=10, shape=shape)
        control, cycle = load_config(configs["coarse"]), load_config(configs["vcycle2"])
        assert control.model == cycle.level_models()[1], shape
        assert not control.multilevel.enabled
        # scratch's FLOPs over the FLOPs of one of its steps (FLOPs accounting: tests/test_flops.py)
        _, fine_flops = _budget(configs["scratch"])
        steps, flops = _budget(configs["coarse"])
        assert steps == int(fine_flops / (flops / steps)), shape
        assert control.training.lr.peak == pytest.approx(rate), shape
        assert control.training.lr.warmup_steps == round(10 * steps / 100), shape
    tokens = variant_configs(BASE, steps=100, fine_lr=1e-3, warmup=10, shape="depth", budget="tokens")
    assert load_config(tokens["coarse"]).training.train_steps == 100
    assert set(variant_configs(BASE, steps=100, fine_lr=1e-3, methods=["coarse"])) == {"scratch", "coarse"}


def test_coarse_learning_rate_factor_set_for_any_shape():
    def coarse_peaks(**kw):
        configs = variant_configs(BASE, steps=400, fine_lr=1e-3, **kw)
        coarse = {name: configs[name]["multilevel"]["levels"][1] for name in ("vcycle2", "wcycle2", "fcycle2")}
        return [coarse["vcycle2"]["lr_before"]["peak"], coarse["wcycle2"]["lr_before"]["peak"],
                *(visit["lr"]["peak"] for visit in coarse["fcycle2"]["visits"])]
    # given, the factor scales the coarse rate of a shallower model as of a narrower one
    for shape in ("depth", "width+depth"):
        assert coarse_peaks(shape=shape, coarse_lr_factor=1.5) == pytest.approx([1.5e-3] * 4), shape
    assert coarse_peaks(shape="depth") == pytest.approx([1e-3] * 4)
    assert coarse_peaks(shape="width+depth") == pytest.approx([3e-3] * 4)
    with pytest.raises(ValueError, match="invalid coarse_lr_factor 0"):
        variant_configs(BASE, steps=100, fine_lr=1e-3, coarse_lr_factor=0)


def _bench(tmp_path, *extra):
    cmd = [sys.executable, str(ROOT / "tools" / "benchmark_savings.py"), "--size", "tiny", "--steps", "12",
           "--data-prefix", str(tmp_path / "gpt"), "--tokenizer-model", str(tmp_path / "gpt.model"),
           "--evals", "4", "--eval-batches", "1", "--split", "90,10,0", "--out", str(tmp_path / "work"),
           "--results", str(tmp_path / "kept"), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_benchmark_end_to_end(tmp_path):
    inputs = make_corpus(tmp_path / "corpus")
    assert preprocess(inputs, tmp_path / "gpt").returncode == 0
    methods = ["coarse", "vcycle2", "fcycle2", "stacking"]
    result = _bench(tmp_path, "--methods", *methods, "--fractions", "0.5", "1.0")
    kept = tmp_path / "kept"
    results = json.loads((kept / "results.json").read_text())
    assert list(results["methods"]) == ["scratch", *methods]
    assert {n: m["family"] for n, m in results["methods"].items()} == {
        "scratch": "scratch", "coarse": "coarse", "vcycle2": "vcycle", "fcycle2": "fcycle", "stacking": "stacking"}
    runs = {p.stem: json.loads(p.read_text()) for p in (kept / "runs").glob("*.json")}
    assert sorted(runs) == sorted(["scratch-f1-s1234"] + [f"{m}-f{f}-s1234" for m in methods for f in ("0.5", "1")])
    assert {r["version"] for r in runs.values()} == {results["version"]}
    # every run read a prefix of one sample order: as many samples as the longest run reads
    assert {r["config"]["data"]["order_samples"] for r in runs.values()} == {
        max(r["totals"]["steps"] * r["config"]["train_batch_size"] for r in runs.values())}
    scratch = runs["scratch-f1-s1234"]
    target = scratch["totals"]["final_valid_loss"]
    assert results["methods"]["scratch"]["eq_saving_flops"]["median"] == 0.0
    for name in methods:
        full, half = runs[f"{name}-f1-s1234"], runs[f"{name}-f0.5-s1234"]
        assert full["totals"]["flops"] <= scratch["totals"]["flops"]  # the same compute budget
        assert half["totals"]["flops"] == pytest.approx(full["totals"]["flops"] / 2, rel=0.2)
        # the equal-quality saving, recomputed here from the two final losses
        hi, lo = half["totals"]["final_valid_loss"], full["totals"]["final_valid_loss"]
        if hi <= target:
            expected = 0.5
        elif lo <= target:
            expected = 1.0 - (0.5 + 0.5 * (hi - target) / (hi - lo))
        else:
            expected = None
        got = results["methods"][name]["eq_saving_flops"]["median"]
        assert got == (None if expected is None else pytest.approx(expected)), name
    table = (kept / "results.md").read_text()
    assert table.startswith("| method |") and "| fcycle2 |" in table and "| stacking |" in result.stdout
    for plot in ("valid_loss_vs_flops.png", "valid_loss_vs_seconds.png", "final_loss_vs_budget.png"):
        assert (kept / plot).read_bytes()[:4] == b"\x89PNG"
    # a second call reuses every kept run and redoes only what is missing
    (kept / "runs" / "stacking-f0.5-s1234.json").unlink()
    again = _bench(tmp_path, "--methods", *methods, "--fractions", "0.5", "1.0")
    assert [line.split(":")[1].split()[0] for line in again.stdout.splitlines() if " done in " in line] == [
        "stacking-f0.5-s1234"]
    assert json.loads((kept / "results.json").read_text())["methods"]["vcycle2"] == results["methods"]["vcycle2"]


def _tool(name: str = "benchmark_savings"):
    return load_tool(name)


@pytest.mark.parametrize("name, steps, fine_lr, warmup, coarse_share", [
    ("gpt_tiny_cpu.json", 200, 1e-3, 8, 0.8),  # the CPU default: the recipe as measured
    ("gpt_base.json", 100_000, 6e-4, 2000, 0.1),  # the GPU configs: the planner's schedule (its nearest point)
    ("bert_tiny_cpu.json", 200, 1e-3, 8, 0.8),  # BERT: the recipe, the best schedule measured on BERT
    ("bert_base.json", 300_000, 1e-4, 10_000, 0.5),
    ("bert_large.json", 300_000, 1e-4, 10_000, 0.5),
])
def test_the_shipped_configs_are_the_benchmarks_recipe(name, steps, fine_lr, warmup, coarse_share):
    """What the benchmark measures as the recipe is what the configs ship: the same walk, steps,
    schedules, operators and optimizer-state mapping, at the configs' own budgets."""
    from megatron_multilevel.study.variants import RECIPE

    data = json.loads((ROOT / "configs" / name).read_text())
    base = {k: v for k, v in data.items() if k != "multilevel"}
    made = variant_configs(base, steps=steps, fine_lr=fine_lr, warmup=warmup, methods=["fcycle2"],
                           **{**RECIPE, "coarse_share": coarse_share})["fcycle2"]
    assert load_config(made).multilevel == load_config(data).multilevel


@pytest.mark.parametrize("name, method, flags, small_steps", [
    ("gpt_base_grow.json", "stacking", ["--methods", "stacking", "--depth-scaling", "ode"], 50_000),
    ("gpt_base_gstack.json", "gstack", ["--methods", "gstack", "--gstack-factor", "4", "--gstack-share", "0.1"], 10_000),
    ("gpt_base_msg.json", "msg", ["--methods", "msg", "--coarse-share", "0.1", "--optimizer-state", "map",
                                  "--lr-schedule", "continue", "--after-warmup", "0", "--msg-mask-share", "0.05"], 10_000),
])
def test_the_shipped_growth_configs_are_the_growths_as_the_study_ran_them(name, method, flags, small_steps):
    """configs/gpt_base_grow.json (the planner's advice for GPT-Base until MSG's run) is progressive
    stacking as published, configs/gpt_base_gstack.json G_stack as published (AdamW and the schedule
    restarted) and configs/gpt_base_msg.json (the planner's candidate since, under its bar) MSG with the recipe's
    levers, each as the benchmark runs it (the flags), at GPT-Base's budget: stacking's half of the
    steps at half depth, G_stack's tenth at a quarter depth, MSG's tenth at half depth."""
    from megatron_multilevel.study.variants import GROWTHS

    data = json.loads((ROOT / "configs" / name).read_text())
    base = {k: v for k, v in data.items() if k != "multilevel"}
    made = variant_configs(base, steps=100_000, fine_lr=6e-4, warmup=2000, methods=[method],
                           **{"after_warmup": 2000, **GROWTHS[method]["settings"]})[method]
    tool = _tool()
    args = tool.parse_args(tool.build_parser(), ["--size", "tiny", "--steps", "100", *flags])
    benchmark = tool.variants(args, tool.base_config(args))[method]["multilevel"]
    assert load_config(made).multilevel == load_config(data).multilevel
    for key in ("cycle", "num_levels", "depth_scaling", "optimizer_state", "lr_schedule", "depth_pairing"):
        assert benchmark[key] == data["multilevel"][key], key
    # MSG's mask over the same share of the steps (the benchmark's 100, the config's 100,000)
    assert benchmark.get("growth_mask_steps", 0) * 1000 == data["multilevel"].get("growth_mask_steps", 0)
    after = [m["levels"][0]["lr_after"]["warmup_steps"] for m in (benchmark, data["multilevel"])]
    assert (after[0] == 0) == (after[1] == 0)  # a second warm-up after growth in both, or in neither
    assert data["multilevel"]["levels"][-1]["steps_before"] == small_steps  # the small model's share of the steps


def test_recipe_flag_sets_the_recipe_and_yields_to_flags_given():
    from megatron_multilevel.study.variants import RECIPE

    tool = _tool()
    args = tool.parse_args(tool.build_parser(), ["--size", "tiny", "--steps", "100", "--recipe"])
    base = tool.base_config(args)
    made = tool.variants(args, base)
    assert sorted(made) == ["fcycle2", "scratch"]
    expected = variant_configs(base, steps=100, fine_lr=2e-3, warmup=4, methods=["fcycle2"], **RECIPE)["fcycle2"]
    assert made["fcycle2"] == expected
    args = tool.parse_args(tool.build_parser(), ["--size", "tiny", "--steps", "100", "--recipe", "--alpha", "0.5",
                                                 "--methods", "fcycle2", "stacking"])
    made = tool.variants(args, base)
    assert made["fcycle2"]["multilevel"]["alpha"] == 0.5 and "stacking" in made
    assert made["fcycle2"]["multilevel"]["depth_pairing"] == "halves"  # the rest of the recipe kept
    plain = tool.variants(tool.parse_args(tool.build_parser(), ["--size", "tiny", "--steps", "100"]), base)
    assert plain["vcycle2"]["multilevel"]["depth_pairing"] == "adjacent"  # without --recipe: the paper's


def test_bert2bert_init_names_the_aki_runs_apart():
    """``--bert2bert-init aki``: bert2bert grown by AKI, named bert2bert-aki (in bert2bert's family);
    without it the bert2bert config is as before, with no width_growth key."""
    tool = _tool()
    argv = ["--size", "tiny", "--steps", "100", "--methods", "bert2bert"]
    args = tool.parse_args(tool.build_parser(), argv)
    base = tool.base_config(args)
    made = tool.variants(tool.parse_args(tool.build_parser(), argv + ["--bert2bert-init", "aki"]), base)
    plain = tool.variants(args, base)
    assert sorted(made) == ["bert2bert-aki", "scratch"] and sorted(plain) == ["bert2bert", "scratch"]
    assert family("bert2bert-aki") == "bert2bert"
    assert "width_growth" not in plain["bert2bert"]["multilevel"]
    assert made["bert2bert-aki"]["multilevel"] == {**plain["bert2bert"]["multilevel"], "width_growth": "aki"}
    assert load_config(made["bert2bert-aki"]).multilevel.width_growth == "aki"


@pytest.mark.parametrize("dropout", [None, 0.1])
def test_dropout_reaches_every_run_and_breaks_the_width_symmetry(dropout):
    """``--dropout P``: the model of every run, scratch's too, has hidden and attention dropout P;
    an F-cycle that coalesces width then has something that breaks the copies' symmetry, so the
    warning a run without it gets (README, "The recipe") is not given."""
    import warnings

    tool = _tool()
    argv = ["--size", "tiny", "--steps", "100", "--recipe", "--shape", "width+depth"]
    args = tool.parse_args(tool.build_parser(), argv + ([] if dropout is None else ["--dropout", str(dropout)]))
    made = tool.variants(args, tool.base_config(args))
    assert sorted(made) == ["fcycle2", "scratch"]
    for cfg in made.values():
        model = load_config(cfg).model
        assert (model.hidden_dropout, model.attention_dropout) == (dropout or 0.0, dropout or 0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(made["fcycle2"])
    assert len([w for w in caught if "symmetry" in str(w.message)]) == (dropout is None)


def test_scratch_schedules_are_baseline_candidates():
    """``--scratch-decay-fraction``: training from scratch with warm-up, a stable peak and a decay over
    the last share of the steps, named apart, a candidate for the best baseline as every rate is."""
    from megatron_multilevel.config import load_config
    from megatron_multilevel.training.schedule import build_phases, lr_factor

    tool = _tool()
    args = tool.parse_args(tool.build_parser(), ["--size", "tiny", "--steps", "100", "--methods", "stacking",
                                                 "--scratch-lr", "0.002", "0.004", "--scratch-decay-fraction", "1", "0.25"])
    made = tool.variants(args, tool.base_config(args))
    assert sorted(made) == ["scratch", "scratch-lr0.004", "scratch-lr0.004-wsd0.25", "scratch-wsd0.25", "stacking"]
    phase, = build_phases(load_config(made["scratch-wsd0.25"]))
    # 4 warm-up steps, the peak to step 75, a cosine over the last 24 (round(0.25 * 96))
    factors = [lr_factor(s, phase.steps, phase.lr) for s in range(100)]
    assert factors[3:76] == [1.0] * 73 and 1.0 > factors[77] > factors[98]
    assert family("scratch-lr0.004-wsd0.25") == "scratch"
    with pytest.raises(SystemExit):
        tool.parse_args(tool.build_parser(), ["--size", "tiny", "--scratch-decay-fraction", "0"])
    # a size trained by SGD, its baseline also by AdamW: named apart, AdamW's rate the one given
    args = tool.parse_args(tool.build_parser(), ["--size", "ode-paper", "--steps", "100", "--methods", "coarse",
                                                 "--scratch-optimizer", "adamw", "--scratch-lr", "0.001"])
    made = tool.variants(args, tool.base_config(args))
    assert sorted(made) == ["coarse", "scratch-adamw-lr0.001"]
    assert made["scratch-adamw-lr0.001"]["optimizer"]["type"] == "AdamW" and made["coarse"]["optimizer"]["type"] == "SGD"
    assert load_config(made["scratch-adamw-lr0.001"]).level_deepspeed(0)["optimizer"]["params"]["lr"] == 0.001


def test_normalised_wall_clock_by_hand():
    times = {"8x256": {"seconds_per_step": 1.0}, "4x128": {"seconds_per_step": 0.25}}
    fine, coarse = {"num_layers": 8, "hidden_size": 256}, {"num_layers": 4, "hidden_size": 128}
    # 10 fine steps (100 FLOPs), 40 coarse steps (80 FLOPs), 10 fine steps (100 FLOPs)
    phases = [{"steps": 10, "model": fine, "flops": 100.0}, {"steps": 40, "model": coarse, "flops": 80.0},
              {"steps": 10, "model": fine, "flops": 100.0}]
    assert normalized_seconds(phases, times) == pytest.approx(10 + 40 * 0.25 + 10)
    assert normalized_at_flops(phases, times, 50.0) == pytest.approx(5.0)  # half the first phase
    assert normalized_at_flops(phases, times, 140.0) == pytest.approx(10 + 5.0)  # half the coarse phase
    assert normalized_at_flops(phases, times, 230.0) == pytest.approx(20 + 5.0)
    assert family("fcycle2-depth-ea0.1") == "fcycle" and family("scratch") == "scratch"


def test_the_table_says_where_the_smaller_model_suffices():
    """The coarse model alone, where its full-budget run reaches scratch's final loss in a seed, is
    marked in the table (the smaller model is then the better choice at this budget); elsewhere not."""
    times = {"8x256": {"seconds_per_step": 1.0}, "4x256": {"seconds_per_step": 0.5}}

    def run(method, seed, loss):
        shape = {"num_layers": 4 if method == "coarse" else 8, "hidden_size": 256}
        valid = [{"flops": 50.0, "tokens": 1, "seconds": 1.0, "loss": 5.0, "level": 0},
                 {"flops": 100.0, "tokens": 2, "seconds": 2.0, "loss": loss, "level": 0}]
        return {"method": method, "seed": seed, "fraction": 1.0, "valid": valid,
                "phases": [{"steps": 10, "model": shape, "flops": 100.0}],
                "totals": {"final_valid_loss": loss, "flops": 100.0, "wall_seconds": 2.0}}

    results = [run("scratch", 1, 3.9), run("scratch", 2, 3.8),
               run("coarse", 1, 3.7), run("coarse", 2, 3.85),  # better than scratch in seed 1 only
               run("fcycle2", 1, 3.6), run("fcycle2", 2, 3.5)]
    md = table(collect(results, times))
    assert "| coarse (the smaller model suffices: 1/2 seeds) |" in md
    assert "| fcycle2 |" in md and "| scratch |" in md
    worse = [r for r in results if r["method"] != "coarse"] + [run("coarse", 1, 4.0), run("coarse", 2, 3.9)]
    assert "| coarse |" in table(collect(worse, times))


def test_ode_variant_schedule():
    """ode2: four cycles of (ea/2 fine, coarse_share/4 coarse, ea/2 fine) at a constant rate, then the
    fine level with what the budget leaves, decaying; the coarse model keeps every other layer."""
    cfg = variant_configs(BASE, steps=400, fine_lr=1e-3, ea=0.1, coarse_share=0.5,
                          ode={"coherence": "none", "cycles": 2})
    parsed = load_config(cfg["ode2"])
    ode = parsed.multilevel.ode
    assert parsed.multilevel.strategy == "ode" and ode.coherence == "none" and ode.cycles == 2
    assert (ode.pre_steps, ode.coarse_steps, ode.post_steps) == (20, 100, 20)
    assert ode.fine_lr.decay == "constant" and ode.final_lr.decay == "cosine" and ode.coarse_lr.peak == 1e-3
    # a coarse step of 4 of the 8 layers: its FLOPs over a fine step's, from the model's own arithmetic
    fine, coarse = parsed.level_models()
    assert coarse.num_layers == 4 and coarse.hidden_size == fine.hidden_size
    assert _phase_steps(cfg["ode2"]) == [20, 100, 20, 20, 100, 20, ode.final_steps]
    flops, scratch = _budget(cfg["ode2"])[1], _budget(cfg["scratch"])[1]
    assert scratch - scratch / 400 <= flops <= scratch  # the same compute, to within one fine step
    # a budget too small for the cycles is an error only for the method that needs them
    assert set(variant_configs(BASE, steps=12, fine_lr=1e-3, methods=["vcycle2"])) == {"scratch", "vcycle2"}
    with pytest.raises(ValueError, match="4 cycles of 1 \\+ 2 \\+ 1 steps leave no fine steps of the 12-step budget"):
        variant_configs(BASE, steps=12, fine_lr=1e-3, methods=["ode2"])
    with pytest.raises(ValueError, match="multilevel.ode.coherence"):
        load_config(variant_configs(BASE, steps=400, fine_lr=1e-3, ode={"coherence": "second"})["ode2"])


def test_ode_variant_coarse_first():
    """ode2 with ea 0 and one cycle: the coarse model first, from the initialisation (warming up as
    scratch does), its change written into both layers of every pair, then the fine model; the
    budget as before. The schedule of phases is built by the trainer's own code."""
    from megatron_multilevel.training.schedule import build_phases

    cfg = variant_configs(BASE, steps=400, fine_lr=1e-3, ea=0.0, coarse_share=0.8, warmup=20,
                          ode={"coherence": "none", "cycles": 1, "prolongation": "constant"})
    parsed = load_config(cfg["ode2"])
    ode = parsed.multilevel.ode
    assert (ode.pre_steps, ode.coarse_steps, ode.post_steps, ode.prolongation) == (0, 320, 0, "constant")
    assert ode.coarse_lr.warmup_steps == 20 and ode.fine_lr.warmup_steps == 0
    phases = build_phases(parsed)
    # the empty first phase only holds the fresh fine model the coarse one is restricted from
    assert [(p.level, p.steps, p.arrival) for p in phases] == [
        (0, 0, "fresh"), (1, 320, "restrict"), (0, ode.final_steps, "prolong")]
    flops, scratch = _budget(cfg["ode2"])[1], _budget(cfg["scratch"])[1]
    assert scratch - scratch / 400 <= flops <= scratch
    # with smoothing steps the coarse phases do not warm up (they start from a trained model)
    assert load_config(variant_configs(BASE, steps=400, fine_lr=1e-3, ea=0.1)["ode2"]).multilevel.ode.coarse_lr.warmup_steps == 0


def test_variants_on_one_schedule():
    """``lr_schedule="continue"``: every method but the two from scratch (the fine model and the
    coarse model alone) runs one schedule over its run, and
    every config builds (the ODE strategy's cycles then decay with the run instead of staying
    constant, so its phases agree on one decay)."""
    from megatron_multilevel.training.schedule import build_phases

    configs = variant_configs(BASE, steps=400, fine_lr=1e-3, ea=0.1, lr_schedule="continue")
    assert "lr_schedule" not in configs["scratch"]["multilevel"]
    for name, cfg in configs.items():
        if name in ("scratch", "coarse"):
            continue
        phases = build_phases(load_config(cfg))
        assert load_config(cfg).multilevel.lr_schedule == "continue", name
        assert [p.run_schedule[0] for p in phases] == [sum(q.steps for q in phases[:i]) for i in range(len(phases))]
        # the last step of the run is at the floor of its cosine
        last = [p for p in phases if p.steps][-1]
        assert last.lr_factor(last.steps - 1) == pytest.approx(0.1, abs=2e-4), name
    assert load_config(configs["ode2"]).multilevel.ode.fine_lr.decay == "cosine"
    corrected = variant_configs(BASE, steps=400, fine_lr=1e-3, interpolation="correction")
    assert {name: load_config(cfg).multilevel.interpolation for name, cfg in corrected.items()
            if name[0] in "vwf"} == {"vcycle2": "correction", "vcycle3": "correction", "wcycle2": "correction",
                                     "fcycle2": "correction"}
    assert load_config(variant_configs(BASE, steps=400, fine_lr=1e-3)["fcycle2"]).multilevel.lr_schedule == "restart"


def test_kept_runs_of_one_code_version(tmp_path):
    for name, version in [("b-s2", "v1"), ("a-s1", "v1"), ("c-s1", "v2"), ("d-s1", "v3")]:
        (tmp_path / f"{name}.json").write_text(json.dumps({"method": name, "version": version}))
    (tmp_path / "notes.txt").write_text("not a run")
    runs, others = kept_runs(str(tmp_path), "v1")
    assert [r["method"] for r in runs] == ["a-s1", "b-s2"]
    assert others == ["v2", "v3"]
    assert kept_runs(str(tmp_path / "missing"), "v1") == ([], [])


def test_a_kept_run_is_reused_from_another_checkout_only(tmp_path):
    config = {"training": {"output_dir": "/a/runs/x", "lr": {"peak": 1e-3}},
              "data": {"cache_dir": "/a/.cache/data", "seq_length": 64}}
    kept = tmp_path / "run.json"
    kept.write_text(json.dumps({"version": "v1", "config": {
        "training": {"output_dir": "/b/runs/y", "lr": {"peak": 1e-3}},
        "data": {"cache_dir": "/b/.cache/data", "seq_length": 64}}}))
    assert reusable(str(kept), "v1", config)  # other places, same settings, same code
    assert not reusable(str(kept), "v2", config)  # other code
    other = json.loads(json.dumps(config))
    other["data"]["seq_length"] = 128
    assert not reusable(str(kept), "v1", other)  # another setting
    assert not reusable(str(tmp_path / "missing.json"), "v1", config)
    assert config["data"]["cache_dir"] == "/a/.cache/data"  # the caller's config is left as it was


def _run_samples(config: dict) -> int:
    from megatron_multilevel.training.schedule import build_phases

    return sum(p.steps for p in build_phases(load_config(config))) * config["train_batch_size"]


def test_every_run_of_a_table_reads_a_prefix_of_one_sample_order(tmp_path, monkeypatch):
    """Every run the benchmark launches (scratch, every method at every fraction) is given the same
    data.order_samples: the training samples of the longest run of the table at the full budget (on
    the FLOPs budget, the coarse model alone); a later call keeps the kept runs' order."""
    from megatron_multilevel.study.runs import table_order

    tool = _tool()
    launched = {}

    def launch(config, path, procs):
        launched[config["training"]["output_dir"].rsplit("/", 1)[1]] = json.loads(json.dumps(config))
        return 0.0

    monkeypatch.setattr(tool, "launch", launch)
    monkeypatch.setattr(tool, "run_result", lambda run_dir, **kw: {"config": kw["config"],
                                                                   "totals": {"final_valid_loss": 1.0}})
    monkeypatch.setattr(tool, "write_json", lambda path, value: None)
    monkeypatch.setattr(tool, "report", lambda *a: {})
    argv = ["--size", "tiny", "--steps", "40", "--methods", "vcycle2", "stacking", "coarse", "--fractions", "1", "0.7",
            "--out", str(tmp_path / "work"), "--results", str(tmp_path / "kept")]
    assert tool.main(argv) == 0
    methods = ("vcycle2", "stacking", "coarse")
    assert sorted(launched) == sorted(["scratch-f1-s1234"] + [f"{m}-f{f}-s1234" for m in methods for f in ("1", "0.7")])
    samples = {run: _run_samples(cfg) for run, cfg in launched.items()}
    longest = max(samples.values())
    assert longest == samples["coarse-f1-s1234"] > samples["scratch-f1-s1234"] > samples["vcycle2-f0.7-s1234"]
    assert {cfg["data"]["order_samples"] for cfg in launched.values()} == {longest}
    # the table's kept runs fix the order: a later call keeps theirs where it is enough, else stops
    args = tool.parse_args(tool.build_parser(), argv)
    configs = tool.variants(args, tool.base_config(args))
    kept = [{"config": {"data": {"order_samples": longest + 8}}}]
    assert table_order(configs, [], None, where="kept") == longest
    assert table_order(configs, kept, None, where="kept") == longest + 8
    with pytest.raises(ValueError, match=f"the kept runs in kept: an order of {longest - 1} samples is fewer than the "
                                         f"{longest} training samples of the longest run"):
        table_order(configs, [{"config": {"data": {"order_samples": longest - 1}}}], None, where="kept")
    with pytest.raises(ValueError, match="a table reads one order"):
        table_order(configs, kept, longest, where="kept")
    with pytest.raises(ValueError, match=f"--order-samples: an order of {longest - 1} samples is fewer"):
        table_order(configs, [], longest - 1, where="kept")


def test_step_times_measured_again_for_a_shape_added_since(tmp_path):
    """The kept per-step times are reused while they cover every shape the kept runs train; a
    method added since that trains another shape has every shape measured again, together."""
    tool = _tool()
    calls = []

    def measure(configs):
        calls.append(sorted(configs))
        return {"8x256": {"seconds_per_step": 1.0}, "4x256": {"seconds_per_step": 0.5},
                "4x128": {"seconds_per_step": 0.2}}

    def run(method, *shapes):
        return {"method": method, "config": {"m": method},
                "phases": [{"model": {"num_layers": n, "hidden_size": h}} for n, h in shapes]}

    path = tmp_path / "step_time.json"
    path.write_text(json.dumps({"version": "v1", "times": {"8x256": {"seconds_per_step": 0.9},
                                                           "4x256": {"seconds_per_step": 0.4}}}))
    depth = [run("scratch", (8, 256)), run("fcycle2", (4, 256), (8, 256))]
    assert tool.kept_step_times(str(path), "v1", depth, measure)["8x256"]["seconds_per_step"] == 0.9
    assert calls == []  # every shape kept: reused
    both = depth + [run("fcycle2-width+depth", (4, 128), (8, 256))]
    times = tool.kept_step_times(str(path), "v1", both, measure)
    assert calls == [["fcycle2", "fcycle2-width+depth", "scratch"]] and set(times) == {"8x256", "4x256", "4x128"}
    assert json.loads(path.read_text()) == {"version": "v1", "times": times}  # kept for the next report
    assert tool.kept_step_times(str(path), "v1", both, measure) == times and len(calls) == 1
    tool.kept_step_times(str(path), "v2", depth, measure)  # other code: measured again
    assert len(calls) == 2


def _study_results(commit: str, seeds: dict) -> dict:
    """A made-up results.json of one point with scratch and ``fcycle2`` (0.1 below scratch):
    ``seeds[seed] = (scratch loss, (fcycle2's equal-quality saving, its crossing saving, its bound))``."""
    methods = {"scratch": {"family": "scratch", "seeds": []}, "fcycle2": {"family": "fcycle", "seeds": []}}
    finals = {"scratch": [], "fcycle2": []}
    for seed, (scratch_loss, (eq, crossing, bound)) in seeds.items():
        finals["scratch"].append(scratch_loss)
        finals["fcycle2"].append(scratch_loss - 0.1)
        methods["fcycle2"]["seeds"].append({"seed": seed, "equal_quality": {"bound": bound}})
        methods["fcycle2"].setdefault("eq", []).append(eq)
        methods["fcycle2"].setdefault("cr", []).append(crossing)
        methods["fcycle2"].setdefault("s", []).append(None if eq is None else eq - 0.02)
    methods["scratch"].update(final_valid_loss=summarize(finals["scratch"]))
    f = methods["fcycle2"]
    f.update(final_valid_loss=summarize(finals["fcycle2"]), eq_saving_flops=summarize(f.pop("eq")),
             crossing_saving_flops=summarize(f.pop("cr")), eq_saving_seconds_normalized=summarize(f.pop("s")))
    return {"baseline": "scratch", "seeds": sorted(seeds), "methods": methods, "commits": [commit],
            "config": {"train_batch_size": 16, "data": {"seq_length": 64},
                       "model": {"kind": "gpt", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                                 "vocab_size": 512, "max_sequence_length": 64}}}


def _add_one_budget_method(results: dict, seeds: dict, name: str = "ode2", family: str = "ode") -> None:
    """Adds ``name`` to a made-up results.json, run at the full budget only (no equal-quality
    figure): ``seeds[seed] = (scratch's loss, its final loss)``, in the order of the point's seeds."""
    runs = [{"seed": seed, "target_loss": target, "final_valid_loss": {"1": final},
             "equal_quality": {"fraction": None, "saving": None, "bound": "one_budget", "gap": None}}
            for seed, (target, final) in seeds.items()]
    nothing = summarize([None] * len(seeds))
    results["methods"][name] = {"family": family, "seeds": runs,
                                "final_valid_loss": summarize([final for _, final in seeds.values()]),
                                "eq_saving_flops": nothing, "eq_saving_seconds_normalized": nothing,
                                "crossing_saving_flops": nothing}


def test_study_rows_and_their_table(tmp_path):
    """The scale study's rows by hand: regime, medians and spreads, lower bounds; points made by
    other code are left out."""
    from megatron_multilevel.study.savings import study_rows

    report = _tool("study_report")
    read_points, table = report.read_points, report.table

    pinned, other = "a" * 40, "b" * 40
    (tmp_path / "STUDY_COMMIT").write_text(pinned + "\n")
    made = {"cpu-4x128-960": _study_results(pinned, {1: (4.0, (0.30, 0.35, "interpolated")),
                                                      2: (4.2, (0.10, None, "at_most")),
                                                      3: (4.1, (None, 0.05, "not_reached"))}),
            "cpu-4x128-240": _study_results(pinned, {1: (5.0, (None, None, "not_reached"))}),
            "cpu-4x128-3840": _study_results(other, {1: (3.0, (0.5, 0.5, "interpolated"))}),
            "explore-4x128-240": _study_results(pinned, {1: (5.0, (0.9, 0.9, "interpolated"))})}
    # the ODE strategy, run at the full budget only: 0.01 under scratch's loss in seeds 1 and 3
    _add_one_budget_method(made["cpu-4x128-960"], {1: (4.0, 3.99), 2: (4.2, 4.21), 3: (4.1, 4.09)})
    # another, at or under it in every seed (level with it in seed 2)
    _add_one_budget_method(made["cpu-4x128-960"], {1: (4.0, 3.9), 2: (4.2, 4.2), 3: (4.1, 4.0)}, "ode2-b")
    _add_one_budget_method(made["cpu-4x128-240"], {1: (5.0, 5.3)})
    # the coarse model alone: under scratch's loss in seeds 1 and 3 at 0.98 tokens per parameter
    _add_one_budget_method(made["cpu-4x128-960"], {1: (4.0, 3.95), 2: (4.2, 4.25), 3: (4.1, 4.0)}, "coarse", "coarse")
    _add_one_budget_method(made["cpu-4x128-240"], {1: (5.0, 5.1)}, "coarse", "coarse")
    for name, results in made.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    points, notes = read_points(str(tmp_path), pinned)
    assert sorted(points) == ["cpu-4x128-240", "cpu-4x128-960"]
    assert notes == [f"cpu-4x128-3840: made by ['{other}'], not the study's {pinned[:12]}: left out"]

    rows = study_rows(points, {"4x128": 1_000_000})
    assert [r["point"] for r in rows] == ["cpu-4x128-240", "cpu-4x128-960"]  # by budget
    row = rows[1]
    assert (row["steps"], row["tokens"], row["seeds"]) == (960, 960 * 16 * 64, 3)
    assert row["tokens_per_parameter"] == pytest.approx(960 * 16 * 64 / 1e6)
    assert row["scratch_final_loss"] == pytest.approx(4.1) and row["scratch_final_loss_range"] == [4.0, 4.2]
    eq = row["methods"]["fcycle2"]["equal_quality"]
    assert (eq["median"], eq["min"], eq["max"], eq["reached"], eq["n"], eq["at_least"]) == (
        pytest.approx(0.2), 0.10, 0.30, 2, 3, 1)
    text = table(rows)
    assert ("| cpu-4x128-960 | 1.00M | 0.98M | 0.98 | 3 | scratch: 4.1000 (4.0000 to 4.2000) | fcycle2 | 4.0000 | "
            "20.0% (10.0 to 30.0), 2/3 (at least, in 1 of them: the smallest budget reached it) | "
            "18.0% (8.0 to 28.0), 2/3 (at least, in 1 of them: the smallest budget reached it) | "
            "20.0% (5.0 to 35.0), 2/3 |") in text
    assert "| cpu-4x128-240 | 1.00M | 0.25M | 0.25 | 1 | scratch: 5.0000 (5.0000 to 5.0000) | fcycle2 | 4.9000 | " \
           "not reached, 0/1 | not reached, 0/1 | not reached, 0/1 |" in text
    # a method run at the full budget only: at or under scratch's loss there is a saving of 0 or more
    ode = "full budget only: scratch's loss reached in 2/3"
    assert f"| ode2 | 4.0900 | {ode} | {ode} | not reached, 0/3 |" in text
    assert ("| ode2 | 5.3000 | not reached at the full budget, 0/1 | not reached at the full budget, 0/1 | "
            "not reached, 0/1 |") in text
    everywhere = "0% or more (full budget only: scratch's loss reached in 3/3)"
    assert f"| ode2-b | 4.0000 | {everywhere} | {everywhere} | not reached, 0/3 |" in text
    assert [rows[1]["methods"][m]["equal_quality"]["zero_or_more"] for m in ("fcycle2", "ode2", "ode2-b")] == [
        False, False, True]
    # where the smaller model alone reaches scratch's loss, the table says so; where it does not, not
    assert "| coarse (the smaller model suffices: 2/3) | 4.0000 |" in text
    assert "| cpu-4x128-240 | 1.00M | 0.25M | 0.25 | 1 | scratch: 5.0000 (5.0000 to 5.0000) | coarse | 5.1000 |" in text
    assert rows[1]["methods"]["fcycle2"]["smaller_model_suffices"] is None

    from megatron_multilevel.study.plotting import plot_scale

    with open(plot_scale(rows, str(tmp_path / "plot")), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_saving_says_what_its_seeds_run_at_the_full_budget_only_did():
    """A method with fractions in one seed and the full budget only in another: the second seed
    is no miss, and the saving's text says what it did."""
    from megatron_multilevel.study.savings import format_saving, summarize

    block = {**summarize([0.181, None]), "at_least": 0, "one_budget": 1, "full_budget_reached": 1,
             "zero_or_more": False}
    assert format_saving(block) == ("18.1% (18.1 to 18.1), 1/2 (1 more at the full budget only: scratch's loss "
                                    "reached in 1/1)")
    assert format_saving({**block, "one_budget": 0, "full_budget_reached": 0}) == "18.1% (18.1 to 18.1), 1/2"


def test_the_regime_plot_takes_every_regime_pin_with_a_cycle(tmp_path):
    """The regime plot holds the other regime pins' points (regime, regime2, regime3), but not a
    pin of growths only, which has no cycle's saving to plot."""
    report = _tool("study_report")

    def row(point, methods):
        return {"point": point, "methods": {m: {"family": f, "equal_quality": {"median": v}} for m, f, v in methods}}

    cycle = row("long-4x64-100", [("fcycle2", "fcycle", 0.1), ("stacking", "stacking", 0.2)])
    (tmp_path / "regime.json").write_text(json.dumps({"commit": "a" * 40, "points": [cycle]}))
    (tmp_path / "regime2.json").write_text(json.dumps({"commit": "b" * 40, "points": [
        row("long2-8x32-100", [("fcycle2-coarse0.1", "fcycle", 0.13)])]}))
    (tmp_path / "regime3.json").write_text(json.dumps({"commit": "c" * 40, "points": [
        row("long3-4x64-100", [("gstack", "gstack", None)])]}))
    studies = report.regime_studies(str(tmp_path), "regime2", "b" * 40, ["mine"])
    assert studies == {"regime2 study (bbbbbbb)": ["mine"], "regime study (aaaaaaa)": [cycle]}
    assert list(report.regime_studies(str(tmp_path), "regime3", "c" * 40, [])) == [
        "regime3 study (ccccccc)", "regime study (aaaaaaa)", "regime2 study (bbbbbbb)"]


def test_phase_leads_against_scratch_at_equal_flops(tmp_path, capsys, monkeypatch):
    """A run's lead over scratch at each phase end, by hand on a made-up piecewise-linear scratch
    curve; the study report's table of them, from run files (full budget only, same seed, the
    point's code version)."""
    from megatron_multilevel.study.savings import phase_leads

    scratch = [{"flops": f * 1e9, "loss": loss} for f, loss in ((1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0))]
    # phase ends at 0.5e9 (before scratch's first evaluation), 1.5e9, 2.5e9 and 4e9 FLOPs:
    # scratch is at -, 3.5, 2.75 and 2.0 there
    phases = [{"flops": 0.5e9, "valid_loss": 4.5}, {"flops": 1e9, "valid_loss": 3.0},
              {"flops": 1e9, "valid_loss": 2.4}, {"flops": 1.5e9, "valid_loss": 1.9}]
    leads = phase_leads(scratch, phases)
    assert leads[0] is None and leads[1:] == pytest.approx([0.5, 0.35, 0.1])
    with pytest.raises(AssertionError):  # more FLOPs than scratch's whole run: not the same budget
        phase_leads(scratch, phases + [{"flops": 1e9, "valid_loss": 1.0}])

    report = _tool("study_report")
    runs = tmp_path / "cpu-4x128-960" / "runs"
    runs.mkdir(parents=True)

    def write(method, seed, fraction, phases, valid=(), version="v1"):
        (runs / f"{method}-f{fraction:g}-s{seed}.json").write_text(json.dumps(
            {"method": method, "fraction": fraction, "seed": seed, "phases": phases, "valid": list(valid),
             "version": version}))

    for seed, shift in ((1, 0.0), (2, 0.2)):  # seed 2's scratch ends 0.2 higher everywhere
        write("scratch", seed, 1.0, [{"level": 0, "steps": 40, "flops": 4e9, "valid_loss": 2.0 + shift}],
              [{**v, "loss": v["loss"] + shift} for v in scratch])
        write("fcycle2", seed, 1.0, [{"level": 1, "steps": 30, "flops": 1.5e9, "valid_loss": 3.0}]
              + [{"level": 0, "steps": 10, **p} for p in phases[2:]])  # ends at 1.5e9, 2.5e9, 4e9
        write("fcycle2", seed, 0.8, [{"level": 1, "steps": 1, "flops": 1e9, "valid_loss": 9.0}] * 2)
        write("vcycle2", seed, 0.8, [{"level": 1, "steps": 1, "flops": 1e9, "valid_loss": 9.0}] * 2)  # no full budget
        write("stacking", seed, 1.0, [{"level": 1, "steps": 30, "flops": 1.5e9, "valid_loss": 3.3},
                                      {"level": 0, "steps": 25, "flops": 2.5e9, "valid_loss": 2.0}])
    write("stacking", 3, 1.0, [{"level": 1, "steps": 30, "flops": 1.5e9, "valid_loss": 0.0},
                               {"level": 0, "steps": 25, "flops": 2.5e9, "valid_loss": 0.0}])  # no scratch: left out
    write("ode2", 1, 1.0, [{"level": 0, "steps": 40, "flops": 4e9, "valid_loss": 2.0}])  # one phase: nothing to say
    write("wcycle2", 1, 1.0, [{"level": 1, "steps": 30, "flops": 1.5e9, "valid_loss": 3.0}] * 2,
          version="v0")  # made by other code than the point's results.json: left out
    leads = report.read_leads(str(tmp_path), [{"point": "cpu-4x128-960"}],
                              {"cpu-4x128-960": {"version": "v1", "baseline": "scratch"}})
    assert [(x["method"], x["seeds"]) for x in leads] == [("fcycle2", [1, 2]), ("stacking", [1, 2])]
    fcycle = leads[0]
    assert fcycle["phases"] == [{"level": 1, "steps": 30}, {"level": 0, "steps": 10}, {"level": 0, "steps": 10}]
    assert fcycle["lead_by_seed"]["1"] == pytest.approx([0.5, 0.35, 0.1])
    assert fcycle["lead_by_seed"]["2"] == pytest.approx([0.7, 0.55, 0.3])
    assert fcycle["lead"] == pytest.approx([0.6, 0.45, 0.2])
    assert leads[1]["lead"] == pytest.approx([0.3, 0.1])  # scratch at 3.5 and 2.0 (+0.1 for the median)
    assert ("| cpu-4x128-960 | fcycle2 | 2 | 1: 30, 0: 10, 0: 10 | +0.600, +0.450, +0.200 |"
            in report.leads_table(leads))
    # --point: one point's rows and leads, any point, by its own code version
    results = {**_study_results("c" * 40, {1: (2.0, (0.3, 0.35, "interpolated")), 2: (2.2, (0.1, 0.15, "interpolated"))}),
               "version": "v1"}
    (tmp_path / "cpu-4x128-960" / "results.json").write_text(json.dumps(results))
    monkeypatch.setattr(report, "parameter_counts", lambda points: {"4x128": 1_000_000})
    assert report.main(["--benchmarks", str(tmp_path), "--point", "cpu-4x128-960"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"cpu-4x128-960, made by {'c' * 40}")
    assert "| cpu-4x128-960 | 1.00M | 0.98M | 0.98 | 2 | scratch: 2.1000 (2.0000 to 2.2000) | fcycle2 | 2.0000 |" in out
    assert "| cpu-4x128-960 | fcycle2 | 2 | 1: 30, 0: 10, 0: 10 | +0.600, +0.450, +0.200 |" in out
    with pytest.raises(SystemExit, match="no .*nope-4x128-960/results.json"):
        report.main(["--benchmarks", str(tmp_path), "--point", "nope-4x128-960"])


def test_savings_are_against_the_best_tuned_scratch():
    """Of the scratch runs at several learning rates, the one ending lowest (median over seeds, among
    the rates run with every seed) is the baseline; the others stay in the table with what they lose."""
    times = {"8x256": {"seconds_per_step": 1.0}}

    def run(method, seed, loss, fraction=1.0):
        valid = [{"flops": 50.0 * fraction, "tokens": 1, "seconds": 1.0, "loss": 5.0, "level": 0},
                 {"flops": 100.0 * fraction, "tokens": 2, "seconds": 2.0, "loss": loss, "level": 0}]
        return {"method": method, "seed": seed, "fraction": fraction, "valid": valid,
                "phases": [{"steps": 10, "model": {"num_layers": 8, "hidden_size": 256}, "flops": 100.0 * fraction}],
                "totals": {"final_valid_loss": loss, "flops": 100.0 * fraction, "wall_seconds": 2.0 * fraction}}

    results = [run("scratch", 1, 3.9), run("scratch", 2, 3.8),
               run("scratch-lr0.004", 1, 3.7), run("scratch-lr0.004", 2, 3.75),
               run("scratch-lr0.001", 1, 4.0), run("scratch-lr0.001", 2, 4.1),
               run("scratch-lr0.008", 1, 3.0),  # one seed only: not a candidate
               run("fcycle2", 1, 3.6), run("fcycle2", 2, 3.72), run("fcycle2", 1, 3.8, 0.5), run("fcycle2", 2, 3.8, 0.5)]
    summary = collect(results, times)
    assert summary["baseline"] == "scratch-lr0.004"
    first = summary["methods"]["fcycle2"]["seeds"][0]
    assert first["target_loss"] == 3.7
    # seed 1: 3.6 at the full budget, 3.8 at half; 3.7 is reached at three quarters
    assert first["eq_saving_flops"] == pytest.approx(0.25)
    # seed 2: 3.72 at the full budget, 3.8 at half; 3.75 at 0.5 + 0.5 * 0.05 / 0.08
    assert summary["methods"]["fcycle2"]["seeds"][1]["eq_saving_flops"] == pytest.approx(1 - (0.5 + 0.5 * 0.05 / 0.08))
    # the untuned scratch stays beside it, with the FLOPs it would have needed: never reached
    assert summary["methods"]["scratch"]["final_valid_loss"]["median"] == pytest.approx(3.85)
    assert "| scratch-lr0.004 |" in table(summary) and "| scratch |" in table(summary)


def test_the_baselines_own_crossing_is_no_saving():
    """A baseline whose curve dips under its final loss before the end (a noisy last evaluation)
    crosses it early; both crossing figures measure against that crossing, so the baseline saves
    nothing by either, and a method's normalised saving is against the same point."""
    times = {"8x256": {"seconds_per_step": 1.0}}

    def run(method, losses):
        valid = [{"flops": 25.0 * (i + 1), "tokens": i, "seconds": float(i + 1), "loss": loss, "level": 0}
                 for i, loss in enumerate(losses)]
        return {"method": method, "seed": 1, "fraction": 1.0, "valid": valid,
                "phases": [{"steps": 100, "model": {"num_layers": 8, "hidden_size": 256}, "flops": 100.0}],
                "totals": {"final_valid_loss": losses[-1], "flops": 100.0, "wall_seconds": 4.0}}

    summary = collect([run("scratch", [5.0, 4.0, 3.0, 3.1]), run("fcycle2", [4.0, 3.05, 2.9, 2.8])], times)
    base = summary["methods"]["scratch"]["seeds"][0]
    assert base["crossing_saving_flops"] == 0.0 and base["crossing_saving_seconds_normalized"] == pytest.approx(0.0)
    # scratch reaches 3.1 at 50 + 25 * 0.9 = 72.5 FLOPs (between 4.0 and 3.0, before its last 3.1);
    # fcycle2 at 25 + 25 * 0.9 / 0.95
    ours = summary["methods"]["fcycle2"]["seeds"][0]
    expected = 1 - (25 + 25 * 0.9 / 0.95) / 72.5
    assert ours["crossing_saving_flops"] == pytest.approx(expected)
    assert ours["crossing_saving_seconds_normalized"] == pytest.approx(expected)  # one shape: seconds follow FLOPs
