"""A first try of any config: ``training.steps_scale`` shortens every phase, and a key the run's mode
never reads (``training.train_steps`` under a multilevel schedule, ...) is refused in one line."""

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_multilevel.config import config_to_dict, load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def _read(name: str, **training) -> dict:
    data = json.loads((CONFIGS / name).read_text())
    data.setdefault("training", {}).update(training)
    return data


def _steps(cfg) -> list[int]:
    return [spec.steps for spec in cfg.multilevel.phase_specs()]


def _check(*args: str) -> subprocess.CompletedProcess:
    """The launcher's config check (``pretrain --check``), as ``launch/pretrain_vcycle.sh`` runs it."""
    return subprocess.run([sys.executable, "-m", "megatron_multilevel.pretrain", "--check", "--config", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


# ---------------------------------------------------------------- training.steps_scale
def test_the_default_config_at_a_tenth_of_its_steps():
    """The quick start's F-cycle: 160 + 20 + 80 + 16 steps become 16 + 2 + 8 + 2, its warm-up 8 becomes
    1, and everything else is the config's."""
    full, short = load_config(_read("gpt_tiny_cpu.json")), load_config(_read("gpt_tiny_cpu.json", steps_scale=0.1))
    assert _steps(full) == [160, 20, 80, 16] and _steps(short) == [16, 2, 8, 2]
    assert [s.lr.warmup_steps for s in short.multilevel.phase_specs()] == [1, 0, 0, 0]
    assert [s.lr.peak for s in short.multilevel.phase_specs()] == [s.lr.peak for s in full.multilevel.phase_specs()]
    assert (short.model, short.data) == (full.model, full.data)


def test_rounding_up_leaves_every_phase_that_trained_a_step():
    short = load_config(_read("gpt_tiny_cpu.json", steps_scale=0.001))
    assert _steps(short) == [1, 1, 1, 1]
    # a phase of no steps stays so: the coarse model's visits of a V-cycle level 0 without steps_after
    data = _read("gpt_tiny_cpu.json", steps_scale=0.5)
    data["multilevel"]["levels"][0]["steps_before"] = 0
    assert _steps(load_config(data))[1] == 0


def test_a_run_from_scratch_scales_its_steps_and_warm_up():
    scratch = {"training": {"steps_scale": 0.25, "lr": {"warmup_steps": 10}}}
    cfg = load_config(scratch)
    assert (cfg.training.train_steps, cfg.training.lr.warmup_steps) == (150, 3)  # the default 600 steps too
    assert load_config(_read("gpt_base_scratch.json", steps_scale=0.01)).training.train_steps == 1000
    # 100 x 0.07 is 7.000000000000001 in floating point: 7 steps, not 8
    assert load_config({"training": {"steps_scale": 0.07, "train_steps": 100}}).training.train_steps == 7


def test_the_steps_that_must_fit_a_phase_still_fit():
    """MSG's mask within the grown level's steps, LiGO's operator steps scaled with the phases, the
    ODE strategy's coherence batches within its coarse steps: the scaled configs pass every check."""
    msg = load_config(_read("gpt_base_msg.json", steps_scale=0.0001))
    (grown,) = msg.multilevel.grown_specs()
    assert (msg.multilevel.growth_mask_steps, grown.steps) == (1, 10)  # 5000 and 93643 steps
    ligo = _read("gpt_tiny_cpu.json", steps_scale=0.1)
    ligo["multilevel"].update(growth_operator="ligo", optimizer_state="reset")
    assert load_config(ligo).multilevel.ligo_steps == 10  # the default 100
    ligo["multilevel"]["ligo_steps"] = 7
    assert load_config(ligo).multilevel.ligo_steps == 1
    probe = load_config(_read("gpt_ode_coherence_probe.json", steps_scale=0.05)).multilevel.ode
    assert (probe.pre_steps, probe.coarse_steps, probe.post_steps, probe.final_steps, probe.coherence_batches,
            probe.cycles) == (2, 3, 2, 5, 1, 4)
    ode = load_config(_read("gpt_tiny_cpu_ode.json", steps_scale=0.1))
    assert sum(_steps(ode)) < sum(_steps(load_config(_read("gpt_tiny_cpu_ode.json"))))


def test_a_scaled_config_is_recorded_scaled_and_read_again_unchanged():
    """The run records the scaled steps (and no scale): its config.json, its baseline and a resume
    read them as they are, never scaled twice."""
    from megatron_multilevel.training.baseline import baseline_config

    short = load_config(_read("gpt_tiny_cpu.json", steps_scale=0.1))
    recorded = config_to_dict(short)
    assert recorded["training"]["steps_scale"] == 1.0
    assert load_config(json.loads(json.dumps(recorded))) == short
    full_baseline = baseline_config(load_config(_read("gpt_tiny_cpu.json"))).training.train_steps
    assert baseline_config(short).training.train_steps < full_baseline / 5


@pytest.mark.parametrize("value", [0, -0.5, 1.5, "half", True, None])
def test_a_scale_outside_0_1_is_one_line(value):
    with pytest.raises(ValueError, match=r"^training.steps_scale must be a number in \(0, 1\] .*got "):
        load_config(_read("gpt_tiny_cpu.json", steps_scale=value))


def test_the_launcher_check_takes_it():
    result = _check(str(CONFIGS / "gpt_tiny_cpu.json"), "training.steps_scale=0.1")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


# ---------------------------------------------------------------- keys the mode never reads
def test_train_steps_under_a_multilevel_schedule_is_refused_naming_the_levels_steps():
    result = _check(str(CONFIGS / "gpt_tiny_cpu.json"), "training.train_steps=40")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: training.train_steps = 40 is not read by a multilevel run (multilevel.enabled is true): its phases' "
        "steps are multilevel.levels[i].steps_before and steps_after (or multilevel.levels[i].visits[j].steps), "
        "276 steps in 4 phases here; to shorten any run, set training.steps_scale in (0, 1] instead (e.g. "
        "training.steps_scale=0.1)"]
    with pytest.raises(ValueError, match=r"^training.train_steps = 40 .* multilevel.ode.pre_steps, coarse_steps"):
        load_config(_read("gpt_tiny_cpu_ode.json", train_steps=40))


def test_a_switch_turned_off_keeps_its_settings():
    """``multilevel.enabled=false``: the config's full model alone for training.train_steps, its
    multilevel block set aside; the ODE strategy's coherence off keeps its gate's settings."""
    scratch = _read("gpt_tiny_cpu.json", train_steps=40)
    scratch["multilevel"]["enabled"] = False
    assert load_config(scratch).training.train_steps == 40
    probe = _read("gpt_ode_coherence_probe.json")
    probe["multilevel"]["ode"]["coherence"] = "none"
    assert load_config(probe).multilevel.ode.coherence_batches == 4


@pytest.mark.parametrize("change, message", [
    (lambda ml: ml["levels"][1].update(steps_before=100),
     r"^multilevel.levels\[1\].steps_before is not read: multilevel.levels\[1\].visits gives the steps"),
    (lambda ml: ml["levels"][1].update(lr_after={"peak": 1e-3}),
     r"^multilevel.levels\[1\].lr_after is not read: multilevel.levels\[1\].visits"),
    (lambda ml: ml["levels"][1].update(visits=None, steps_before=4, lr_after={"peak": 1e-3}),
     r"^multilevel.levels\[1\].lr_after is not read: the coarsest level trains steps_before"),
    (lambda ml: ml["levels"][1].update(alpha=0.5),
     r"^multilevel.levels\[1\].alpha is not read: .*level 1 is the coarsest; set it on a finer level"),
    (lambda ml: ml.update(ligo_steps=50),
     r"^multilevel.ligo_steps = 50 is not read: .*growth_operator is 'copy'; set growth_operator 'ligo'"),
    (lambda ml: ml.update(ligo_lr=0.01), r"^multilevel.ligo_lr = 0.01 is not read"),
])
def test_a_key_the_cycle_never_reads_is_refused(change, message):
    data = _read("gpt_tiny_cpu.json")
    change(data["multilevel"])
    with pytest.raises(ValueError, match=message):
        load_config(data)


def test_keys_of_another_mode_are_refused():
    grow = _read("gpt_base_grow.json")
    grow["multilevel"]["interpolation"] = "correction"
    with pytest.raises(ValueError, match=r"^multilevel.interpolation = 'correction' is not read: .*cycle 'grow' only"):
        load_config(grow)
    grow["multilevel"].update(interpolation="blend", keep_fine="disk")
    with pytest.raises(ValueError, match=r"^multilevel.keep_fine = 'disk' is not read"):
        load_config(grow)
    gpt = _read("gpt_tiny_cpu.json")
    gpt["data"]["masking_probability"] = 0.3
    with pytest.raises(ValueError, match=r"^data.masking_probability = 0.3 is not read: it is BERT's, and model.kind "
                                         r"is 'gpt'"):
        load_config(gpt)
    load_config(_read("bert_tiny_cpu.json") | {"data": {"masking_probability": 0.3, "seq_length": 128}})


def test_no_kept_benchmark_run_set_a_key_its_mode_never_read():
    """Every kept run's config either loads or is refused for a reason of its own (checks added since
    it ran): none for a key the run never read."""
    refused = []
    for path in sorted(glob.glob(str(ROOT / "benchmarks" / "*" / "runs" / "*.json"))):
        config = json.loads(Path(path).read_text()).get("config")
        if config is None:
            continue
        try:
            load_config(config)
        except ValueError as e:
            if "is not read" in str(e):
                refused.append((path, str(e)))
    assert not refused, refused[:3]
