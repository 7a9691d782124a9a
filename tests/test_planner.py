"""The schedule planner: its law against closed forms, its advice, and the tool around it."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from launch_helpers import load_tool
from megatron_multilevel.config import load_config
from megatron_multilevel.study.planner import StudyPoint, fit, leave_one_out, plan, schedule_of

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = {"cycle": "f", "num_levels": 2, "coarse_share": 0.8, "revisit": 0.5, "ea": 0.1}


def point(name, parameters, tpp, saving, *, suffices=None, schedule=SCHEDULE):
    return StudyPoint(point=name, study="made-up", shape="4x64", parameters=parameters, tokens_per_parameter=tpp,
                      method=None if saving is None else "fcycle2", saving=saving,
                      schedule=None if saving is None else schedule,
                      control_seeds=None if suffices is None else (int(suffices), 1))


def test_the_law_recovers_an_exact_one():
    """Points lying on saving = 0.3 - 0.04 ln(tpp) + 0.02 ln(N) (three sizes, three budgets each) give
    back its coefficients, no residual, and leave-one-out predictions equal to the measurements."""
    points = [point(f"p{i}", n, t, 0.3 - 0.04 * math.log(t) + 0.02 * math.log(n))
              for i, (n, t) in enumerate([(1e5, 0.1), (1e5, 10), (1e5, 2), (1e6, 1), (1e6, 30), (1e6, 0.2),
                                          (1e7, 0.05), (1e7, 3), (1e7, 80)])]
    law = fit(points)
    assert law.with_size and law.coefficients == pytest.approx((0.3, -0.04, 0.02))
    # three sizes, but one of them measured once: its effect cannot be told from its budget's
    assert not fit([*points[:6], points[6]]).with_size
    assert law.residual_std == pytest.approx(0.0, abs=1e-9)
    for row in leave_one_out(points):
        assert row["error"] == pytest.approx(0.0, abs=1e-9)


def test_prediction_interval_is_simple_regressions():
    """With two sizes (no size term), the interval is simple linear regression's for a new point:
    s * sqrt(1 + 1/n + (x0 - mean x)^2 / Sxx), worked out here from the closed forms."""
    data = [(0.1, 0.40), (0.5, 0.33), (1.0, 0.31), (4.0, 0.22), (20.0, 0.12)]
    points = [point(f"p{i}", 1e6 if i % 2 else 2e6, t, s) for i, (t, s) in enumerate(data)]
    xs, ys = [math.log(t) for t, _ in data], [s for _, s in data]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    resid = math.sqrt(sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)) / (n - 2))
    law = fit(points)
    assert not law.with_size and law.coefficients == pytest.approx((intercept, slope))
    x0 = math.log(50.0)
    mean, half = law.predict(1e6, 50.0)
    assert mean == pytest.approx(intercept + slope * x0)
    assert half == pytest.approx(resid * math.sqrt(1 + 1 / n + (x0 - mx) ** 2 / sxx))
    assert law.extrapolates(50.0) and not law.extrapolates(2.0)


def test_the_advice():
    """The smaller model where the control found it sufficient at as many tokens per parameter or
    more; scratch where the law's interval lies under zero; else the nearest point's schedule."""
    other = {**SCHEDULE, "coarse_share": 0.5}
    points = [point("a", 1e6, 0.1, 0.40), point("b", 1e6, 1.0, 0.30), point("c", 1e6, 10.0, 0.20, schedule=other),
              point("d", 1e6, 100.0, 0.10, schedule=other), point("e", 1e6, 1000.0, 0.0)]
    result = plan(points, 1e6, 5e6, bar=0.0)  # 5 tokens per parameter: nearest is c
    assert result["advice"] == "multilevel" and result["from_point"] == "c" and result["schedule"] == other
    assert result["saving"] == pytest.approx(0.3 - 0.1 * math.log10(5), abs=1e-9)  # the points' own line
    # the bar: 0.230 expected, advised at a bar of 0.2, not at the default 0.25 (then scratch, with the
    # schedule that fell short named as the candidate)
    assert result["candidate"] is None and plan(points, 1e6, 5e6, bar=0.2)["advice"] == "multilevel"
    short = plan(points, 1e6, 5e6)
    assert short["advice"] == "scratch" and short["bar"] == 0.25 and short["schedule"] == other
    assert short["candidate"] == {"advice": "multilevel", "saving": pytest.approx(0.3 - 0.1 * math.log10(5))}
    assert plan(points, 1e6, 5e5)["advice"] == "multilevel"  # 0.5 tokens per parameter: 0.330 expected
    with pytest.raises(ValueError, match="bar"):
        plan(points, 1e6, 5e6, bar=25)
    assert plan(points, 1e6, 1e11)["advice"] == "scratch"  # 1e5 tokens per parameter: about -0.1
    uncertain = plan(points + [point("f", 1e6, 3.0, 0.5)], 1e6, 3e9)  # 3000: an interval across zero
    assert uncertain["saving"] - uncertain["interval"] < 0 < uncertain["saving"] + uncertain["interval"]
    assert uncertain["advice"] == "scratch"  # not shown to pay
    controlled = points + [point("ctl", 1e6, 2.0, None, suffices=True)]
    assert plan(controlled, 1e6, 1e6)["advice"] == "smaller model"  # 1 token per parameter, under 2
    assert plan(controlled, 1e6, 5e6, bar=0.0)["advice"] == "multilevel"  # beyond where the control was run
    with pytest.raises(ValueError, match="positive"):
        plan(points, 0, 1e6)


def test_schedule_of_a_recipe_config():
    """The shape read back from the benchmark's own F-cycle config is the one it was made with."""
    from megatron_multilevel.study.variants import RECIPE, variant_configs

    base = json.loads((ROOT / "configs" / "gpt_tiny_cpu.json").read_text())
    base.pop("multilevel")
    made = variant_configs(base, steps=1000, fine_lr=1e-3, warmup=40, methods=["fcycle2"],
                           **{**RECIPE, "coarse_share": 0.65, "fcycle_revisit": 0.25})["fcycle2"]
    got = schedule_of(made["multilevel"], 1000)
    assert got == {"cycle": "f", "num_levels": 2, "coarse_share": pytest.approx(0.65), "revisit": pytest.approx(0.25, abs=0.01),
                   "ea": pytest.approx(0.1)}


def _study(tmp_path, rows):
    (tmp_path / "regime.json").write_text(json.dumps({"commit": "a" * 40, "points": rows, "leads": []}))


def _row(name, parameters, tpp, saving, schedule=SCHEDULE, stacking=None):
    eq = {"median": saving, "min": saving, "max": saving}
    return {"point": name, "shape": "4x64", "parameters": parameters, "tokens_per_parameter": tpp,
            "scratch_final_loss": 2.0,
            "methods": {"fcycle2": {"family": "fcycle", "equal_quality": eq, "schedule": schedule,
                                    "smaller_model_suffices": None},
                        "stacking": {"family": "stacking", "equal_quality": {"median": stacking},
                                     "final_valid_loss": 1.99 if stacking else 2.01},
                        "coarse": {"family": "coarse", "equal_quality": {"median": None},
                                   "smaller_model_suffices": [0, 2]}}}


def test_the_tool_plans_a_config_and_writes_its_schedule(tmp_path, capsys):
    """--config reads the model's parameters and the run's tokens; --write gives the config the
    recipe at the planned share, for its own steps; stacking's saving is not the schedule's."""
    tool = load_tool("plan_schedule")
    share = {**SCHEDULE, "coarse_share": 0.65}
    # the tiny config's 0.31 tokens per parameter lie nearest p2
    _study(tmp_path, [_row("p1", 1e6, 0.03, 0.4), _row("p2", 1e6, 0.3, 0.3, share), _row("p3", 1e6, 10.0, 0.2),
                      _row("p4", 1e6, 100.0, 0.1)])
    out = tmp_path / "planned.json"
    config = ROOT / "configs" / "gpt_tiny_cpu.json"
    assert tool.main(["--config", str(config), "--benchmarks", str(tmp_path), "--write", str(out)]) == 0
    capsys.readouterr()
    raw = json.loads(config.read_text())
    cfg = load_config(raw)
    # the shipped tiny config is the recipe at S = 200 steps of 16 x its sequence (test_savings): its
    # compute, in tokens of the full model, is 200 steps' to within one step
    assert tool.main(["--config", str(config), "--benchmarks", str(tmp_path), "--json"]) == 0
    planned_for = json.loads(capsys.readouterr().out)
    one_step = raw["train_micro_batch_size_per_gpu"] * cfg.data.seq_length
    assert 199 * one_step <= planned_for["tokens"] <= 200 * one_step
    from megatron_multilevel.flops import parameter_count

    assert planned_for["parameters"] == parameter_count(cfg.model)
    planned = load_config(json.loads(out.read_text()))
    first = planned.multilevel.levels[1].visits[0]
    assert first.steps in (round(0.65 * 199), round(0.65 * 200))  # the nearest point's share of S
    assert (first.lr.peak, first.lr.warmup_steps) == (1e-3, 8)  # the run's start, as shipped
    assert planned.training == cfg.training and planned.model == cfg.model
    # where the law advises scratch, --write still gives the schedule to train multilevel with, and says so
    _study(tmp_path, [_row("q1", 1e6, 0.03, -0.01), _row("q2", 1e6, 0.3, 0.0, share), _row("q3", 1e6, 10.0, 0.01),
                      _row("q4", 1e6, 100.0, -0.02)])
    out.unlink()
    assert tool.main(["--config", str(config), "--benchmarks", str(tmp_path), "--write", str(out)]) == 0
    said = capsys.readouterr().out
    assert "advice: train the full model from scratch" in said and "the advice above is 'scratch'" in said
    assert load_config(json.loads(out.read_text())).multilevel.levels[1].visits[0].steps in (round(0.65 * 199), 130)
    with pytest.raises(SystemExit):  # --hold-out of a point that is not there
        tool.main(["--params", "1e5", "--tokens", "1e6", "--benchmarks", str(tmp_path), "--hold-out", "nope"])


def test_best_multilevel_and_the_regime_plot(tmp_path):
    from megatron_multilevel.study.plotting import plot_regime
    from megatron_multilevel.study.savings import best_multilevel

    row = _row("p1", 1e5, 20.0, 0.25, stacking=0.9)
    row["methods"]["fcycle2-coarse0.5"] = {"family": "fcycle", "equal_quality": {"median": 0.3}}
    row["methods"]["ode2"] = {"family": "ode", "equal_quality": {"median": None}}
    assert best_multilevel(row) == "fcycle2-coarse0.5"  # not stacking's 0.9, not the control
    assert best_multilevel({"methods": {"stacking": row["methods"]["stacking"]}}) is None
    path = plot_regime({"made-up": [row, {**_row("p2", 1e5, 40.0, None), "shape": "4x64"}]}, str(tmp_path))
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_growth_that_saved_more_than_the_cycles_is_the_advice(tmp_path, capsys):
    """Where progressive stacking (or a peer) saved more than every cycle at the nearest measured
    point, it is the advice, unless the smaller model is; --write gives it as the study ran it where
    it is a published form, else the cycle's schedule, and says so."""
    from megatron_multilevel.study.savings import best_growth

    row = _row("p1", 1e5, 20.0, 0.1, stacking=0.2)
    row["methods"]["gstack"] = {"family": "gstack", "equal_quality": {"median": 0.3}}
    row["methods"]["fcycle2-coarse0.5"] = {"family": "fcycle", "equal_quality": {"median": 0.5}}
    assert best_growth(row) == "gstack"  # the best growth, not the cycle's 0.5 nor the control
    assert best_growth({"methods": {"fcycle2": row["methods"]["fcycle2"]}}) is None
    points = [point("a", 1e6, 0.1, 0.40), point("b", 1e6, 1.0, 0.30), point("d", 1e6, 100.0, 0.10)]
    ahead = dataclasses.replace(point("c", 1e6, 10.0, 0.20), growth=("stacking", 0.25))
    result = plan(points + [ahead], 1e6, 5e6)  # 5 tokens per parameter: nearest is c
    assert result["advice"] == "growth" and result["growth"] == {
        "point": "c", "method": "stacking", "saving": 0.25, "cycle_method": "fcycle2", "cycle_saving": 0.20}
    behind = dataclasses.replace(ahead, growth=("stacking", 0.15))
    assert plan(points + [behind], 1e6, 5e6, bar=0.0)["advice"] == "multilevel"
    assert plan(points + [behind], 1e6, 5e6)["growth"] is None
    controlled = points + [ahead, point("ctl", 1e6, 20.0, None, suffices=True)]
    assert plan(controlled, 1e6, 5e6)["advice"] == "smaller model"  # the control decides first
    tool = _plan_tool()
    _study(tmp_path, [_row("p1", 1e6, 0.03, 0.4), _row("p2", 1e6, 0.3, 0.3, stacking=0.35), _row("p3", 1e6, 10.0, 0.2),
                      _row("p4", 1e6, 100.0, 0.1)])
    out = tmp_path / "planned.json"
    config = ROOT / "configs" / "gpt_tiny_cpu.json"
    assert tool.main(["--config", str(config), "--benchmarks", str(tmp_path), "--write", str(out)]) == 0
    said = capsys.readouterr().out
    assert "advice: growth: progressive stacking as published" in said and "saved 35.0%" in said
    grown = load_config(json.loads(out.read_text()))  # the advised growth, as the study ran it
    assert (grown.multilevel.cycle, grown.multilevel.depth_scaling) == ("grow", "ode")
    assert (grown.multilevel.optimizer_state, grown.multilevel.lr_schedule) == ("reset", "restart")
    assert grown.multilevel.levels[1].steps_before in (round(0.5 * 199), 100)  # half of S at half depth
    assert "written: " in said and "the advice above" not in said
    # a growth that is not a published form (stacking with the levers) is named, not written
    _study(tmp_path, [_row("p1", 1e6, 0.03, 0.4), _row("p2", 1e6, 0.3, 0.3), _row("p3", 1e6, 10.0, 0.2),
                      _row("p4", 1e6, 100.0, 0.1)])
    rows = json.loads((tmp_path / "regime.json").read_text())
    rows["points"][1]["methods"]["stacking-map-continue"] = {"family": "stacking", "equal_quality": {"median": 0.35},
                                                            "final_valid_loss": 1.98}
    (tmp_path / "regime.json").write_text(json.dumps(rows))
    assert tool.main(["--config", str(config), "--benchmarks", str(tmp_path), "--write", str(out)]) == 0
    said = capsys.readouterr().out
    assert "advice: growth: stacking-map-continue" in said and "the advice above is 'growth'" in said
    assert load_config(json.loads(out.read_text())).multilevel.cycle == "f"
    # --growth writes the growth asked for, whatever the advice; an unknown one is refused
    assert tool.main(["--config", str(config), "--benchmarks", str(tmp_path), "--write", str(out),
                      "--growth", "gstack"]) == 0
    assert "written: " in capsys.readouterr().out
    asked = load_config(json.loads(out.read_text())).multilevel
    assert (asked.cycle, asked.num_levels, asked.depth_scaling) == ("grow", 3, "none")  # a quarter depth, plain copies
    assert (asked.optimizer_state, asked.lr_schedule) == ("reset", "restart")
    # MSG with the recipe's levers, where it saved the most, is written as the study ran it
    rows["points"][1]["methods"]["msg"] = {"family": "msg", "equal_quality": {"median": 0.4}, "final_valid_loss": 1.97}
    (tmp_path / "regime.json").write_text(json.dumps(rows))
    assert tool.main(["--config", str(config), "--benchmarks", str(tmp_path), "--write", str(out)]) == 0
    said = capsys.readouterr().out
    assert "advice: growth: MSG with the recipe's levers" in said and "written: " in said
    masked = load_config(json.loads(out.read_text()))
    assert (masked.multilevel.cycle, masked.multilevel.depth_scaling) == ("grow", "none")  # plain copies
    assert masked.multilevel.growth_mask_steps == 10  # masked in over 5% of the 199 steps from scratch
    assert (masked.multilevel.optimizer_state, masked.multilevel.lr_schedule) == ("map", "continue")
    assert masked.multilevel.levels[1].steps_before in (19, 20)  # a tenth at half depth
    assert masked.multilevel.levels[0].lr_after.warmup_steps == 0  # no second warm-up
    for argv in (["--growth", "ligo", "--write", str(out)], ["--growth", "gstack"]):
        with pytest.raises(SystemExit):
            tool.main(["--config", str(config), "--benchmarks", str(tmp_path), *argv])
        assert "--growth" in capsys.readouterr().err


def test_a_growth_a_later_pin_measured_counts_at_the_same_shape_and_budget(tmp_path, capsys):
    """A shape and budget measured again by a later pin for a growth the first pin predates
    (regime3.json: G_stack alone beside scratch) lends that growth to the first pin's point: where it
    saved more than the first point's growths and cycles, it is the advice there."""
    tool = _plan_tool()
    rows = [_row("p1", 1e5, 0.03, 0.4), _row("p2", 1e5, 0.3, 0.3), _row("p3", 1e5, 10.0, 0.2),
            _row("long-4x64-100", 1e5, 100.0, 0.1, stacking=0.15)]
    _study(tmp_path, rows)
    at = ["--params", "1e5", "--tokens", "1e7", "--benchmarks", str(tmp_path), "--bar", "0"]  # 100 tokens per parameter
    assert tool.main(at) == 0
    assert "advice: growth: progressive stacking as published" in capsys.readouterr().out
    later = {"point": "long3-4x64-100", "shape": "4x64", "parameters": 1e5, "tokens_per_parameter": 100.0,
             "scratch_final_loss": 2.0,
             "methods": {"gstack": {"family": "gstack", "equal_quality": {"median": 0.25}, "final_valid_loss": 1.98}}}
    (tmp_path / "regime3.json").write_text(json.dumps({"commit": "b" * 40, "points": [later], "leads": []}))
    assert tool.main(at) == 0
    said = capsys.readouterr().out
    # named with the point whose runs measured it, not the nearest point it is counted at
    assert "advice: growth: G_stack as published" in said and "at long3-4x64-100 it saved 25.0%" in said
    later["methods"]["gstack"]["equal_quality"]["median"] = 0.12  # behind stacking: stacking stays the advice
    (tmp_path / "regime3.json").write_text(json.dumps({"commit": "b" * 40, "points": [later], "leads": []}))
    assert tool.main(at) == 0
    said = capsys.readouterr().out
    assert "advice: growth: progressive stacking as published" in said and "at long-4x64-100 it saved 15.0%" in said


def test_the_scale_studys_controls_are_read_from_their_own_points(tmp_path, capsys):
    """A control run later at a scale-study point (benchmarks/ctl-*, controls.json) counts for the
    scale point of the same shape and budget: the smaller model is then the advice at that budget."""
    tool = _plan_tool()
    rows = [{**_row(f"cpu-4x64-{steps}", 1e5, tpp, saving), "steps": steps}
            for steps, tpp, saving in ((100, 0.1, 0.4), (1000, 1.0, 0.3), (10000, 10.0, 0.2), (100000, 100.0, 0.1))]
    for r in rows:
        r["methods"].pop("coarse")  # the scale study ran no control
    (tmp_path / "study.json").write_text(json.dumps({"commit": "a" * 40, "points": rows}))
    assert tool.main(["--params", "1e5", "--tokens", "5e5", "--benchmarks", str(tmp_path), "--json"]) == 0
    control = {"point": "ctl-4x64-10000", "shape": "4x64", "steps": 10000, "parameters": 1e5,
               "tokens_per_parameter": 10.0,
               "methods": {"coarse": {"family": "coarse", "equal_quality": {"median": None},
                                      "smaller_model_suffices": [1, 2]},
                           "coarse-lr2": {"family": "coarse", "equal_quality": {"median": None},
                                          "smaller_model_suffices": [0, 2]}}}
    (tmp_path / "controls.json").write_text(json.dumps({"commit": "b" * 40, "points": [control]}))
    points = tool.read_points(str(tmp_path))
    assert [p.smaller_model_suffices for p in points] == [None, None, True, None]  # one seed of two suffices
    assert [p.control_seeds for p in points] == [None, None, (1, 2), None]  # its best rate's seeds
    from megatron_multilevel.study.planner import plan

    assert plan(points, 1e5, 5e5)["advice"] == "smaller model"  # 5 tokens per parameter, under 10
    assert plan(points, 1e5, 5e6, bar=0.0)["advice"] == "multilevel"  # 50: beyond the control
    capsys.readouterr()
    assert tool.main(["--params", "1e5", "--tokens", "5e5", "--benchmarks", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "advice: train the smaller (half-depth) model alone: at cpu-4x64-10000," in said
    assert "(in 1 of its 2 seeds)" in said  # how strong the control's verdict is


def _plan_tool():
    return load_tool("plan_schedule")


def test_a_bert_config_is_refused_with_what_was_measured_on_bert():
    """The law is GPT's: a BERT config gets one line saying so and where BERT's measurements are."""
    tool = _plan_tool()
    with pytest.raises(SystemExit, match=r"bert model; the law is fitted to GPT only .*benchmarks/JOURNAL.md, 'BERT'"):
        tool.main(["--config", str(ROOT / "configs" / "bert_base.json")])


def test_the_late_expansion_is_reported_where_it_was_measured_and_not_advised_without_a_saving(capsys):
    """The late expansion's verdict comes from the measured point nearest in depth (then in size and
    budget); without a saving there it is not advised, and the advice stays the law's; a depth
    beyond the law's points is said to be an extrapolation."""
    from megatron_multilevel.study.savings import best_late

    row = {"scratch_final_loss": 1.5, "methods": {
        "late": {"family": "late", "final_valid_loss": 1.9, "equal_quality": {"median": None}},
        "late-tau0.5": {"family": "late", "final_valid_loss": 1.6, "equal_quality": {"median": None}},
        "msg": {"family": "msg", "final_valid_loss": 1.4, "equal_quality": {"median": 0.2}}}}
    assert best_late(row) == {"method": "late-tau0.5", "above_scratch": pytest.approx(0.1), "saving": None}
    assert best_late({"scratch_final_loss": 1.5, "methods": {}}) is None
    law = [point("a", 1e6, 0.1, 0.40), point("b", 1e6, 1.0, 0.30), point("c", 1e6, 10.0, 0.20)]
    deep16 = dataclasses.replace(point("d16", 2e5, 80.0, None), shape="16x32",
                                 late={"method": "late-tau0.5", "above_scratch": 0.112, "saving": None})
    deep8 = dataclasses.replace(point("d8", 1e6, 5.0, None), shape="8x32",
                                late={"method": "late", "above_scratch": 0.05, "saving": 0.3})
    result = plan(law + [deep16, deep8], 1e6, 5e6, layers=24, bar=0.0)
    assert result["late"]["point"] == "d16" and result["late"]["saving"] is None
    assert result["advice"] == "multilevel"
    assert result["layers_range"] == [4, 4] and result["beyond"]["layers"] == 6.0
    assert plan(law + [deep16, deep8], 1e6, 5e6, layers=8)["late"]["point"] == "d8"
    assert plan(law + [deep16, deep8], 1e6, 5e6)["late"]["point"] == "d8"  # no depth: nearest in size and budget
    said = load_tool("plan_schedule").describe(result)
    assert "its best run (late-tau0.5) ended 0.112 above the best-tuned scratch's final loss" in said
    assert "not advised" in said and "depth beyond the law's points: 24 layers, its points 4 to 4 layers" in said
    with pytest.raises(ValueError, match="layers"):
        plan(law, 1e6, 5e6, layers=0)


def test_a_growth_is_advised_only_where_it_held_at_the_models_depth_on_every_corpus(tmp_path, capsys):
    """A growth that saved 30% at the nearest 4-layer point is the advice at 4 layers; at 16 layers,
    where it saved 30% on one corpus and did not reach scratch on another, the weakest measurement
    (nothing saved) is under the bar and scratch is the advice, the growth its candidate; a run under
    scratch at its full budget with no shorter budget is not a measurement and does not count."""
    from megatron_multilevel.study.savings import growth_verdict

    deep = {"scratch_final_loss": 1.5, "methods": {
        "msg": {"family": "msg", "final_valid_loss": 1.51, "equal_quality": {"median": None}},
        "msg-lr2": {"family": "msg", "final_valid_loss": 1.52, "equal_quality": {"median": None}},
        "late": {"family": "late", "final_valid_loss": 1.4, "equal_quality": {"median": 0.5}}}}
    # the late expansion is its own verdict; of growths that saved nothing, the lowest final loss
    assert growth_verdict(deep) == {"method": "msg", "saving": None, "above_scratch": pytest.approx(0.01)}
    assert growth_verdict({"scratch_final_loss": 1.5, "methods": {}}) is None
    law = [point("a", 1e6, 0.1, 0.40), point("b", 1e6, 1.0, 0.30), point("d", 1e6, 100.0, 0.10)]
    ahead = dataclasses.replace(point("c", 1e6, 10.0, 0.20), growth=("msg", 0.30))

    def at16(name, corpus, saving, above):
        return dataclasses.replace(point(name, 2e5, 80.0, None), shape="16x32", corpus=corpus,
                                   growth_run={"method": "msg", "saving": saving, "above_scratch": above})

    held, failed = at16("one", None, 0.30, -0.02), at16("two", "prose", None, 0.01)
    points = law + [ahead, held, failed]
    assert plan(points, 1e6, 5e6, layers=4)["advice"] == "growth"  # the 4-layer point is the nearest depth
    assert plan(points, 1e6, 5e6)["advice"] == "growth"  # no depth given: nothing to weigh at depth
    deep16 = plan(points, 1e6, 5e6, layers=16)
    assert deep16["advice"] == "scratch" and deep16["candidate"] == {"advice": "growth", "saving": 0.0}
    assert [v["point"] for v in deep16["at_depth"]] == ["one", "two"]
    assert plan(points, 1e6, 5e6, layers=16, bar=0.0)["advice"] == "growth"
    unmeasured = at16("two", "prose", None, -0.01)  # ahead on its FLOPs, no fraction run: not counted
    assert plan(law + [ahead, held, unmeasured], 1e6, 5e6, layers=16)["advice"] == "growth"
    said = load_tool("plan_schedule").describe(deep16)
    assert "growth at 16 layers, on prose: msg ended 0.010 above the best-tuned scratch's final loss" in said
    assert "advice: train the full model from scratch: the best candidate (growth, below)" in said
    assert "under the 25% this planner asks" in said and "candidate: growth: MSG with the recipe's levers" in said
    # the tool reads a second corpus's study (docs.json) under its corpus's name
    _study(tmp_path, [_row("p1", 1e5, 0.03, 0.4), _row("p2", 1e5, 0.3, 0.3), _row("p3", 1e5, 10.0, 0.2),
                      _row("p4", 1e5, 100.0, 0.1)])
    (tmp_path / "docs.json").write_text(json.dumps({"commit": "c" * 40, "points": [
        {"point": "docs-16x32-100", "shape": "16x32", "parameters": 2e5, "tokens_per_parameter": 80.0, **deep}]}))
    read = {p.point: p for p in load_tool("plan_schedule").read_points(str(tmp_path))}
    assert read["docs-16x32-100"].corpus == "Python 3.11's documentation"
    assert read["docs-16x32-100"].growth_run["above_scratch"] == pytest.approx(0.01)
    assert read["p1"].corpus is None


def test_no_advice_beyond_the_measured_sizes():
    """A control that found the half-depth model sufficient at 20 tokens per parameter on a 237k
    model says nothing of a 1.3B one: beyond twice the largest measured size (or half the smallest)
    the planner advises nothing, says what was measured and what published laws say, and returns
    what its points' rule would have said as extrapolated."""
    points = [point("a", 1e5, 0.1, 0.40), point("b", 1e6, 1.0, 0.30), point("c", 1e5, 10.0, 0.20),
              point("d", 1e6, 100.0, 0.10), point("ctl", 2.4e5, 20.3, None, suffices=True)]
    points = [dataclasses.replace(p, seeds=s) for p, s in zip(points, (1, 2, 3, 2, 1))]
    far = plan(points, 1.3e9, 26e9)
    assert (far["advice"], far["candidate"], far["within_measured_sizes"]) == (None, None, False)
    assert far["extrapolated_advice"] == "smaller model"  # the 237k control's verdict, not the advice
    assert far["measured"] == {"points": 5, "parameters": [1e5, 1e6], "tokens_per_parameter": [0.1, 100.0],
                               "seeds": [1, 3], "size_margin": 2.0}
    assert far["published"]["regime"] == "near compute-optimal"
    assert plan(points, 1e6, 1e6)["advice"] == "smaller model"  # at a measured size the control decides
    # the margin: up to twice the largest, down to half the smallest
    assert plan(points, 2e6, 2e6)["advice"] == "smaller model" and plan(points, 2.1e6, 2.1e6)["advice"] is None
    assert plan(points, 5e4, 5e4)["advice"] == "smaller model" and plan(points, 4.9e4, 4.9e4)["advice"] is None


@pytest.mark.parametrize("tpp, regime", [(20, "near compute-optimal"), (10, "near compute-optimal"),
                                         (40, "near compute-optimal"), (2, "larger than compute-optimal"),
                                         (9.9, "larger than compute-optimal"), (200, "past compute-optimal")])
def test_the_published_regime_is_chinchillas(tpp, regime):
    from megatron_multilevel.study.planner import published_regime

    said = published_regime(1.3e9, 1.3e9 * tpp)
    assert said["regime"] == regime
    # the same training FLOPs (6 N D) on a model trained at 20 tokens per parameter
    optimal = said["compute_optimal_parameters"]
    assert 6 * optimal * said["compute_optimal_tokens"] == pytest.approx(6 * 1.3e9 * 1.3e9 * tpp)
    assert said["compute_optimal_tokens"] == pytest.approx(20 * optimal)
