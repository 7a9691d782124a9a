"""Pipeline parallelism: a level split over stages, trained by Megatron-Core's schedule under
DeepSpeed's engine, is the one-process run (losses, step by step), in every layout of 2 and 4
ranks; the layouts that cannot run are refused in one line before launch."""

import json

import pytest

from launch_helpers import KEEP_ALL, assert_close_to_reference, launch, ok, run_config

SCRATCH = {"enabled": False}
# 6 steps of the full model; gradient clipping at 1.0 is active in the first steps (the norm is
# above 1 at initialisation), so a clip that counted a stage twice or not at all would show
TRAINING = {**KEEP_ALL, "train_steps": 6, "log_interval": 1, "eval_interval": 3, "save_interval": 3}


def _config(tmp_path, corpus, name, kind="gpt", parallel=None, deepspeed=None, model=None, **extra):
    blocks = {"multilevel": SCRATCH, "training": TRAINING, **extra}
    if parallel:
        blocks["parallel"] = parallel
    if model:
        blocks["model"] = model
    path = run_config(tmp_path, corpus, name, kind=kind, **blocks)
    if deepspeed or model:
        config = json.loads(path.read_text())
        config.update(deepspeed or {})
        config["model"] = {**config["model"], **(model or {})}
        path.write_text(json.dumps(config, indent=1))
    return path


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, corpus):
    """The one-process run from scratch of a tied-embedding GPT (4 layers), every checkpoint kept."""
    tmp = tmp_path_factory.mktemp("pipeline_reference")
    ok(launch(_config(tmp, corpus, "run", model={"share_embeddings_and_output_weights": True},
                      gradient_accumulation_steps=2)))
    return {"dir": tmp / "run"}


def test_two_stages_are_the_one_process_run(scratch, corpus, tmp_path):
    """PP 2 (layers 0-1 and the embedding on rank 0, layers 2-3, the tied output layer and the
    loss on rank 1), 2 micro-batches per step through the 1F1B schedule."""
    config = _config(tmp_path, corpus, "run", parallel={"pipeline_model_parallel_size": 2},
                     model={"share_embeddings_and_output_weights": True}, gradient_accumulation_steps=2)
    out = ok(launch(config, "--num_procs", 2)).stdout
    assert_close_to_reference(tmp_path / "run", scratch, abs=2e-5)


ZERO1 = {"zero_optimization": {"stage": 1}}


@pytest.mark.parametrize("parallel, zero, procs", [
    pytest.param({"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2}, ZERO1, 4, id="tp2-pp2-zero1"),
    pytest.param({"pipeline_model_parallel_size": 4}, {}, 4, id="pp4", marks=pytest.mark.slow),
    pytest.param({"pipeline_model_parallel_size": 2}, ZERO1, 4, id="pp2-dp2-zero1", marks=pytest.mark.slow),
    pytest.param({"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 1}, {}, 2,
                 id="pp2-uneven-1-3", marks=pytest.mark.slow),
])
def test_pipelined_layouts_are_the_one_process_run(scratch, corpus, tmp_path, parallel, zero, procs):
    """TP 2 x PP 2 under ZeRO-1 (the optimizer's own clip over both stages), one layer per stage, PP 2
    x DP 2 under ZeRO-1, an uneven split (1 and 3 layers): each the one-process run."""
    config = _config(tmp_path, corpus, "run", parallel=parallel, deepspeed=zero,
                     model={"share_embeddings_and_output_weights": True}, gradient_accumulation_steps=2)
    ok(launch(config, "--num_procs", procs))
    assert_close_to_reference(tmp_path / "run", scratch, abs=5e-5)


def test_a_killed_pipelined_run_resumes_on_the_same_trajectory(scratch, corpus, tmp_path):
    """Killed at global step 5 (after the checkpoint of step 3, which every stage wrote), resumed: the
    uninterrupted one-process run's losses, the stages' checkpoint files named per stage."""
    config = _config(tmp_path, corpus, "run", parallel={"pipeline_model_parallel_size": 2},
                     model={"share_embeddings_and_output_weights": True}, gradient_accumulation_steps=2)
    crashed = launch(config, "--num_procs", 2, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step5"})
    assert crashed.returncode != 0
    resumed = ok(launch(config, "--num_procs", 2))
    assert "resuming from" in resumed.stdout
    assert_close_to_reference(tmp_path / "run", scratch, abs=2e-5)
    tag = tmp_path / "run" / "checkpoints" / "phase00-step0000003"
    assert sorted(p.name for p in tag.glob("mp_rank_*_model_states.pt")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]


def test_bert_over_two_stages(corpus, tmp_path):
    """BERT (its LM head and binary head on the last stage) over two stages: the one-process run."""
    ok(launch(_config(tmp_path, corpus, "ref", kind="bert", gradient_accumulation_steps=2)))
    config = _config(tmp_path, corpus, "run", kind="bert", parallel={"pipeline_model_parallel_size": 2},
                     gradient_accumulation_steps=2)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", {"dir": tmp_path / "ref"}, abs=5e-5)


@pytest.mark.parametrize("change, message", [
    ({"zero_optimization": {"stage": 2}}, "valid ZeRO stages with pipeline parallelism are [0, 1]"),
    ({"fp16": {"enabled": True}}, "use bf16"),
    ({"bf16": {"enabled": True}}, "bf16 needs ZeRO stage 1"),
    ({"parallel": {"pipeline_model_parallel_size": 3}}, "4 layers do not split over 3 stages"),
    ({"parallel": {"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 4}},
     "4 layers do not split over 2 stages with first stage 4"),
    ({"parallel": {"pipeline_model_parallel_size": 4}}, "does not divide the world size 2"),
])
def test_layouts_a_pipeline_cannot_run_are_refused_in_one_line(corpus, tmp_path, change, message):
    from megatron_multilevel.config import load_config
    from megatron_multilevel.training.engines import LevelEngines

    config = json.loads(_config(tmp_path, corpus, "run").read_text())
    config.setdefault("parallel", {"pipeline_model_parallel_size": 2})
    for key, value in change.items():
        config[key] = value
    (tmp_path / "bad.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LevelEngines(load_config(str(tmp_path / "bad.json")), 2)
