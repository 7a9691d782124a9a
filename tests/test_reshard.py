"""Moving a run to another layout: ``reshard`` (and ``init-run``) to another tensor-parallel size,
number of ranks or ZeRO stage carry the optimizer, so that the run continues as if it had never
moved; a run resumed in a layout its checkpoints were not written for stops with the command that
converts them."""

import json

import pytest

import launch_helpers
from launch_helpers import KEEP_ALL, assert_close_to_reference, launch, ok, run_config

# the optimizer's state matters at every step here: carried through the transitions too
MAP = {"optimizer_state": "map"}
LAYOUTS = dict(abs=2e-4)  # what one run in two layouts differs by (float rounding)
CRASH = {"MEGATRON_MULTILEVEL_CRASH_AT": "step7"}  # in the coarse phase: latest phase01-step0000003


def convert(*args):
    return launch_helpers.convert(*args, timeout=900)  # two layouts spawned per conversion


@pytest.fixture(scope="module")
def map_reference(tmp_path_factory, corpus):
    """The uninterrupted one-process V-cycle whose moments are mapped through its transitions."""
    tmp = tmp_path_factory.mktemp("map_reference")
    ok(launch(run_config(tmp, corpus, "run", multilevel=MAP, training=KEEP_ALL)))
    return {"dir": tmp / "run"}


def _levels(tmp_path, corpus, *stages) -> dict:
    levels = json.loads(run_config(tmp_path, corpus, "tmp").read_text())["multilevel"]["levels"]
    for level, stage in zip(levels, stages):
        level["deepspeed"] = {"zero_optimization": {"stage": stage}}
    return {**MAP, "levels": levels}


def _crash(config, procs: int):
    crashed = launch(config, "--num_procs", procs, env=CRASH)
    assert crashed.returncode != 0
    assert (config.parent / "run" / "checkpoints" / "latest").read_text() == "phase01-step0000003"


@pytest.mark.slow
def test_tensor_parallel_2_to_1_to_2_keeps_the_optimizer(map_reference, corpus, tmp_path):
    """Killed at TP=2 (ZeRO-1) in its coarse phase, resharded to one process (no ZeRO) and back to
    TP=2 (ZeRO-2), the run continues as the uninterrupted one did, step by step."""
    config = run_config(tmp_path, corpus, "run", parallel={"tensor_model_parallel_size": 2},
                        zero_optimization={"stage": 1}, multilevel=MAP, training=KEEP_ALL)
    _crash(config, 2)
    out = ok(convert("reshard", tmp_path / "run", tmp_path / "tp1", "--target-tp", 1, "--num-gpus", 1,
                     "--zero-stage", 0)).stdout
    # both checkpoints the resume needs: the coarse one and the fine one from before coalescing
    # (the coarse model's moments were mapped from the fine model's: their step count goes on)
    for tag, step in (("phase00-step0000003", 3), ("phase01-step0000003", 6)):
        assert f"{tag}: optimizer state exp_avg, exp_avg_sq at step {step}: the source's, exactly" in out, out
    ok(convert("reshard", tmp_path / "tp1", tmp_path / "tp2", "--target-tp", 2, "--zero-stage", 2))
    config2 = json.loads((tmp_path / "tp2" / "config.json").read_text())
    assert config2["parallel"]["tensor_model_parallel_size"] == 2 and config2["zero_optimization"]["stage"] == 2
    resumed = ok(launch(tmp_path / "tp2" / "config.json", "--num_procs", 2)).stdout
    assert "resuming from phase01-step0000003" in resumed
    assert_close_to_reference(tmp_path / "tp2", map_reference, **LAYOUTS)


@pytest.mark.slow
def test_one_to_two_data_parallel_ranks_under_zero_1_and_3_keeps_the_optimizer(map_reference, corpus, tmp_path):
    """Killed on one process (level 0 under ZeRO-1, level 1 under ZeRO-3), the run cannot resume on
    two ranks as it is: it says so in one line, with the command that converts it; converted, it
    continues on two data-parallel ranks as the uninterrupted run did, step by step."""
    config = run_config(tmp_path, corpus, "run", multilevel=_levels(tmp_path, corpus, 1, 3), training=KEEP_ALL)
    _crash(config, 1)
    wrong = launch(config, "--num_procs", 2)
    assert wrong.returncode != 0 and "Traceback" not in wrong.stdout + wrong.stderr
    assert "was written in another layout (level 0: TP=1, ZeRO stage 1, DP=1 there, TP=1, ZeRO stage 1, DP=2 here)" \
        in wrong.stderr, wrong.stderr[-2000:]
    assert f"reshard {tmp_path / 'run'} NEW_RUN_DIR --num-gpus 2 --target-tp 1" in wrong.stderr
    out = ok(convert("reshard", tmp_path / "run", tmp_path / "dp2", "--num-gpus", 2)).stdout
    assert "at TP=1, 2 rank(s)" in out and "--num_gpus 2" in out
    resumed = ok(launch(tmp_path / "dp2" / "config.json", "--num_procs", 2)).stdout
    assert "resuming from phase01-step0000003" in resumed
    assert_close_to_reference(tmp_path / "dp2", map_reference, **LAYOUTS)


@pytest.mark.slow
def test_init_run_on_two_data_parallel_ranks_under_zero(map_reference, corpus, tmp_path):
    """A run started by ``init-run`` from given weights on two ranks, level 0 under ZeRO-1 and
    level 1 under ZeRO-3, trains as the same start on one process without ZeRO, step by step."""
    ok(convert("to-full", map_reference["dir"] / "checkpoints" / "phase00-step0000003", tmp_path / "start"))
    runs = {}
    for name, procs, stages in (("one", 1, (0, 0)), ("two", 2, (1, 3))):
        config = run_config(tmp_path, corpus, name, multilevel=_levels(tmp_path, corpus, *stages))
        out = ok(convert("init-run", tmp_path / "start", tmp_path / f"{name}_run", "--config", config,
                         "--num-gpus", procs)).stdout
        assert f"{procs} rank(s)" in out
        ok(launch(tmp_path / f"{name}_run" / "config.json", "--num_procs", procs))
        runs[name] = tmp_path / f"{name}_run"
    assert_close_to_reference(runs["two"], {"dir": runs["one"]}, **LAYOUTS)


@pytest.mark.slow
def test_pipeline_2_to_1_to_2_by_2_keeps_the_optimizer(map_reference, corpus, tmp_path):
    """Killed over two pipeline stages in its coarse phase (the V-cycle's every level at PP 2),
    resharded to one process and then to two stages on four ranks (two data-parallel replicas of
    each stage): the moments are the source's exactly each time, and the run continues as the
    uninterrupted one did."""
    config = run_config(tmp_path, corpus, "run", parallel={"pipeline_model_parallel_size": 2}, multilevel=MAP,
                        training=KEEP_ALL)
    _crash(config, 2)
    out = ok(convert("reshard", tmp_path / "run", tmp_path / "pp1", "--target-pp", 1, "--num-gpus", 1)).stdout
    for tag, step in (("phase00-step0000003", 3), ("phase01-step0000003", 6)):
        assert f"{tag}: optimizer state exp_avg, exp_avg_sq at step {step}: the source's, exactly" in out, out
    out = ok(convert("reshard", tmp_path / "pp1", tmp_path / "pp2", "--target-pp", 2, "--num-gpus", 4)).stdout
    assert "phase01-step0000003: optimizer state exp_avg, exp_avg_sq at step 6: the source's, exactly" in out, out
    assert json.loads((tmp_path / "pp2" / "config.json").read_text())["parallel"]["pipeline_model_parallel_size"] == 2
    resumed = ok(launch(tmp_path / "pp2" / "config.json", "--num_procs", 4)).stdout
    assert "resuming from phase01-step0000003" in resumed
    assert_close_to_reference(tmp_path / "pp2", map_reference, **LAYOUTS)
