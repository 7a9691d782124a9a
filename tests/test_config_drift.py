"""A resume whose config differs from its checkpoint's: refused where the trajectory would change,
allowed (and recorded) on request, indifferent to what only logs, saves or lays out."""

import json

from launch_helpers import launch, ok, run_config

from megatron_multilevel.training.config_drift import trajectory_changes


def test_changes_that_matter_and_those_that_do_not():
    saved = {"training": {"seed": 1, "output_dir": "a", "log_interval": 10},
             "multilevel": {"levels": [{"lr_before": {"peak": 1e-3}}, {"steps_before": 5, "tensor_model_parallel_size": 1,
                                                                               "deepspeed": {"zero_optimization": {"stage": 1}}}]},
             "parallel": {"tensor_model_parallel_size": 1}, "optimizer": {"params": {"betas": [0.9, 0.95]}}}
    ours = {"training": {"seed": 1, "output_dir": "b", "log_interval": 1},
            "multilevel": {"levels": [{"lr_before": {"peak": 5e-4}},
                                      {"steps_before": 5, "tensor_model_parallel_size": 2,
                                       "deepspeed": {"zero_optimization": {"stage": 3}}}]},
            "parallel": {"tensor_model_parallel_size": 2}, "optimizer": {"params": {"betas": [0.9, 0.99]}},
            "model": {"an_option_added_since": None}}
    assert trajectory_changes(saved, ours) == {"multilevel.levels.0.lr_before.peak": (1e-3, 5e-4),
                                               "optimizer.params.betas.1": (0.95, 0.99)}


def test_a_resume_with_another_seed_is_refused_unless_allowed_and_then_recorded(corpus, tmp_path):
    """Killed after its first checkpoint (global step 3), run again with another ``training.seed``:
    one line naming the key and both values, nothing trained; with ``--allow-config-change`` it
    resumes, says so, records the change with the step it took effect and rewrites config.json.
    Finished, the same directory run again with another ``multilevel.alpha`` is refused too (it
    would reprint the finished run's result as the new config's)."""
    config = run_config(tmp_path, corpus, "run")
    assert launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step5"}).returncode != 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    refused = launch(config, "training.seed=6")
    assert refused.returncode == 1
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        f"error: the checkpoint phase00-step0000003 in {tmp_path / 'run'} was written by another config "
        f"(training.seed 5 -> 6): run its config, use another training.output_dir, or pass --allow-config-change to "
        f"change it from there on (recorded in config_changes.jsonl)"]
    # the error is the last word: no DeepSpeed "[ERROR] ... exits with return code = 1" line after it
    assert "exits with return code" not in refused.stdout + refused.stderr, refused.stdout + refused.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing written
    allowed = ok(launch(config, "training.seed=6", "--allow-config-change"))
    assert "config changed from global step 3 on (--allow-config-change): training.seed 5 -> 6" in allowed.stdout
    (change,) = [json.loads(line) for line in (tmp_path / "run" / "config_changes.jsonl").read_text().splitlines()]
    assert change == {"global_step": 3, "resumed_from": "phase00-step0000003",
                      "changes": {"training.seed": {"before": 5, "after": 6}}}
    assert json.loads((tmp_path / "run" / "config.json").read_text())["training"]["seed"] == 6
    again = launch(config, "training.seed=6", "multilevel.alpha=0.25")
    assert again.returncode == 1 and "(multilevel.alpha 0.5 -> 0.25)" in again.stderr, again.stderr[-2000:]
    # what only logs, evaluates or saves differently is no change
    ok(launch(config, "training.seed=6", "training.log_interval=1", "training.save_interval=2"))
