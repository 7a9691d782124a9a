"""A new user's first hour: the two commands of the quick start, the main job's baseline and the
saving it reports, the optimizer block checked before anything is built."""

import inspect
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from launch_helpers import ROOT, launch, make_corpus, preprocess, records, small_config
from megatron_multilevel.config import load_config
from megatron_multilevel.records import read_metrics

DEFAULT_CONFIG = ROOT / "configs" / "gpt_tiny_cpu.json"


# ---------------------------------------------------------------- make run / make test
@pytest.fixture
def checkout(tmp_path):
    """The files ``make`` and CI read, in a directory of their own."""
    for name in ("Makefile", "pyproject.toml", "tools/setup_env.sh", ".ci/run"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    return tmp_path


def _make_n(directory: Path, *args: str) -> list[str]:
    """The commands ``make ARGS`` would run (``make -n``: nothing runs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    result = subprocess.run(["make", "-n", "-C", str(directory), *args], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if not line.startswith("make")]


def test_make_sets_up_once_then_reuses_the_environment(checkout):
    venv_python = f'"{checkout}/.venv/bin/python"'
    setup = "bash tools/setup_env.sh .venv"
    # a fresh clone: both commands set up .venv first
    assert _make_n(checkout, "test") == [setup, "touch .venv/.installed", f"{venv_python} -m pytest -q tests"]
    assert _make_n(checkout, "run")[0] == setup
    # set up: nothing is installed again
    (checkout / ".venv").mkdir()
    (checkout / ".venv" / ".installed").touch()
    newer = max((checkout / name).stat().st_mtime for name in ("pyproject.toml", "tools/setup_env.sh")) + 10
    os.utime(checkout / ".venv" / ".installed", (newer, newer))
    assert _make_n(checkout, "test") == [f"{venv_python} -m pytest -q tests"]
    assert _make_n(checkout, "run", "ARGS=--no-baseline") == [
        f"PYTHON={venv_python} launch/pretrain_vcycle.sh --no-baseline"]
    # pyproject.toml changed: set up again
    os.utime(checkout / "pyproject.toml", (newer + 10, newer + 10))
    assert _make_n(checkout, "test")[0] == setup
    # one's own environment (a GPU machine's CUDA torch): no set-up at all
    assert _make_n(checkout, "run", "PYTHON=python") == ['PYTHON="python" launch/pretrain_vcycle.sh ']


def test_ci_runs_make_test(checkout, tmp_path_factory):
    bin_dir = tmp_path_factory.mktemp("bin")
    calls = bin_dir / "calls"
    fake = bin_dir / "make"
    fake.write_text(f'#!/usr/bin/env bash\necho "$PWD $*" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(checkout / ".ci" / "run")], capture_output=True, text=True, env=env,
                            cwd=bin_dir, timeout=60)
    assert result.returncode == 0, result.stderr
    assert calls.read_text().splitlines() == [f"{checkout} test"]


# ---------------------------------------------------------------- the optimizer block
def _config(**optimizer) -> dict:
    data = json.loads(DEFAULT_CONFIG.read_text())
    data["optimizer"] = optimizer
    return data


def test_optimizer_params_are_checked_against_the_type():
    adamw = json.loads(DEFAULT_CONFIG.read_text())["optimizer"]["params"]
    with pytest.raises(ValueError) as e:
        load_config(_config(type="Lion", params=adamw))
    assert str(e.value).startswith("optimizer.params.eps and optimizer.params.torch_adam are not parameters of "
                                   "optimizer.type = 'Lion'")
    assert "valid params are ['betas', 'lr', 'set_grad_none', 'weight_decay']" in str(e.value)
    lion = _config(type="Lion", params={"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1})
    # the default carries AdamW's moments through its transitions, which Lion does not keep: refused
    # when the config is read, not at the first transition
    with pytest.raises(ValueError, match=r"multilevel.optimizer_state = 'map' carries .*optimizer.type is 'Lion'"):
        load_config(lion)
    lion["multilevel"]["optimizer_state"] = "reset"
    load_config(lion)
    # torch_adam chooses torch's AdamW, which has no bias_correction (DeepSpeed's FusedAdam has)
    load_config(_config(type="AdamW", params={"bias_correction": False}))
    with pytest.raises(ValueError, match=r"optimizer.params.bias_correction .* builds torch.optim.AdamW"):
        load_config(_config(type="AdamW", params={"bias_correction": False, "torch_adam": True}))
    load_config(_config(type="SGD", params={"momentum": 0.9, "nesterov": True}))
    with pytest.raises(ValueError, match=r"optimizer.type = 'Adamw2' is not an optimizer DeepSpeed 0.19.8 builds; "
                                         r"valid types are \['Adagrad', 'Adam', 'AdamW', 'Lamb', 'Lion'"):
        load_config(_config(type="Adamw2"))
    with pytest.raises(ValueError, match="torch's types are matched as spelled: 'SGD'"):
        load_config(_config(type="sgd"))
    # a level's DeepSpeed keys are merged into the top-level ones
    data = _config(type="AdamW", params=adamw)
    data["multilevel"]["levels"][1]["deepspeed"] = {"optimizer": {"type": "Lion"}}
    with pytest.raises(ValueError, match=r"^multilevel.levels\[1\].deepspeed .*: optimizer.params.eps and"):
        load_config(data)


def test_optimizer_tables_match_deepspeed_and_torch():
    """The tables are DeepSpeed 0.19.8's and torch's own: their types and constructor arguments."""
    import importlib

    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.engine import DeepSpeedEngine

    from megatron_multilevel.config.optimizers import CLASS_PARAMS, DEEPSPEED_TYPES, TORCH_TYPES

    assert sorted(t.lower() for t in DEEPSPEED_TYPES) == sorted(DEEPSPEED_OPTIMIZERS)
    torch_optimizers = {n for n, c in vars(torch.optim).items() if isinstance(c, type)
                        and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    assert set(TORCH_TYPES) == {n for n in torch_optimizers if n.lower() not in DEEPSPEED_OPTIMIZERS}
    # what DeepSpeed passes itself, or refuses (max_grad_norm: gradient_clipping replaces it)
    not_ours = {"self", "params", "model_params", "adam_w_mode", "adamw_mode", "max_grad_norm"}
    for path, params in CLASS_PARAMS.items():
        module, name = path.rsplit(".", 1)
        if name == "MuonWithAuxAdam":  # reads its keys from the config, not its constructor
            expected = {*DeepSpeedEngine._MUON_HALF_KEYS, *DeepSpeedEngine._ADAM_HALF_KEYS, "muon_lr", "adam_lr"}
        else:
            cls = getattr(importlib.import_module(module), name)
            expected = set(inspect.signature(cls.__init__).parameters) - not_ours
            if name == "DeepSpeedCPUAdam":
                expected.discard("fp32_optimizer_states")  # DeepSpeed's, read before (ADAM_KEYS)
        assert set(params) == expected, path


# ---------------------------------------------------------------- the baseline
def test_baseline_is_on_for_the_embedded_default_only(tmp_path):
    from megatron_multilevel.pretrain import parse_args, wants_baseline
    from megatron_multilevel.training.baseline import baseline_config, control_config

    cfg = load_config(DEFAULT_CONFIG)
    other = tmp_path / "other.json"
    shutil.copy(DEFAULT_CONFIG, other)
    assert wants_baseline(parse_args(["--config", str(DEFAULT_CONFIG)]), cfg)
    assert not wants_baseline(parse_args(["--config", str(DEFAULT_CONFIG), "--no-baseline"]), cfg)
    assert not wants_baseline(parse_args(["--config", str(other)]), cfg)
    assert wants_baseline(parse_args(["--config", str(other), "--with-baseline"]), cfg)
    scratch = load_config({**json.loads(DEFAULT_CONFIG.read_text()), "multilevel": {"enabled": False}})
    assert not wants_baseline(parse_args(["--config", str(DEFAULT_CONFIG)]), scratch)
    with pytest.raises(ValueError, match="multilevel.enabled is false"):
        baseline_config(scratch)
    base = baseline_config(cfg)
    assert not base.multilevel.enabled and base.training.seed == cfg.training.seed
    assert base.training.output_dir == os.path.join(cfg.training.output_dir, "baseline")
    assert base.data == cfg.data
    # its control: the half-depth model of the default's level 1 alone, at level 1's rate
    assert parse_args(["--config", str(DEFAULT_CONFIG)]).control
    assert not parse_args(["--config", str(DEFAULT_CONFIG), "--no-control"]).control
    ctl = control_config(cfg, base)
    assert not ctl.multilevel.enabled and ctl.training.seed == cfg.training.seed and ctl.data == cfg.data
    assert (ctl.model.num_layers, ctl.model.hidden_size) == (cfg.model.num_layers // 2, cfg.model.hidden_size)
    assert ctl.training.lr.peak == json.loads(DEFAULT_CONFIG.read_text())["multilevel"]["levels"][1]["visits"][0]["lr"]["peak"]
    assert ctl.training.train_steps > base.training.train_steps
    assert ctl.training.output_dir == os.path.join(cfg.training.output_dir, "control")


def test_the_baseline_warms_up_from_scratch_and_anneals_as_the_run_does():
    """An F-cycle's fine phases come after growth and have no warm-up, an ODE run's cycles keep a
    constant rate: the baseline, trained from random weights, takes the warm-up of the run's first
    phase and the decay of its last fine one."""
    from megatron_multilevel.training.baseline import baseline_config

    data = json.loads(DEFAULT_CONFIG.read_text())
    data["multilevel"] = {"enabled": True, "cycle": "f", "num_levels": 2, "alpha": 0.5, "levels": [
        {"steps_before": 6, "lr_before": {"peak": 2e-3, "warmup_steps": 0, "decay": "constant"},
         "steps_after": 8, "lr_after": {"peak": 1e-3, "warmup_steps": 0, "decay": "linear", "min_ratio": 0.2}},
        {"visits": [{"steps": 10, "lr": {"peak": 5e-3, "warmup_steps": 3}}, {"steps": 4, "lr": {"peak": 5e-3}}]}]}
    lr = baseline_config(load_config(data)).training.lr
    assert (lr.peak, lr.warmup_steps, lr.decay, lr.min_ratio) == (2e-3, 3, "linear", 0.2)

    data["multilevel"] = {"enabled": True, "strategy": "ode", "ode": {
        "pre_steps": 2, "coarse_steps": 4, "post_steps": 2, "cycles": 2, "final_steps": 6,
        "fine_lr": {"peak": 1e-3, "warmup_steps": 0, "decay": "constant"},
        "coarse_lr": {"peak": 1e-3, "warmup_steps": 0, "decay": "constant"},
        "final_lr": {"peak": 1e-3, "warmup_steps": 0, "decay": "cosine", "min_ratio": 0.05}}}
    lr = baseline_config(load_config(data)).training.lr
    assert (lr.peak, lr.warmup_steps, lr.decay, lr.min_ratio) == (1e-3, 0, "cosine", 0.05)

    # a V-cycle starts at the fine level: its first schedule, annealed as its last fine phase
    data["multilevel"] = {"enabled": True, "num_levels": 2, "alpha": 0.5, "levels": [
        {"steps_before": 5, "lr_before": {"peak": 1e-3, "warmup_steps": 2, "decay": "constant"},
         "steps_after": 8, "lr_after": {"peak": 1e-3, "warmup_steps": 1}},
        {"steps_before": 6, "lr_before": {"peak": 3e-3, "warmup_steps": 0}}]}
    lr = baseline_config(load_config(data)).training.lr
    assert (lr.peak, lr.warmup_steps, lr.decay, lr.min_ratio) == (1e-3, 2, "cosine", 0.1)


def _fine_valid(run_dir: Path) -> list[tuple[float, float, float]]:
    return [(r["flops"], r["seconds"], r["loss"]) for r in records(run_dir, "valid") if r["level"] == 0]


def _cost_to_reach(curve: list[tuple[float, float]], target: float) -> "float | None":
    """Where the piecewise-linear ``(cost, loss)`` curve first gets to ``target`` or below."""
    for i, (x, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return x
            x0, loss0 = curve[i - 1]
            return x0 + (x - x0) * (loss0 - target) / (loss0 - loss)
    return None


def test_with_baseline_reports_the_saving_resumes_and_reuses(tmp_path):
    data = tmp_path / "data"
    gpt = preprocess(make_corpus(data / "corpus"), data / "gpt")
    assert gpt.returncode == 0, gpt.stderr
    config = small_config(tmp_path / "run.json", kind="gpt", prefix=str(data / "gpt"),
                          tokenizer_model=str(data / "gpt.model"), output_dir=tmp_path / "run")
    run, base_dir = tmp_path / "run", tmp_path / "run" / "baseline"

    def ok(result):
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    # not the embedded default: no baseline unless asked for
    ok(launch(config))
    assert not base_dir.exists()
    # the run is finished; its baseline is killed at its step 5, then resumed
    crashed = launch(config, "--with-baseline", env={"MEGATRON_MULTILEVEL_CRASH_AT": "step5"})
    assert crashed.returncode != 0 and "baseline: training the fine model (" in crashed.stdout
    assert (base_dir / "checkpoints").exists() and not (base_dir / "summary.json").exists()
    out = ok(launch(config, "--with-baseline"))
    assert "resuming from" in out.split("baseline: training the fine model (")[1].split("control: training")[0]

    summary = json.loads((run / "summary.json").read_text())
    block = summary["baseline"]
    base_summary = json.loads((base_dir / "summary.json").read_text())
    # the same training FLOPs: as many fine steps as the run's FLOPs buy (within one step)
    fine_step = summary["phases"][0]["flops"] / summary["phases"][0]["steps"]
    assert block["steps"] == base_summary["totals"]["steps"] == round(summary["totals"]["flops"] / fine_step)
    base_cfg = json.loads((base_dir / "config.json").read_text())
    assert base_cfg["multilevel"]["enabled"] is False and base_cfg["training"]["seed"] == 5
    assert base_cfg["data"] == json.loads((run / "config.json").read_text())["data"]

    # the saving, recomputed from the two metrics files
    ours, theirs = _fine_valid(run), _fine_valid(base_dir)
    target = theirs[-1][2]
    saving = block["saving"]
    assert saving["target_loss"] == block["final_valid_loss"] == target
    assert saving["final_valid_loss"] == ours[-1][2] == summary["totals"]["final_valid_loss"]
    for axis, column in (("flops", 0), ("seconds", 1)):
        cost = _cost_to_reach([(r[column], r[2]) for r in ours], target)
        base = _cost_to_reach([(r[column], r[2]) for r in theirs], target)
        if cost is None:
            assert saving[f"{axis}_to_target"] is None and saving[f"saving_{axis}"] is None
        else:
            assert saving[f"{axis}_to_target"] == pytest.approx(cost)
            assert saving[f"saving_{axis}"] == pytest.approx(1 - cost / base)
    assert saving["reached"] == (_cost_to_reach([(r[0], r[2]) for r in ours], target) is not None)
    if saving["reached"]:
        assert f"saving at equal quality: {saving['saving_flops']:.0%} of the FLOPs and " in out
    else:
        assert saving["gap"] == pytest.approx(ours[-1][2] - target)
        assert f"not reached: the multilevel run ends at {ours[-1][2]:.4f}, {saving['gap']:.4f} above" in out
    assert (run / "loss_vs_flops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the control: the first coarse level's model alone, as many steps as the baseline's FLOPs buy
    control_dir = run / "control"
    ctl, ctl_summary = block["control"], json.loads((control_dir / "summary.json").read_text())
    coarse = next(p for p in summary["phases"] if p["level"] == 1 and p["steps"])
    coarse_step = coarse["flops"] / coarse["steps"]
    assert ctl["steps"] == ctl_summary["totals"]["steps"] == round(block["steps"] * fine_step / coarse_step)
    ctl_cfg = json.loads((control_dir / "config.json").read_text())
    assert ctl_cfg["multilevel"]["enabled"] is False and ctl_cfg["training"]["seed"] == 5
    assert (ctl_cfg["model"]["num_layers"], ctl_cfg["model"]["hidden_size"]) == (
        coarse["model"]["num_layers"], coarse["model"]["hidden_size"])
    ctl_loss = [r["loss"] for r in records(control_dir, "valid")][-1]
    assert ctl["final_valid_loss"] == ctl_loss
    shape = f"{coarse['model']['num_layers']} x {coarse['model']['hidden_size']}"
    assert (f"control: the coarse model ({shape}) alone from scratch, {ctl['steps']} steps on the same FLOPs: "
            f"final validation loss {ctl_loss:.4f}") in out
    regime = ("the full model is not yet the right model at this budget" if ctl_loss <= target
              else "the full model is the right model here")
    assert regime in out.split("control: the coarse model")[1]

    # a second invocation reuses the finished baseline and control
    before = (base_dir / "metrics.jsonl").read_bytes()
    out = ok(launch(config, "--with-baseline"))
    assert f"baseline: reusing the finished baseline in {base_dir}" in out
    assert f"control: reusing the finished control in {control_dir}" in out
    assert "training the fine model (" not in out
    assert (base_dir / "metrics.jsonl").read_bytes() == before
    assert json.loads((run / "summary.json").read_text())["baseline"] == block

    # the resumed baseline is the baseline run on its own, uninterrupted
    alone = tmp_path / "alone"
    ok(launch(base_dir / "config.json", f"training.output_dir={alone}"))
    curve, alone_curve = ([(r["type"], r["global_step"], r["loss"]) for r in read_metrics(d)
                           if r["type"] in ("train", "valid")] for d in (base_dir, alone))
    assert [c[:2] for c in curve] == [c[:2] for c in alone_curve]
    # two launches of the same run can differ in the float32 losses' last bits (seen once in CI:
    # 1.2e-6 relative, already at the first step, before any resume); a resume that lost any state
    # (data position, RNG, optimizer, schedule) moves them by orders of magnitude more
    assert [c[2] for c in curve] == pytest.approx([c[2] for c in alone_curve], rel=1e-5)

    # another config makes another baseline: the old one is replaced
    out = ok(launch(config, "--with-baseline", "training.eval_batches=1"))
    assert f"baseline: {base_dir} holds a run of another config; removing it" in out
    assert json.loads((base_dir / "config.json").read_text())["training"]["eval_batches"] == 1
    assert json.loads((run / "summary.json").read_text())["baseline"]["steps"] == block["steps"]


# ---------------------------------------------------------------- a first try
def test_a_first_try_of_the_default_config_says_what_it_runs_and_nothing_else(tmp_path):
    """The quick start's config named on the command line, at a fiftieth of its steps: the opening
    line announces the three runs (and the flags that skip the references), every phase trains at
    least a step, and no third-party warning or launcher line reaches the console."""
    from megatron_multilevel.pretrain import parse_args, runs_line
    from megatron_multilevel.training.baseline import baseline_config, control_config

    run = tmp_path / "run"
    result = launch(DEFAULT_CONFIG, "training.steps_scale=0.02", f"training.output_dir={run}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if not line.startswith("preparing the embedded corpus")]
    assert lines[0] == (f"3 runs: the multilevel run in {run}, then its baseline (the fine model (4 x 128) from "
                        f"scratch on the same training FLOPs) in {run}/baseline and its control (the coarse model "
                        f"(2 x 128) alone) in {run}/control; --no-baseline skips both, --no-control the control")
    assert result.stderr == ""
    assert not any(word in result.stdout for word in ("Warning", "warnings.warn", "[ERROR]", "[INFO]"))
    summary = json.loads((run / "summary.json").read_text())
    assert [p["steps"] for p in summary["phases"]] == [4, 1, 2, 1]  # 160, 20, 80, 16 steps x 0.02, rounded up
    assert (run / "baseline" / "summary.json").is_file() and (run / "control" / "summary.json").is_file()
    # a run without references says nothing of them; without the control, two runs
    cfg = load_config(DEFAULT_CONFIG)
    assert not parse_args(["--config", str(DEFAULT_CONFIG), "--no-baseline"]).with_baseline
    assert runs_line(cfg, None, None) is None
    assert runs_line(cfg, baseline_config(cfg), None).startswith("2 runs: the multilevel run in ")
    assert runs_line(cfg, baseline_config(cfg), control_config(cfg, baseline_config(cfg))).startswith("3 runs: ")


def test_the_launchers_help_and_the_docs_say_what_runs_and_where_it_lands():
    """--help names the default for what it is (an F-cycle with its baseline and control) and the
    first-try key; docs/checkpoints.md's examples write to out/, which git ignores; the quick start
    shows the short run."""
    help_text = subprocess.run(["bash", str(ROOT / "launch" / "pretrain_vcycle.sh"), "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "a small GPT F-cycle (the recipe)" in help_text and "then its baseline and its control: three runs" in help_text
    assert "--no-baseline skips both, --no-control the control" in help_text and "V-cycle on" not in help_text
    assert help_text.rstrip().endswith("--master_addr node0 --master_port 29500")  # the whole header, no code
    checkpoints = (ROOT / "docs" / "checkpoints.md").read_text()
    assert "out/full" in checkpoints and "builds no pipeline stages" not in checkpoints
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "out/full/model.pt"], cwd=ROOT, timeout=60)
        assert ignored.returncode == 0, "out/ is not ignored"
    readme = (ROOT / "README.md").read_text()
    assert 'make run ARGS="training.steps_scale=0.1 --no-baseline"' in readme
    assert "training.steps_scale=0.1" in (ROOT / "docs" / "cycles.md").read_text()
