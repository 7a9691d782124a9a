"""The phase lists of every cycle, the steps and schedule of each visit, and the learning rate."""

import dataclasses
import math

import pytest

from megatron_multilevel.config import LRConfig, load_config
from megatron_multilevel.training.schedule import build_phases, lr_factor


def _levels(num_levels: int) -> list[dict]:
    """Level ``i`` trains ``10 i + 1`` steps before coalescing and ``10 i + 2`` after, at peaks
    ``i + 0.1`` and ``i + 0.2``; the coarsest ``10 i + 1`` at ``i + 0.1``."""
    levels = [{"steps_before": 10 * i + 1, "lr_before": {"peak": i + 0.1},
               "steps_after": 10 * i + 2, "lr_after": {"peak": i + 0.2}} for i in range(num_levels)]
    levels[-1] = {"steps_before": levels[-1]["steps_before"], "lr_before": levels[-1]["lr_before"]}
    return levels


def _config(cycle: str, num_levels: int, levels: "list[dict] | None" = None, **multilevel):
    return load_config({
        "model": {"num_layers": 8},
        "multilevel": {"enabled": True, "cycle": cycle, "num_levels": num_levels,
                       "levels": levels or _levels(num_levels), **multilevel},
    })


def _phases(cycle: str, num_levels: int, levels: "list[dict] | None" = None, **multilevel) -> list[tuple]:
    return [(p.level, p.steps, p.name) for p in build_phases(_config(cycle, num_levels, levels, **multilevel))]


B0, A0, B1, A1, C1, C2 = (0, 1, "before"), (0, 2, "after"), (1, 11, "before"), (1, 12, "after"), \
    (1, 11, "coarsest"), (2, 21, "coarsest")


@pytest.mark.parametrize(
    "cycle, num_levels, expected",
    [
        ("v", 2, [B0, C1, A0]),
        ("v", 3, [B0, B1, C2, A1, A0]),
        ("w", 2, [B0, C1, B0, C1, A0]),
        ("w", 3, [B0, B1, C2, B1, C2, A1, B0, B1, C2, B1, C2, A1, A0]),
        ("f", 2, [C1, B0, C1, A0]),
        ("f", 3, [C2, B1, C2, A1, B0, B1, C2, A1, A0]),
    ],
)
def test_phase_lists(cycle, num_levels, expected):
    assert _phases(cycle, num_levels) == expected


def test_grow_phase_lists():
    levels = [{"steps_after": 2}, {"steps_after": 12}, {"steps_before": 21}]
    assert _phases("grow", 2, [levels[0], levels[2]], alpha=1.0) == [(1, 21, "coarsest"), (0, 2, "after")]
    assert _phases("grow", 3, levels, alpha=1.0) == [(2, 21, "coarsest"), (1, 12, "after"), (0, 2, "after")]
    assert [p.arrival for p in build_phases(_config("grow", 3, levels, alpha=1.0))] == ["fresh", "grow", "grow"]


def test_scratch_is_one_phase():
    cfg = load_config({"training": {"train_steps": 7, "lr": {"peak": 0.5}}})
    assert [(p.level, p.steps, p.name, p.lr.peak) for p in build_phases(cfg)] == [(0, 7, "scratch", 0.5)]


def test_visits_arrivals_and_schedules():
    """A visit that ends by coalescing, and the coarsest level, train ``steps_before`` at
    ``lr_before``; every other visit ``steps_after`` at ``lr_after``."""
    phases = build_phases(_config("w", 3))
    assert [(p.level, p.visit) for p in phases][:8] == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (0, 1), (1, 3)]
    assert [p.index for p in phases] == list(range(13))
    for p in phases:
        assert (p.steps, p.lr.peak) == ((10 * p.level + 2, p.level + 0.2) if p.name == "after" else
                                        (10 * p.level + 1, p.level + 0.1))
    assert [p.arrival for p in phases][:4] == ["fresh", "coalesce", "coalesce", "decoalesce"]
    # F: the first arrival at a level grows it (nothing to interpolate with), later ones interpolate
    f = build_phases(_config("f", 3))
    assert [p.arrival for p in f] == ["fresh", "grow", "coalesce", "decoalesce", "grow", "coalesce", "coalesce",
                                      "decoalesce", "decoalesce"]
    assert [p.arrival for p in build_phases(_config("v", 2))] == ["fresh", "coalesce", "decoalesce"]
    levels = _levels(2)
    del levels[0]["lr_after"]  # null: lr_before
    assert [p.lr.peak for p in build_phases(_config("f", 2, levels))] == [1.1, 0.1, 1.1, 0.1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        f[0].steps = 3


def test_visits_override_the_rule():
    levels = [{"visits": [{"steps": 5, "lr": {"peak": 0.5}}, {"steps": 0}, {"steps": 7, "lr": {"peak": 0.7}}]},
              {"visits": [{"steps": 3, "lr": {"peak": 0.3}}, {"steps": 4, "lr": {"peak": 0.4}}]}]
    phases = build_phases(_config("w", 2, levels))
    assert [(p.level, p.steps, p.lr.peak, p.name) for p in phases] == [
        (0, 5, 0.5, "before"), (1, 3, 0.3, "coarsest"), (0, 0, 1e-3, "before"), (1, 4, 0.4, "coarsest"),
        (0, 7, 0.7, "after"),
    ]
    # the coarsest level needs no steps_before when its visits are given
    coarsest = {"visits": [{"steps": 3}, {"steps": 4}]}
    assert [p.steps for p in build_phases(_config("f", 2, [_levels(2)[0], coarsest]))] == [3, 1, 4, 2]
    # the rule's keys beside a level's visits would be read by nothing: refused, naming both
    with pytest.raises(ValueError, match=r"^multilevel.levels\[1\].steps_before is not read: "
                                         r"multilevel.levels\[1\].visits gives the steps"):
        _config("f", 2, [_levels(2)[0], {**coarsest, "steps_before": 3}])


@pytest.mark.parametrize(
    "cycle, num_levels, level, count, message",
    [
        ("w", 2, 0, 2, r"multilevel.levels\[0\].visits has 2 entries; cycle 'w' over 2 levels visits level 0 3 time"),
        ("w", 3, 2, 2, r"multilevel.levels\[2\].visits has 2 entries; cycle 'w' over 3 levels visits level 2 4 time"),
        ("f", 3, 1, 2, r"multilevel.levels\[1\].visits has 2 entries; cycle 'f' over 3 levels visits level 1 4 time"),
        ("v", 2, 0, 1, r"multilevel.levels\[0\].visits has 1 entries; cycle 'v' over 2 levels visits level 0 2 time"),
    ],
)
def test_visits_of_the_wrong_length(cycle, num_levels, level, count, message):
    levels = _levels(num_levels)
    levels[level]["visits"] = [{"steps": 1}] * count
    with pytest.raises(ValueError, match=message):
        _config(cycle, num_levels, levels)


def test_bad_visits():
    levels = _levels(2)
    levels[1]["visits"] = [{"steps": 3}, {"steps": 0}]
    with pytest.raises(ValueError, match=r"multilevel.levels\[-1\].visits\[1\].steps must be positive"):
        _config("w", 2, levels)
    levels[1]["visits"] = [{"steps": 3}, {"step": 1}]
    with pytest.raises(ValueError, match=r"multilevel.levels\[1\].visits\[1\]: unknown key\(s\) \['step'\]"):
        _config("w", 2, levels)
    levels[1]["visits"] = None
    levels[0]["visits"] = [{"steps": -1}] * 3
    with pytest.raises(ValueError, match=r"visits\[\*\].steps must be >= 0"):
        _config("w", 2, levels)
    with pytest.raises(ValueError, match=r"valid choices are \['v', 'w', 'f', 'grow'\]"):
        _config("x", 2)


def test_lr_factor():
    cosine = [lr_factor(s, 10, LRConfig(warmup_steps=2)) for s in range(10)]
    assert cosine == pytest.approx([0.5, 1.0, 1.0, 0.965746, 0.868198, 0.722208, 0.55, 0.377792, 0.231802, 0.134254],
                                   abs=1e-6)
    assert [lr_factor(s, 4, LRConfig(decay="linear", min_ratio=0.0)) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_factor(s, 6, LRConfig(decay="constant", warmup_steps=4)) for s in range(6)] == [
        0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_factor_by_hand():
    """Warm-up, cosine, linear and the floor ``min_ratio``, each point worked out by hand."""
    # warm-up over 4 steps: (step + 1) / 4, whatever the decay
    warm = LRConfig(warmup_steps=4, decay="cosine", min_ratio=0.2)
    assert [lr_factor(s, 12, warm) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # then cosine over the 8 steps left: progress (step - 4) / 8
    # step 6: progress 1/4, cos(pi/4) = 0.70711: 0.2 + 0.8 * (1 + 0.70711) / 2 = 0.88284
    assert lr_factor(6, 12, warm) == pytest.approx(0.2 + 0.8 * (1 + 2 ** -0.5) / 2)
    assert lr_factor(6, 12, warm) == pytest.approx(0.882843, abs=1e-6)
    # step 8: half way, cos(pi/2) = 0: 0.2 + 0.8 / 2 = 0.6
    assert lr_factor(8, 12, warm) == pytest.approx(0.6)
    # step 10: progress 3/4, cos(3 pi/4) = -0.70711: 0.2 + 0.8 * 0.14645 = 0.31716
    assert lr_factor(10, 12, warm) == pytest.approx(0.317157, abs=1e-6)
    # the end of the phase and past it: the floor
    assert lr_factor(12, 12, warm) == pytest.approx(0.2)
    assert lr_factor(30, 12, warm) == pytest.approx(0.2)
    # linear from 1 to 0.4 over 6 steps after 2 of warm-up: 1 - 0.6 * progress
    lin = LRConfig(warmup_steps=2, decay="linear", min_ratio=0.4)
    assert [lr_factor(s, 8, lin) for s in range(9)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    # min_ratio 1 makes any decay constant; min_ratio 0 decays to 0
    assert lr_factor(5, 10, LRConfig(decay="cosine", min_ratio=1.0)) == pytest.approx(1.0)
    assert lr_factor(10, 10, LRConfig(decay="cosine", min_ratio=0.0)) == pytest.approx(0.0)
    # a cosine with no warm-up starts at the peak: step 0 is progress 0
    assert lr_factor(0, 10, LRConfig(decay="cosine")) == 1.0


def test_warmup_stable_decay_by_hand():
    """``decay_fraction`` 0.25 over 12 steps after 4 of warm-up: the peak up to step 12, then a linear
    decay over the last 3 steps (round(0.25 * 12)), progress (step - 13) / 3, each worked out by hand."""
    wsd = LRConfig(warmup_steps=4, decay="linear", min_ratio=0.4, decay_fraction=0.25)
    assert [lr_factor(s, 16, wsd) for s in range(17)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0] + [1.0] * 9 + [1.0, 0.8, 0.6, 0.4])
    # cosine: step 14 is a third of the way, cos(pi/3) = 0.5: 0.1 + 0.9 * 0.75 = 0.775
    assert lr_factor(14, 16, LRConfig(warmup_steps=4, decay_fraction=0.25)) == pytest.approx(0.775)
    # 1: the decay starts right after warm-up (the schedule without the key)
    full = LRConfig(warmup_steps=2, decay_fraction=1.0)
    assert [lr_factor(s, 10, full) for s in range(10)] == [lr_factor(s, 10, LRConfig(warmup_steps=2))
                                                           for s in range(10)]
    for bad in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="lr.decay_fraction must be in"):
            LRConfig(decay_fraction=bad)


def test_one_minus_sqrt_cooldown_by_hand():
    """``decay = "1-sqrt"`` over the last 4 of 12 steps (no warm-up), to 0: the peak up to step 8,
    then 1 - sqrt(progress), progress (step - 8) / 4: 1, 1 - 0.5, 1 - sqrt(1/2) = 0.29289,
    1 - sqrt(3/4) = 0.13397, then 0 at the end."""
    wsd = LRConfig(decay="1-sqrt", min_ratio=0.0, decay_fraction=1 / 3)
    assert [lr_factor(s, 12, wsd) for s in range(13)] == pytest.approx(
        [1.0] * 9 + [0.5, 0.292893, 0.133975, 0.0], abs=1e-6)
    # with a floor: min_ratio + (1 - min_ratio) * shape, step 9: 0.2 + 0.8 * 0.5
    assert lr_factor(9, 12, LRConfig(decay="1-sqrt", min_ratio=0.2, decay_fraction=1 / 3)) == pytest.approx(0.6)


def _run_cosine(step: int, total: int, warmup: int = 0, min_ratio: float = 0.1) -> float:
    """The run-wide schedule worked out by hand: linear warm-up, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def _grow_levels(fine_warmup: int = 0, **fine_lr) -> list[dict]:
    return [{"steps_after": 6, "lr_after": {"peak": 1.0, "warmup_steps": fine_warmup, **fine_lr}},
            {"steps_before": 6, "lr_before": {"peak": 3.0, "warmup_steps": 2}}]


def test_continued_schedule_runs_once_over_the_run():
    """``lr_schedule = "continue"``: the 12 steps of a grown run follow one cosine (the first
    phase's warm-up of 2, min_ratio 0.1), each phase at its own peak; ``restart`` starts again."""
    coarse, fine = build_phases(_config("grow", 2, _grow_levels(), alpha=1.0, lr_schedule="continue"))
    expected = [_run_cosine(g, 12, warmup=2) for g in range(12)]
    assert [coarse.lr_factor(s) for s in range(6)] == pytest.approx(expected[:6])
    assert [fine.lr_factor(s) for s in range(6)] == pytest.approx(expected[6:])
    assert (coarse.lr.peak, fine.lr.peak) == (3.0, 1.0)
    # step 7 of the run by hand: progress 5/10, cos(pi/2) = 0: 0.1 + 0.9 / 2
    assert fine.lr_factor(1) == pytest.approx(0.55)
    # the fine phase starts where the coarse one ended, not at the peak again
    assert fine.lr_factor(0) < coarse.lr_factor(2)
    coarse, fine = build_phases(_config("grow", 2, _grow_levels(), alpha=1.0))
    assert [fine.lr_factor(s) for s in range(6)] == pytest.approx([_run_cosine(s, 6) for s in range(6)])


def test_continued_schedule_rewarms_later_phases():
    """A later phase's warm-up is a ramp to where the run's schedule stands."""
    _, fine = build_phases(_config("grow", 2, _grow_levels(fine_warmup=3), alpha=1.0, lr_schedule="continue"))
    expected = [_run_cosine(g, 12, warmup=2) for g in range(6, 12)]
    assert [fine.lr_factor(s) for s in range(6)] == pytest.approx(
        [expected[0] / 3, expected[1] * 2 / 3] + expected[2:])


def test_continued_schedule_with_equal_peaks_is_the_scratch_schedule():
    """Every level at one peak, no re-warm-up: the F-cycle's rates, step by step, are those of
    training from scratch for as many steps."""
    levels = [{"steps_before": 3, "lr_before": {"peak": 0.5}, "steps_after": 7, "lr_after": {"peak": 0.5}},
              {"visits": [{"steps": 8, "lr": {"peak": 0.5, "warmup_steps": 4}}, {"steps": 2, "lr": {"peak": 0.5}}]}]
    phases = build_phases(_config("f", 2, levels, lr_schedule="continue"))
    assert [p.steps for p in phases] == [8, 3, 2, 7]
    rates = [p.lr.peak * p.lr_factor(s) for p in phases for s in range(p.steps)]
    (scratch,) = build_phases(load_config({"training": {"train_steps": 20, "lr": {"peak": 0.5, "warmup_steps": 4}}}))
    assert rates == pytest.approx([0.5 * scratch.lr_factor(g) for g in range(20)])
    assert rates == pytest.approx([0.5 * _run_cosine(g, 20, warmup=4) for g in range(20)])


def test_continued_schedule_needs_one_decay():
    with pytest.raises(ValueError, match=r'lr_schedule = "continue".*phase 1 \(after, level 0\) has decay '
                                         r"'linear'.*valid choices: restart, continue"):
        build_phases(_config("grow", 2, _grow_levels(decay="linear"), alpha=1.0, lr_schedule="continue"))
    with pytest.raises(ValueError, match=r"multilevel.lr_schedule.*valid choices"):
        _config("grow", 2, _grow_levels(), alpha=1.0, lr_schedule="cosine")
