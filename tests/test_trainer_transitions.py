"""The trainer's transitions against the offline operators, in real runs: one process, and two
ranks whose layout (tensor-parallel size, ZeRO stage) changes at every transition.

A 3-level V-cycle (levels 0 1 2 1 0) trains with a different ``alpha`` at each level (neither
0.5 nor the global value), Adam moments mapped (``optimizer_state: "map"``) and
``perturbation_std > 0``. At every transition the run's model and Adam state are taken just
before (the end of the phase) and just after (what the next phase starts training from), gathered
whole. The expected model after each transition is computed here from the model before it with
the offline operators (``operators.coalesce`` / ``decoalesce``) and the interpolation written out
by hand.
"""

import json

import pytest
import torch

from distributed_helpers import run_ranks
from launch_helpers import make_corpus, preprocess, small_config

ALPHAS = {0: 0.3, 1: 0.8}  # per level; the global alpha (0.5) must not be used
PERTURBATION_STD = 0.05
STEPS = 2


def _engine_state(engine) -> dict:
    """Full parameters, optimizer state (Adam's moments, SGD's momentum) and step counts of an engine
    in any layout, by parameter name,
    gathered with DeepSpeed's and torch.distributed's own calls (on rank 0; None elsewhere)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    opt = engine.optimizer
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    params, moments = {}, {"exp_avg": {}, "exp_avg_sq": {}, "momentum_buffer": {}}
    # ZeRO's reader raises for a key its optimizer does not keep: read only this optimizer's keys
    carried = ("momentum_buffer",) if isinstance(opt, torch.optim.SGD) else ("exp_avg", "exp_avg_sq")
    # ZeRO-1/2 link each parameter to its slice of the flat Adam state once, after the first step of
    # the first parameter group only; link all of them for reading here, then put back the links the
    # trainer had, so that reading in this test cannot hide a trainer that reads through stale links
    mapped = [p for p in engine.module.parameters() if getattr(p, "_hp_mapping", None) is not None]
    stale = {p: p._hp_mapping.optim_fragment for p in mapped}
    if mapped:
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for name, p in engine.module.named_parameters():
        values = {}
        if hasattr(p, "ds_id"):  # ZeRO-3
            with deepspeed.zero.GatheredParameters([p]):
                values[None] = p.data.float().clone()
        else:
            values[None] = p.data.float().clone()
        for key in carried:
            if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # ZeRO 1-3
                value = safe_get_full_optimizer_state(p, key)
            else:
                value = opt.state.get(p, {}).get(key)
            if value is not None:
                values[key] = value.float().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            assert not name.endswith("linear_fc1.weight") or not engine.module.config.gated_linear_unit
            for key, value in values.items():
                shards = [torch.empty_like(value) for _ in range(tp)]
                dist.all_gather(shards, value.contiguous(), group=ps.get_tensor_model_parallel_group())
                values[key] = torch.cat(shards, dim=p.partition_dim)
        params[name] = values.pop(None)
        for key, value in values.items():
            moments[key][name] = value
    for p, fragment in stale.items():
        p._hp_mapping.optim_fragment = fragment
    steps = {int(state["step"]) for state in opt.state.values() if "step" in state}
    return {"params": params, "moments": moments, "steps": steps} if dist.get_rank() == 0 else None


def _train_and_capture(rank, world_size, config: dict) -> list:
    from megatron_multilevel.config import load_config
    from megatron_multilevel.training import trainer

    captured = []
    transition = trainer.Trainer._transition

    def spy(self, phase, nxt, end_tag):
        before = _engine_state(self.engine)
        transition(self, phase, nxt, end_tag)
        captured.append({"from": phase.level, "to": nxt.level, "before": before, "after": _engine_state(self.engine)})

    trainer.Trainer._transition = spy
    try:
        trainer.Trainer(load_config(config)).run()
    finally:
        trainer.Trainer._transition = transition
    return captured


# Layouts per level: (tensor-parallel size, ZeRO stage); two ranks change layout at every transition.
LAYOUTS = {
    "one-process": (1, [(1, 0), (1, 0), (1, 0)]),
    # ZeRO-1 reads and writes moments through DeepSpeed's links to its flat state, which it makes
    # lazily for one parameter group only: TP=2 ZeRO-1, then DP=2 ZeRO-3, then DP=2 ZeRO-1
    "two-ranks-tp2-zero3-zero1": (2, [(2, 1), (1, 3), (1, 1)]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    assert preprocess(make_corpus(tmp / "text", documents=40), tmp / "gpt").returncode == 0
    return tmp


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, corpus, tmp_path_factory):
    world_size, layouts = LAYOUTS[request.param]
    return _run(corpus, tmp_path_factory.mktemp(request.param), world_size, layouts)


# The optimizer state each optimizer keeps, which ``optimizer_state: "map"`` carries.
STATE = {"AdamW": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}}


@pytest.fixture(scope="module", params=list(STATE))
def correction_run(request, corpus, tmp_path_factory):
    """One process, returns by the coarse correction instead of interpolation, no noise; AdamW's
    moments or SGD's momentum carried."""
    run = _run(corpus, tmp_path_factory.mktemp("correction"), 1, LAYOUTS["one-process"][1],
               optimizer=SGD if request.param == "SGD" else None, interpolation="correction", perturbation_std=0.0)
    return {**run, "state": STATE[request.param]}


def _run(corpus, tmp, world_size, layouts, optimizer=None, **multilevel):
    base = json.loads(small_config(tmp / "base.json", kind="gpt", prefix=str(corpus / "gpt"),
                                   tokenizer_model=str(corpus / "gpt.model"), output_dir=tmp / "run").read_text())
    if optimizer is not None:
        base["optimizer"] = optimizer
    lr = {"peak": 2e-3, "warmup_steps": 1}
    levels = [
        {"steps_before": STEPS, "steps_after": STEPS, "lr_before": lr, "alpha": ALPHAS[0]},
        {"steps_before": STEPS, "steps_after": STEPS, "lr_before": lr, "alpha": ALPHAS[1]},
        {"steps_before": STEPS, "lr_before": lr},
    ]
    for level, (tp, stage) in zip(levels, layouts):
        level.update(tensor_model_parallel_size=tp, deepspeed={"zero_optimization": {"stage": stage}})
    base["multilevel"] = {
        "enabled": True, "num_levels": 3, "alpha": 0.5, "width_pairing": "halves",
        "optimizer_state": "map", "perturbation_std": PERTURBATION_STD, "levels": levels, **multilevel,
    }
    base["training"].update(save_interval=0, eval_interval=100, eval_batches=1, log_interval=100)
    captured = run_ranks(_train_and_capture, world_size, tmp / "ranks", base)[0]
    from megatron_multilevel.config import load_config
    from megatron_multilevel.level_maps import run_level_maps

    return {"captured": captured, "level_maps": run_level_maps(load_config(base))}


@pytest.fixture(scope="module")
def aki_run(corpus, tmp_path_factory):
    """One process, a 2-level F-cycle (levels 1 0 1 0) that grows by AKI (``width_growth: "aki"``),
    Adam moments mapped, no noise."""
    tmp = tmp_path_factory.mktemp("aki")
    base = json.loads(small_config(tmp / "base.json", kind="gpt", prefix=str(corpus / "gpt"),
                                   tokenizer_model=str(corpus / "gpt.model"), output_dir=tmp / "run").read_text())
    lr = {"peak": 2e-3, "warmup_steps": 1}
    base["multilevel"] = {
        "enabled": True, "num_levels": 2, "cycle": "f", "alpha": ALPHAS[0], "width_pairing": "halves",
        "width_growth": "aki", "optimizer_state": "map",
        "levels": [{"steps_before": STEPS, "steps_after": STEPS, "lr_before": lr},
                   {"visits": [{"steps": STEPS, "lr": lr}, {"steps": STEPS, "lr": lr}]}],
    }
    base["training"].update(save_interval=0, eval_interval=100, eval_batches=1, log_interval=100)
    captured = run_ranks(_train_and_capture, 1, tmp / "ranks", base)[0]
    from megatron_multilevel.config import load_config
    from megatron_multilevel.level_maps import run_level_maps

    return {"captured": captured, "level_maps": run_level_maps(load_config(base))}


def _assert_dicts_close(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), (what, sorted(set(got) ^ set(expected)))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=f"{what}: {name}")


def _interpolated(before: dict, decoalesced: dict, alpha: float) -> dict:
    """``(1 - alpha) * before + alpha * decoalesced``, written out."""
    return {k: (1.0 - alpha) * before[k] + alpha * decoalesced[k] for k in before}


def test_the_walk(run):
    assert [(c["from"], c["to"]) for c in run["captured"]] == [(0, 1), (1, 2), (2, 1), (1, 0)]


def test_coalescing_maps_parameters_and_moments(run):
    from megatron_multilevel.operators import coalesce

    for i, c in enumerate(run["captured"][:2]):
        lm = run["level_maps"][c["from"]]
        _assert_dicts_close(c["after"]["params"], coalesce(c["before"]["params"], lm), f"coalesce {c['from']}")
        for key in ("exp_avg", "exp_avg_sq"):
            assert c["before"]["moments"][key], "the fine phase has Adam moments"
            _assert_dicts_close(c["after"]["moments"][key], coalesce(c["before"]["moments"][key], lm),
                                f"coalesced {key} {c['from']}")
        # bias correction continues from the steps the moments were built over: level 0's, then
        # level 0's and level 1's
        assert c["before"]["steps"] == c["after"]["steps"] == {STEPS * (i + 1)}


def test_decoalescing_interpolates_with_each_levels_alpha_and_perturbs(run):
    from megatron_multilevel.operators import decoalesce

    captured = run["captured"]
    for c in captured[2:]:
        fine = c["to"]
        alpha = ALPHAS[fine]
        lm = run["level_maps"][fine]
        # the fine model as it was when it was coalesced
        (before_coalescing,) = [x["before"] for x in captured if x["from"] == fine and x["to"] == fine + 1]
        expected = _interpolated(before_coalescing["params"], decoalesce(c["before"]["params"], lm), alpha)
        got = c["after"]["params"]
        assert got.keys() == expected.keys()
        # perturbation: seeded noise of PERTURBATION_STD times each tensor's own standard deviation
        ratios = []
        for name, value in expected.items():
            noise = got[name] - value
            if value.numel() < 2:
                continue
            scale = PERTURBATION_STD * value.std()
            assert noise.abs().max() < 6 * scale, (fine, name)  # no more than noise of that size
            if value.numel() >= 1000:
                ratios.append((name, (noise.std() / scale).item()))
        assert ratios and all(0.85 < r < 1.15 for _, r in ratios), (fine, ratios)
        # independent noise in the fine layers de-coalesced from one coarse layer
        name = "mlp.linear_fc1.weight"
        n0 = got[f"decoder.layers.0.{name}"] - expected[f"decoder.layers.0.{name}"]
        n1 = got[f"decoder.layers.1.{name}"] - expected[f"decoder.layers.1.{name}"]
        assert (n0 - n1).std() > n0.std(), fine  # sqrt(2) times for independent noise, 0 for the same
        # moments: interpolated the same way, with no noise
        for key in ("exp_avg", "exp_avg_sq"):
            want = _interpolated(before_coalescing["moments"][key], decoalesce(c["before"]["moments"][key], lm), alpha)
            _assert_dicts_close(c["after"]["moments"][key], want, f"de-coalesced {key} into level {fine}")


def test_decoalescing_adds_the_coarse_correction(correction_run):
    """``interpolation: "correction"``: each level returns to the model it was coalesced from plus
    its level's alpha times the coarse change, de-coalesced (the coarse model's start made again
    by coalescing that model), written out; the optimizer state is coalesced on the way down and
    interpolated on the way up as without it."""
    from megatron_multilevel.operators import coalesce, decoalesce

    captured = correction_run["captured"]
    assert [(c["from"], c["to"]) for c in captured] == [(0, 1), (1, 2), (2, 1), (1, 0)]
    state = correction_run["state"]
    for c in captured[:2]:
        lm = correction_run["level_maps"][c["from"]]
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            assert bool(c["before"]["moments"][key]) == (key in state), (key, state)
        for key in state:
            _assert_dicts_close(c["after"]["moments"][key], coalesce(c["before"]["moments"][key], lm),
                                f"coalesced {key} {c['from']}")
    for c in captured[2:]:
        fine, alpha = c["to"], ALPHAS[c["to"]]
        lm = correction_run["level_maps"][fine]
        (before_coalescing,) = [x["before"] for x in captured if x["from"] == fine and x["to"] == fine + 1]
        before = before_coalescing["params"]
        end, start = decoalesce(c["before"]["params"], lm), decoalesce(coalesce(before, lm), lm)
        expected = {k: before[k] + alpha * (end[k] - start[k]) for k in before}
        _assert_dicts_close(c["after"]["params"], expected, f"corrected level {fine}")
        blended = _interpolated(before, end, alpha)
        assert max((blended[k] - expected[k]).abs().max() for k in expected) > 1e-3  # not the blend
        for key in state:
            want = _interpolated(before_coalescing["moments"][key], decoalesce(c["before"]["moments"][key], lm), alpha)
            _assert_dicts_close(c["after"]["moments"][key], want, f"de-coalesced {key} into level {fine}")


def test_growth_by_aki_and_the_return_by_fpi(aki_run):
    """The F-cycle's growth is the operators' AKI of the small model, its moments grown the same way;
    the later return interpolates with the model kept, de-coalesced by FPI."""
    from megatron_multilevel.operators import decoalesce

    captured = aki_run["captured"]
    assert [(c["from"], c["to"]) for c in captured] == [(1, 0), (0, 1), (1, 0)]
    lm = aki_run["level_maps"][0]
    grow, down, back = captured
    small = grow["before"]
    _assert_dicts_close(grow["after"]["params"], decoalesce(small["params"], lm, width_growth="aki"), "grown")
    by_fpi = decoalesce(small["params"], lm)
    assert any(not torch.allclose(t, by_fpi[name]) for name, t in grow["after"]["params"].items())
    for key in ("exp_avg", "exp_avg_sq"):
        _assert_dicts_close(grow["after"]["moments"][key], decoalesce(small["moments"][key], lm, width_growth="aki"),
                            f"grown {key}")
    expected = _interpolated(down["before"]["params"], decoalesce(back["before"]["params"], lm), ALPHAS[0])
    _assert_dicts_close(back["after"]["params"], expected, "the return")
