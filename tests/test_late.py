"""The late single expansion (Bu, ICML 2026): fresh layers as Megatron-Core initialises them, the
configs the study runs, and a run that grows a one-layer model to full depth under a
warmup-stable-decay schedule: function-preserving where its initialisation says so, new layers
and their moments as configured (read straight from DeepSpeed's checkpoint files), resumable, and
the same in other layouts."""

import json

import pytest
import torch

from conftest import random_state_dict, small_config
from launch_helpers import KEEP_ALL, SAME_RUN, assert_close_to_reference, launch, ok, records, run_config
from megatron_multilevel.config import load_config
from megatron_multilevel.growth.fresh import fresh_layer
from megatron_multilevel.plan import layer_prefix
from megatron_multilevel.study.late import doublings, late_configs, with_schedule


def _layer(cfg, state: dict, layer: int) -> dict:
    prefix = layer_prefix(cfg, layer)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and "_extra_state" not in k}


@pytest.mark.usefixtures("dist_single")
@pytest.mark.parametrize("variant", ["gpt_tied", "gpt_llama", "bert_tied"])
def test_fresh_layer_by_hand(variant):
    """Noise of 2 everywhere: every weight 2 x init_method_std (0.04), the residual outputs
    2 x 0.02 / sqrt(2 x 4 layers) = 0.0141421 (or 0 with zero_residual), biases 0, norm weights 1."""
    cfg = small_config(variant)
    template = _layer(cfg, random_state_dict(cfg, seed=1), 2)
    for zero in (False, True):
        layer = fresh_layer(template, cfg, lambda name, shape: torch.full(tuple(shape), 2.0), zero_residual=zero)
        assert set(layer) == set(template)
        for name, t in layer.items():
            assert t.shape == template[name].shape and t.dtype == template[name].dtype, name
            if "norm" in name:
                assert torch.all(t == (1.0 if name.endswith("weight") else 0.0)), name
            elif name.endswith("bias"):
                assert torch.all(t == 0.0), name
            elif "linear_proj" in name or "linear_fc2" in name:
                assert torch.allclose(t, torch.full_like(t, 0.0 if zero else 0.0141421), atol=1e-7), name
            else:
                assert torch.allclose(t, torch.full_like(t, 0.04)), name


@pytest.mark.usefixtures("dist_single")
def test_fresh_layer_matches_a_fresh_megatron_layer():
    """With standard normal noise, each weight's spread is that of the same weight of a model that
    Megatron-Core initialises itself (a 16-layer model, whose residual outputs are 0.02 / sqrt(32))."""
    from megatron_multilevel.models import build_model

    cfg = small_config("gpt_tied", num_layers=16, hidden_size=128)
    torch.manual_seed(0)
    megatron = _layer(cfg, build_model(cfg).state_dict(), 9)
    gen = torch.Generator().manual_seed(3)
    ours = fresh_layer(megatron, cfg, lambda name, shape: torch.randn(tuple(shape), generator=gen),
                       zero_residual=False)
    for name, t in ours.items():
        if t.numel() > 1000:
            assert t.std().item() == pytest.approx(megatron[name].std().item(), rel=0.1), name
            assert t.mean().abs().item() < 0.1 * t.std().item(), name
        else:
            assert torch.equal(t, megatron[name]), name  # norms and biases: constants


def _scratch(layers: int = 16, steps: int = 1000) -> dict:
    return {"model": {"kind": "gpt", "num_layers": layers, "hidden_size": 32, "num_attention_heads": 4,
                      "vocab_size": 512, "max_sequence_length": 64},
            "data": {"seq_length": 64}, "train_batch_size": 16,
            "optimizer": {"type": "AdamW", "params": {"lr": 4e-3}},
            "training": {"train_steps": steps, "lr": {"peak": 4e-3, "warmup_steps": 40, "decay": "1-sqrt",
                                                      "decay_fraction": 0.2, "min_ratio": 0.0}},
            "multilevel": {"enabled": False}}


def test_late_configs_expand_once_through_levels_that_train_no_step():
    """16 layers from 1: four doublings, five levels, only the first (1 layer, 800 steps = 0.8 x
    1000) and the last (16 layers, the other 200) train; every schedule scratch's WSD shape; the
    source control is the 1-layer model on scratch's 1000 steps."""
    made = late_configs(_scratch(), steps=1000, fine_lr=4e-3, warmup=40, share=0.8, layers=1, init="random-identity")
    cfg = load_config(made["late"])
    assert [m.num_layers for m in cfg.level_models()] == [16, 8, 4, 2, 1]
    phases = cfg.multilevel.phase_specs()
    assert [(p.level, p.steps) for p in phases] == [(4, 800), (3, 0), (2, 0), (1, 0), (0, 200)]
    assert all((p.lr.decay, p.lr.decay_fraction, p.lr.min_ratio) == ("1-sqrt", 0.2, 0.0) for p in phases)
    ml = cfg.multilevel
    assert (ml.growth_operator, ml.depth_scaling, ml.grown_moments, ml.lr_schedule) == (
        "random", "identity", "zero", "continue")
    source = load_config(made["source"])
    assert (source.model.num_layers, source.training.train_steps, source.training.lr.decay) == (1, 1000, "1-sqrt")
    # on a FLOPs budget the cheap steps buy more: 1000 / (0.8 r + 0.2) steps in all
    flops = load_config(late_configs(_scratch(), steps=1000, fine_lr=4e-3, warmup=40, budget="flops")["late"])
    small, full = (p.steps for p in (flops.multilevel.phase_specs()[0], flops.multilevel.phase_specs()[-1]))
    assert small > 800 and small / (small + full) == pytest.approx(0.8, abs=1e-3)
    assert small * flops.level_models()[-1].num_layers < 1000 * 16  # (a sanity bound: fewer layer-steps)
    # the copies as Euler steps: halved at each of the four doublings
    ode = load_config(late_configs(_scratch(), steps=1000, fine_lr=4e-3, warmup=40, init="copy-ode")["late"])
    assert (ode.multilevel.growth_operator, ode.multilevel.depth_scaling) == ("copy", "ode")


def test_late_configs_errors():
    assert doublings(16, 2) == 3 and doublings(12, 3) == 2
    with pytest.raises(ValueError, match=r"one of \[6, 3\] layers"):
        doublings(12, 1)
    with pytest.raises(ValueError, match="late_share"):
        late_configs(_scratch(), steps=1000, fine_lr=4e-3, warmup=40, share=1.0)
    with pytest.raises(ValueError, match="late_init"):
        late_configs(_scratch(), steps=1000, fine_lr=4e-3, warmup=40, init="zeros")


def test_with_schedule_changes_every_schedule_and_only_growths_moments():
    made = late_configs(_scratch(), steps=1000, fine_lr=4e-3, warmup=40, optimizer_state="reset")["late"]
    assert "grown_moments" not in made["multilevel"]
    out = with_schedule(made, decay="linear", decay_fraction=0.5, grown_moments="zero")
    assert all(lr["decay"] == "linear" and lr["decay_fraction"] == 0.5
               for level in out["multilevel"]["levels"] for lr in (level.get("lr_before"), level.get("lr_after")) if lr)
    assert "grown_moments" not in out["multilevel"]  # optimizer_state reset: nothing carried to set
    with pytest.raises(ValueError, match="valid choices"):
        with_schedule(made, decay="step")


WSD = {"peak": 2e-3, "decay": "1-sqrt", "decay_fraction": 0.5, "min_ratio": 0.0}
# 4 layers from 1 (two doublings): 8 steps of the 1-layer model, the 2-layer level trains none, 6 of
# the full model; fresh layers with zero residual outputs (function-preserving), their moments zero
LATE = {"enabled": True, "cycle": "grow", "num_levels": 3, "alpha": 1.0, "coalesce_width": False,
        "coalesce_depth": True, "depth_pairing": "halves", "depth_scaling": "identity", "growth_operator": "random",
        "optimizer_state": "map", "grown_moments": "zero", "lr_schedule": "continue",
        "levels": [{"steps_before": 0, "steps_after": 6, "lr_after": WSD}, {"steps_before": 0, "lr_before": WSD},
                   {"steps_before": 8, "lr_before": {**WSD, "warmup_steps": 2}}]}


@pytest.fixture(scope="module")
def late_run(tmp_path_factory, corpus):
    """An uninterrupted one-process late expansion."""
    tmp = tmp_path_factory.mktemp("late")
    out = ok(launch(run_config(tmp, corpus, "run", multilevel=LATE, training=KEEP_ALL))).stdout
    return {"dir": tmp / "run", "stdout": out}


def _checkpoint(run_dir, tag: str) -> dict:
    """The module and Adam's first moments of a one-process ZeRO-0 checkpoint, by parameter name,
    read straight from DeepSpeed's file (the optimizer's groups: decayed weights, then biases and
    norms, each in the module's order)."""
    (path,) = (run_dir / "checkpoints" / tag).glob("mp_rank_00_model_states.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    names = [k for k in saved["module"] if not k.endswith("_extra_state")]
    order = [n for n in names if not (n.endswith("bias") or "norm" in n)]
    order += [n for n in names if n.endswith("bias") or "norm" in n]
    state = saved["optimizer"]["state"]
    return {"module": {n: saved["module"][n].float() for n in names},
            "exp_avg": {n: state[i]["exp_avg"] for i, n in enumerate(order) if i in state}}


def test_a_late_expansion_preserves_the_function_and_starts_new_layers_afresh(late_run):
    """The 1-layer model's final validation loss is the loss of the 2- and 4-layer models it grows
    into (zero residual outputs); right after the first growth, layer 0 is the trained layer with its
    moments, layer 1 is fresh (zero residual outputs, unit norms, weights of spread about 0.02 unlike
    layer 0's) with zero moments; the full model then trains the loss down."""
    summary = json.loads((late_run["dir"] / "summary.json").read_text())
    assert [(p["level"], p["steps"]) for p in summary["phases"]] == [(2, 8), (1, 0), (0, 6)]
    assert "new layers fresh, their moments zero" in late_run["stdout"], late_run["stdout"][-3000:]
    at_growth = [r["loss"] for r in records(late_run["dir"], "valid") if r["global_step"] == 8]
    assert len(at_growth) >= 3 and max(at_growth) - min(at_growth) < 1e-5, at_growth
    train = records(late_run["dir"], "train")
    assert train[-1]["loss"] < train[0]["loss"]
    assert train[-1]["lr"] < 0.3 * WSD["peak"]  # the 1-sqrt cooldown, to 0 at the end

    from megatron_multilevel.config import ModelConfig

    one, two = (ModelConfig(kind="gpt", num_layers=n, hidden_size=64, num_attention_heads=4, vocab_size=512,
                            max_sequence_length=32) for n in (1, 2))
    before, after = _checkpoint(late_run["dir"], "phase00-step0000008"), _checkpoint(late_run["dir"],
                                                                                     "phase01-step0000000")
    trained, kept, new = (_layer(c, s["module"], i) for c, s, i in ((one, before, 0), (two, after, 0),
                                                                     (two, after, 1)))
    moments = {k: (_layer(one, before["exp_avg"], 0) if k == "trained" else _layer(two, after["exp_avg"], i))
               for k, i in (("trained", 0), ("kept", 0), ("new", 1))}
    for name, t in trained.items():
        assert torch.equal(kept[name], t), name
        assert torch.equal(moments["kept"][name], moments["trained"][name]), name
        assert moments["trained"][name].abs().max() > 0, name
        assert torch.all(moments["new"][name] == 0), name
        if "norm" in name:
            assert torch.all(new[name] == (1.0 if name.endswith("weight") else 0.0)), name
        elif "linear_proj" in name or "linear_fc2" in name:
            assert torch.all(new[name] == 0), name
        elif name.endswith("weight"):
            assert new[name].std().item() == pytest.approx(0.02, rel=0.2), name
            assert not torch.allclose(new[name], t), name


def test_a_late_expansion_resumes_after_a_kill_in_its_growth(late_run, corpus, tmp_path):
    """Killed in the last growth (into the full model): resumed, it follows the uninterrupted run."""
    killed = run_config(tmp_path, corpus, "killed", multilevel=LATE, training=KEEP_ALL)
    assert launch(killed, env={"MEGATRON_MULTILEVEL_CRASH_AT": "transition2"}).returncode != 0
    ok(launch(killed))
    assert_close_to_reference(tmp_path / "killed", late_run, **SAME_RUN)


def _zero3_after_growth() -> dict:
    """The 1-layer model at DP=2 under ZeRO-2, the models it grows into at DP=2 under ZeRO-3. (A
    level that starts a run under ZeRO-3 is built inside ``deepspeed.zero.Init``, which draws its
    weights anew: it would not start from the one-process run's weights.)"""
    levels = json.loads(json.dumps(LATE["levels"]))
    for i, stage in ((0, 3), (1, 3), (2, 2)):
        levels[i].update(tensor_model_parallel_size=1, deepspeed={"zero_optimization": {"stage": stage}})
    return {**LATE, "levels": levels}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"multilevel": LATE, "parallel": {"tensor_model_parallel_size": 2}},
                                    {"multilevel": _zero3_after_growth()}], ids=["tp2", "dp2-zero3"])
def test_a_late_expansion_in_two_layouts_is_the_one_process_run(late_run, corpus, tmp_path, layout):
    """The fresh layers' noise is drawn for each full tensor and cut to what a rank holds: at TP 2,
    and over two data-parallel ranks whose grown models are partitioned by ZeRO-3, the run trains
    the one-process run's model."""
    from megatron_multilevel.checkpoints.convert import load_source

    config = run_config(tmp_path, corpus, "run", training=KEEP_ALL, **layout)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", late_run, abs=2e-4)
    # the 2-layer model just grown, merged from the ranks' files: the one-process run's
    ours, ref = (load_source(str(d / "checkpoints" / "phase01-step0000000")).tensors
                 for d in (tmp_path / "run", late_run["dir"]))
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.allclose(ours[name].float(), t.float(), atol=1e-5), name


@pytest.mark.slow
def test_a_late_expansion_resumes_after_a_kill_mid_phase(late_run, corpus, tmp_path):
    killed = run_config(tmp_path, corpus, "killed", multilevel=LATE, training=KEEP_ALL)
    assert launch(killed, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step11"}).returncode != 0
    ok(launch(killed))
    assert_close_to_reference(tmp_path / "killed", late_run, **SAME_RUN)



@pytest.mark.parametrize("lr_schedule", ["restart", "continue"])
def test_with_schedule_gives_the_ode_strategy_the_runs_decay(lr_schedule):
    """The ODE strategy under a warmup-stable-decay schedule: whether each phase has its own schedule
    (the cycles at constant rates) or one runs over all, the rate at every global step is scratch's
    (its warm-up once, the peak until the last 20% of the steps, then 1-sqrt to 0)."""
    from megatron_multilevel.config import LRConfig, load_config
    from megatron_multilevel.study.variants import variant_configs
    from megatron_multilevel.training.schedule import build_phases, lr_factor

    base = _scratch()
    made = variant_configs(base, steps=1000, fine_lr=2e-3, ea=0.1, methods=["ode2"], lr_schedule=lr_schedule,
                           warmup=40)["ode2"]
    out = with_schedule(made, decay="1-sqrt", decay_fraction=0.2, min_ratio=0.0)
    phases = build_phases(load_config(out))
    factors = [p.lr.peak / 2e-3 * p.lr_factor(step) for p in phases for step in range(p.steps)]
    total = len(factors)
    wsd = LRConfig(peak=2e-3, warmup_steps=40, decay="1-sqrt", decay_fraction=0.2, min_ratio=0.0)
    expected = [lr_factor(step, total, wsd) for step in range(total)]
    assert factors == pytest.approx(expected, abs=1e-12)
    # one warm-up, at the start (as scratch's), then the peak until the decay
    assert factors[:40] == pytest.approx([(s + 1) / 40 for s in range(40)])
    assert factors[40: int(0.8 * total) - 1] == [1.0] * (int(0.8 * total) - 41) and factors[-1] < 0.05


def test_a_growth_inside_the_decay_is_refused_unless_asked_for():
    """One schedule over the run (WSD, the last 20% decaying): the one-layer model for 70% of the
    steps grows before the decay starts; for 90%, after it, refused in one line naming the key."""
    from megatron_multilevel.config import load_config

    def config(share: float, **extra) -> dict:
        lr = {"peak": 4e-3, "warmup_steps": 10, "decay": "1-sqrt", "decay_fraction": 0.2, "min_ratio": 0.0}
        small, total = round(100 * share), 100
        return {"train_batch_size": 8, "data": {"seq_length": 32},
                "model": {"kind": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                          "vocab_size": 64, "max_sequence_length": 32},
                "multilevel": {"enabled": True, "cycle": "grow", "num_levels": 2, "alpha": 1.0,
                               "coalesce_width": False, "coalesce_depth": True, "depth_pairing": "halves",
                               "lr_schedule": "continue", **extra,
                               "levels": [{"steps_after": total - small, "lr_after": lr},
                                          {"steps_before": small, "lr_before": lr}]}}

    load_config(config(0.7))
    load_config(config(0.82))  # step 82 of 100: the decay starts at step 82 (10 + 90 - 18)
    with pytest.raises(ValueError, match=r"grown at step 83 of 100, after the decay .*\(step 82.*growth_in_decay") as e:
        load_config(config(0.83))
    assert "\n" not in str(e.value)
    assert load_config(config(0.9, growth_in_decay=True)).multilevel.growth_in_decay


def test_fresh_layers_are_initialised_for_the_model_the_growth_ends_in(corpus, tmp_path):
    """1 -> 2 -> 4 layers through a level that trains no step, fresh layers with their residual
    outputs drawn: the layer added at the 2-layer step has its output projections' spread
    ``0.02 / sqrt(2 * 4)`` (Megatron-Core's for the 4 layers the growth ends in), not the
    intermediate depth's ``0.02 / sqrt(2 * 2)``; its other weights ``0.02``."""
    import math

    random = {**LATE, "depth_scaling": "none"}
    ok(launch(run_config(tmp_path, corpus, "run", multilevel=random, training=KEEP_ALL)))
    from megatron_multilevel.config import ModelConfig

    two = ModelConfig(kind="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512,
                      max_sequence_length=32)
    # the 2-layer level (no step of its own): layer 0 trained, layer 1 fresh, initialised for 4 layers
    fresh = _layer(two, _checkpoint(tmp_path / "run", "phase01-step0000000")["module"], 1)
    for name in ("mlp.linear_fc2.weight", "self_attention.linear_proj.weight"):
        assert fresh[name].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05), name
    assert fresh["mlp.linear_fc1.weight"].std().item() == pytest.approx(0.02, rel=0.05)


def test_bus_recipe_as_published():
    """``bu``: Muon (its auxiliary Adam at its own rate), weight decay 0.01, no clipping, a 2%
    warm-up and a decay over the last 10% of the steps to 0, the one-layer source expanded at tau
    with the same rate after it, the new layers' state zero; its scratch on the same optimizer and
    schedule. A tau whose expansion falls in the decay, and an init the paper rejects, are refused."""
    from megatron_multilevel.config import load_config
    from megatron_multilevel.study.late import bu_configs

    made = bu_configs(_scratch(steps=1000), steps=1000, lr=0.02, adam_lr=0.004, share=0.9, init="random")
    for name in ("bu", "scratch"):
        cfg = load_config(made[name])
        assert made[name]["optimizer"]["type"] == "Muon" and made[name]["gradient_clipping"] == 0.0
        params = made[name]["optimizer"]["params"]
        assert (params["lr"], params["adam_lr"], params["weight_decay"]) == (0.02, 0.004, 0.01)
    run = load_config(made["scratch"]).training.lr
    assert run.warmup_steps == 20 and round(run.decay_fraction * (1000 - 20)) == 100 and run.min_ratio == 0.0
    ml = load_config(made["bu"]).multilevel
    specs = [(s.level, s.steps) for s in ml.phase_specs()]
    assert specs[0] == (4, 900) and specs[-1] == (0, 100) and sum(s for _, s in specs) == 1000
    assert (ml.growth_operator, ml.grown_moments, ml.optimizer_state, ml.lr_schedule) == ("random", "zero", "map",
                                                                                        "continue")
    assert ml.phase_specs()[-1].lr.warmup_steps == 0  # no second warm-up after the expansion
    with pytest.raises(ValueError, match="after the decay"):
        bu_configs(_scratch(steps=1000), steps=1000, lr=0.02, share=0.95)
    with pytest.raises(ValueError, match=r"valid choices are \['copy', 'random'\]"):
        bu_configs(_scratch(steps=1000), steps=1000, lr=0.02, init="identity")


@pytest.mark.parametrize("beta2, warned", [(0.999, True), (0.95, False)])
def test_zero_moments_under_a_slow_second_moment_are_said(beta2, warned):
    """The new layers' zero moments keep the run's step count: with betas[1] 0.999 Adam's updates of
    them are 3 to 6.5 times a fresh Adam's (said in one line), with 0.95 within 0.45 to 1.1."""
    import warnings

    from megatron_multilevel.config import load_config

    config = {"train_batch_size": 8, "data": {"seq_length": 32},
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, beta2]}},
              "model": {"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                        "vocab_size": 512, "max_sequence_length": 32}, "multilevel": {**LATE}}
    config["multilevel"]["levels"][0]["lr_after"] = {**WSD, "peak": 2e-3}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config)
    said = [str(w.message) for w in caught if "grown_moments 'zero'" in str(w.message)]
    assert bool(said) == warned, said
    # the factors the message states: (1 - b1^k) / sqrt(1 - b2^k) over the first hundred steps
    ratios = [(1 - 0.9 ** k) / (1 - beta2 ** k) ** 0.5 for k in range(1, 101)]
    assert (min(ratios), max(ratios)) == ((pytest.approx(0.447, abs=0.01), pytest.approx(1.1, abs=0.01))
                                          if not warned else (pytest.approx(3.16, abs=0.01), pytest.approx(6.53, abs=0.05)))
