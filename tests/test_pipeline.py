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
    assert "levels: 4x64 (PP 2: bubble 33%)" in out, out[:2000]  # 1F1B's idle share, (p - 1) / (m + p - 1)
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


@pytest.mark.slow
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
    ({"multilevel": {"enabled": True, "strategy": "ode", "ode": {"coherence": "first_order", "line_search": True}}},
     "coherence = 'first_order' takes the coarse model's gradient outside the training step"),
])
def test_layouts_a_pipeline_cannot_run_are_refused_in_one_line(corpus, tmp_path, change, message):
    from megatron_multilevel.config import load_config
    from megatron_multilevel.training.engines import LevelEngines

    config = json.loads(_config(tmp_path, corpus, "run").read_text())
    config.setdefault("parallel", {"pipeline_model_parallel_size": 2})
    for key, value in change.items():
        config[key] = value
    if config["multilevel"].get("enabled"):  # the multilevel schedule's steps, not training.train_steps
        config["training"].pop("train_steps", None)
    (tmp_path / "bad.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LevelEngines(load_config(str(tmp_path / "bad.json")), 2)


@pytest.mark.slow
def test_a_v_cycle_over_two_stages_is_the_one_process_run(reference, corpus, tmp_path):
    """The default test V-cycle (coalescing width and depth: the coarse level's layer pairs (0, 1)
    and (2, 3) sit on one stage each, the fine model's final phase rebuilt from both stages), every
    level over two stages: the one-process run."""
    config = run_config(tmp_path, corpus, "run", parallel={"pipeline_model_parallel_size": 2}, training=KEEP_ALL)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


# the growth methods and strategies, each against its own one-process run
HALVES = {"depth_pairing": "halves", "width_pairing": "adjacent", "levels": [
    {"steps_before": 3, "lr_before": {"peak": 2e-3, "warmup_steps": 2},
     "steps_after": 5, "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
    {"steps_before": 5, "lr_before": {"peak": 4e-3}}]}
MSG = {"cycle": "grow", "num_levels": 2, "alpha": 1.0, "coalesce_width": False, "coalesce_depth": True,
       "depth_pairing": "halves", "depth_scaling": "none", "growth_mask_steps": 4, "optimizer_state": "map",
       "levels": [{"steps_after": 6, "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
                  {"steps_before": 5, "lr_before": {"peak": 2e-3, "warmup_steps": 2}}]}
GSTACK = {"cycle": "grow", "num_levels": 3, "alpha": 1.0, "coalesce_width": False, "coalesce_depth": True,
          "depth_pairing": "halves", "depth_scaling": "none",
          "levels": [{"steps_after": 5, "lr_after": {"peak": 2e-3, "warmup_steps": 1}}, {"steps_after": 0},
                     {"steps_before": 5, "lr_before": {"peak": 2e-3, "warmup_steps": 2},
                      "pipeline_model_parallel_size": 1}]}
ODE = {"enabled": True, "strategy": "ode", "ode": {
    "cycles": 2, "pre_steps": 2, "coarse_steps": 3, "post_steps": 2, "final_steps": 2, "optimizer_state": "map",
    "line_search": True,
    "fine_lr": {"peak": 2e-3, "decay": "constant"}, "coarse_lr": {"peak": 4e-3, "decay": "constant"},
    "final_lr": {"peak": 1e-3, "decay": "constant"}}}


def _exactly(path, multilevel: dict):
    """The config at ``path`` with exactly the ``multilevel`` block given (not merged into the tests')."""
    config = json.loads(path.read_text())
    config["multilevel"] = {"enabled": True, **multilevel}
    path.write_text(json.dumps(config, indent=1))
    return path


def _levels_at(multilevel: dict, *sizes) -> dict:
    """``multilevel`` with level ``i`` over ``sizes[i]`` stages."""
    levels = json.loads(json.dumps(multilevel["levels"]))
    for level, size in zip(levels, sizes):
        level.setdefault("pipeline_model_parallel_size", size)
    return {**multilevel, "levels": levels}


@pytest.mark.parametrize("multilevel, parallel", [
    # the pairs (i, i + 2) always cross the stages; the coarse level on one stage (DP 2)
    pytest.param(_levels_at(HALVES, 2, 1), {}, id="halves-v-cycle-pp2-to-pp1"),
    # the stacked layers (2, 3) and their mask on the second stage; moments carried across stages
    pytest.param(MSG, {"pipeline_model_parallel_size": 2}, id="msg", marks=pytest.mark.slow),
    # a one-layer model (one stage) stacked into two stages, then four layers over two
    pytest.param(GSTACK, {"pipeline_model_parallel_size": 2}, id="gstack", marks=pytest.mark.slow),
    # every other layer kept (layers 0 and 2: one on each stage), the change written back after the
    # line search (the fine model's loss through the stages)
    pytest.param(ODE, {"pipeline_model_parallel_size": 2}, id="ode", marks=pytest.mark.slow),
])
def test_strategies_over_two_stages_are_the_one_process_run(corpus, tmp_path, multilevel, parallel):
    _against_one_process(corpus, tmp_path, multilevel, parallel, procs=2)


def _against_one_process(corpus, tmp_path, multilevel: dict, parallel: dict, procs: int) -> None:
    """``multilevel`` run on ``procs`` ranks laid out by ``parallel`` (and its levels' own stages)
    against the same run in one process."""
    one = dict(multilevel)
    if "levels" in one:
        one["levels"] = [{k: v for k, v in level.items() if k != "pipeline_model_parallel_size"}
                         for level in one["levels"]]
    ok(launch(_exactly(run_config(tmp_path, corpus, "ref", multilevel=one, training=KEEP_ALL), one)))
    config = run_config(tmp_path, corpus, "run", multilevel=multilevel, parallel=parallel, training=KEEP_ALL)
    ok(launch(_exactly(config, multilevel), "--num_procs", procs))
    assert_close_to_reference(tmp_path / "run", {"dir": tmp_path / "ref"}, abs=2e-4)


@pytest.mark.slow
def test_reshard_from_two_stages_to_one_to_four(scratch, corpus, tmp_path):
    """A run killed over two stages, resharded to one process and then to four stages (one layer
    each), the moments the source's exactly at each hop, continues as the one-process run did."""
    from launch_helpers import convert

    config = _config(tmp_path, corpus, "run", parallel={"pipeline_model_parallel_size": 2},
                     model={"share_embeddings_and_output_weights": True}, gradient_accumulation_steps=2)
    assert launch(config, "--num_procs", 2, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step5"}).returncode != 0
    for source, target, stages, ranks in (("run", "pp1", 1, 1), ("pp1", "pp4", 4, 4)):
        out = ok(convert("reshard", tmp_path / source, tmp_path / target, "--target-pp", stages, "--num-gpus", ranks,
                         timeout=900)).stdout
        assert "phase00-step0000003: optimizer state exp_avg, exp_avg_sq at step 3: the source's, exactly" in out, out
    resumed = ok(launch(tmp_path / "pp4" / "config.json", "--num_procs", 4)).stdout
    assert "resuming from phase00-step0000003" in resumed
    assert_close_to_reference(tmp_path / "pp4", scratch, abs=5e-5)


def _transition_worker(rank, world, coarse_stages):
    """Coalesce (width and depth, layers ``i`` and ``i + 2`` paired: on different stages) a 4-layer
    GPT held over two stages into a coarse level over ``coarse_stages`` stages, and prolong it back;
    each against the operators on the full tensors in one process. Also the largest tensor any
    stage sent another, and the largest parameter of one layer."""
    import functools

    import torch.distributed as dist

    from megatron_multilevel.config import ModelConfig
    from megatron_multilevel.config.pipeline import PipelineSplit
    from megatron_multilevel.distributed import set_seed, set_tensor_model_parallel_size
    from megatron_multilevel.level_maps import make_level_map
    from megatron_multilevel.models import build_model, parameter_state_dict
    from megatron_multilevel.operators import coalesce, decoalesce, interpolate
    from megatron_multilevel.parallel.staging import Layout, copy_stream
    from megatron_multilevel.parallel.streams import Groups, ModelReader, ModelWriter, TensorsReader, TensorsWriter
    from megatron_multilevel.parallel.transition import coarsen, prolong
    from megatron_multilevel.training.engines import build_empty_model

    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, max_sequence_length=16,
                      share_embeddings_and_output_weights=True)
    lm = make_level_map(cfg, depth_pairing="halves")
    set_tensor_model_parallel_size(1)
    set_seed(3)
    full = {k: v.clone() for k, v in parameter_state_dict(build_model(cfg)).items()}
    fine_layout, coarse_layout = Layout(1, 0, PipelineSplit(2)), Layout(1, 0, PipelineSplit(coarse_stages))

    def whole(model, model_cfg):
        collected = TensorsWriter(model_cfg)
        copy_stream(ModelReader(model, model_cfg, Groups.current()), collected, model_cfg.num_layers)
        return collected.tensors

    fine = build_empty_model(cfg, fine_layout)
    copy_stream(TensorsReader(full, cfg), ModelWriter(fine, cfg, Groups.current()), cfg.num_layers)
    sent = []
    broadcast = dist.broadcast

    def recorded(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = recorded
    try:
        staged, before = coarsen(fine, lm, fine_layout=fine_layout, coarse_layout=coarse_layout,
                                 build_target=functools.partial(build_empty_model, lm.coarse, coarse_layout))
        coarse_full = whole(staged.model, lm.coarse)
        back = prolong(staged.model, before, lm, 0.5, coarse_layout=coarse_layout, fine_layout=fine_layout,
                       build_target=functools.partial(build_empty_model, cfg, fine_layout))
    finally:
        dist.broadcast = broadcast
    fine_full = whole(back.model, cfg)

    def diff(a, b):
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        return max((a[k] - b[k]).abs().max().item() for k in a)

    layer = max(v.numel() for k, v in full.items() if ".layers." in k)
    return {"coalesce": diff(coarse_full, coalesce(full, lm)),
            "prolong": diff(fine_full, interpolate(full, decoalesce(coalesce(full, lm), lm), 0.5)),
            "largest_sent": max(sent), "largest_layer_tensor": layer,
            "embedding": full["embedding.word_embeddings.weight"].numel()}


@pytest.mark.parametrize("coarse_stages", [2, 1])
def test_a_transition_across_stages_is_the_operators_on_full_tensors(tmp_path, coarse_stages):
    """Pairs that cross the stages, coarse level over two stages or one: coalesce and prolong equal
    the one-process operators to 1e-6 on every rank; the most any stage sends another at once is one
    tensor of one layer (the vocabulary moves in slabs no larger), whatever the model's depth."""
    from distributed_helpers import run_ranks

    for result in run_ranks(_transition_worker, 2, tmp_path, coarse_stages):
        assert result["coalesce"] < 1e-6 and result["prolong"] < 1e-6, result
        assert result["largest_sent"] <= result["largest_layer_tensor"], result


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["transition1", "transition2"])
def test_a_pipelined_v_cycle_killed_in_a_transition_resumes_on_the_same_trajectory(reference, corpus, tmp_path,
                                                                                 crash_at):
    """The test V-cycle over two stages, killed while coalescing (transition1) or de-coalescing
    (transition2) across the stages, resumed: the one-process run's losses."""
    config = run_config(tmp_path, corpus, "run", parallel={"pipeline_model_parallel_size": 2}, training=KEEP_ALL)
    crashed = launch(config, "--num_procs", 2, env={"MEGATRON_MULTILEVEL_CRASH_AT": crash_at})
    assert crashed.returncode != 0
    resumed = ok(launch(config, "--num_procs", 2))
    assert "resuming from" in resumed.stdout and "is damaged" not in resumed.stdout
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("multilevel, parallel", [
    pytest.param(_levels_at(HALVES, 2, 1), {"tensor_model_parallel_size": 2}, id="v-cycle-tp2-pp2-to-tp2-dp2"),
    pytest.param(MSG, {"pipeline_model_parallel_size": 2}, id="msg-pp2-dp2"),
    pytest.param(_levels_at(MSG, 4, 2), {}, id="msg-pp4-from-pp2-dp2"),
    pytest.param(ODE, {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2}, id="ode-tp2-pp2"),
])
def test_strategies_on_four_ranks_are_the_one_process_run(corpus, tmp_path, multilevel, parallel):
    """On four ranks: a V-cycle at TP 2 x PP 2 whose coarse level drops to TP 2 x DP 2, MSG at PP 2 x
    DP 2, MSG grown from a small model at PP 2 x DP 2 into the full one at PP 4, the ODE strategy at
    TP 2 x PP 2: each its one-process run."""
    _against_one_process(corpus, tmp_path, multilevel, parallel, procs=4)
