"""Muon in a real run: growth with the grown layers' state zeroed, the loss going down, resharding
through ZeRO-2 on two ranks, the Megatron-Core export, and two pipeline stages."""

import json

import pytest
import torch

from distributed_helpers import run_ranks
from muon_helpers import KEYS, engine_states, inner_optimizer, whole_state
from megatron_multilevel.config import load_config


# ---- a real run: growth with the grown layers' state zeroed, the loss, resharding ----

STEPS = 6
MSG = {"enabled": True, "cycle": "grow", "num_levels": 2, "alpha": 1.0, "coalesce_width": False,
       "coalesce_depth": True, "depth_pairing": "halves", "depth_scaling": "none", "growth_mask_steps": 2,
       "optimizer_state": "map", "grown_moments": "zero",
       "levels": [{"steps_after": STEPS, "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
                  {"steps_before": STEPS, "lr_before": {"peak": 2e-3, "warmup_steps": 1}}]}


def _train_and_capture(rank, world, config: dict) -> list:
    """Run the trainer; the full states just before and just after each transition."""
    import torch._dynamo

    from megatron_multilevel.training import trainer

    torch._dynamo.config.disable = True
    captured, transition = [], trainer.Trainer._transition

    def steps(engine):
        return sorted({int(s["step"]) for s in inner_optimizer(engine).state.values() if "step" in s})

    def spy(self, phase, nxt, end_tag):
        before, steps_before = engine_states(self.engine), steps(self.engine)
        transition(self, phase, nxt, end_tag)
        captured.append({"from": phase.level, "to": nxt.level, "before": before, "after": engine_states(self.engine),
                         "steps": (steps_before, steps(self.engine))})

    trainer.Trainer._transition = spy
    try:
        trainer.Trainer(load_config(config)).run()
    finally:
        trainer.Trainer._transition = transition
    return captured


@pytest.fixture(scope="module")
def muon_run(corpus, tmp_path_factory):
    """MSG-style depth growth (2 -> 4 layers, the copies masked in, ``grown_moments: "zero"``) trained
    with Muon in one process, every checkpoint kept."""
    from launch_helpers import KEEP_ALL, run_config

    tmp = tmp_path_factory.mktemp("muon")
    optimizer = {"type": "Muon", "params": {"lr": 2e-3, "muon_lr": 0.02, "momentum": 0.9, "weight_decay": 0.01}}
    # no clipping: at ZeRO 1-3 DeepSpeed would clip Muon's update (refused), and this run is resharded there
    path = run_config(tmp, corpus, "run", optimizer=optimizer, multilevel=MSG, gradient_clipping=0.0,
                      training={**KEEP_ALL, "log_interval": 1, "eval_interval": 100})
    config = json.loads(path.read_text())
    captured = run_ranks(_train_and_capture, 1, tmp / "ranks", config)[0]
    return {"dir": tmp / "run", "captured": captured, "config": load_config(config), "tmp": tmp}


def test_growth_maps_the_kept_layers_state_and_zeroes_the_grown_layers(muon_run):
    """The 4-layer model's state after growth, written out: every layer of a depth pair starts from
    the small model's layer, the first keeps its state (the operators' de-coalescing), the second
    (the layer growth adds) starts from zero momentum and zero moments; the embeddings' and output
    layer's Adam moments are carried as they are, and so is the step count."""
    from megatron_multilevel.config import STATE_DEGREE
    from megatron_multilevel.level_maps import run_level_maps
    from megatron_multilevel.operators import decoalesce, group_member

    (grow,) = muon_run["captured"]
    assert (grow["from"], grow["to"]) == (1, 0)
    lm = run_level_maps(muon_run["config"])[0]
    grown = [j for j in range(lm.fine.num_layers) if group_member(lm, j)]
    # the step count: the auxiliary Adam's (DeepSpeed's FusedAdam counts on a group's last parameter)
    assert grown == [2, 3] and [max(s) for s in grow["steps"]] == [STEPS, STEPS]
    for key in KEYS:
        mapped = decoalesce(whole_state(grow["before"], key), lm, degree=STATE_DEGREE[key])
        after = grow["after"][key]
        assert after and set(after) <= set(mapped), key
        for name, t in after.items():
            fresh = any(name.startswith(f"decoder.layers.{j}.") for j in grown)
            want = torch.zeros_like(t) if fresh else mapped[name]
            assert torch.equal(t, want), (key, name)
            assert fresh or t.abs().max() > 0, (key, name)


def test_a_muon_run_trains(muon_run):
    """The loss goes down over the small model's steps and again over the grown model's."""
    from launch_helpers import records

    train = records(muon_run["dir"], "train")
    assert len(train) == 2 * STEPS
    small, grown = [r["loss"] for r in train[:STEPS]], [r["loss"] for r in train[STEPS:]]
    assert small[-1] < small[0] - 0.3 and grown[-1] < grown[0], (small, grown)


def _optimizer_file_state(run_dir, tag: str) -> dict:
    """The optimizer state of a one-process ZeRO-0 checkpoint, read straight from DeepSpeed's file."""
    (path,) = (run_dir / "checkpoints" / tag).glob("mp_rank_00_model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["optimizer"]["state"]


def test_resharding_through_zero2_on_two_ranks_keeps_muons_state_exactly(muon_run, monkeypatch):
    """The run resharded to two ranks at ZeRO 2 (Muon's momentum as whole matrices per rank, a matrix
    split between the partitions held by both), then back to one process at ZeRO 0: each reshard
    checks its own checkpoints against the source's state, and the round trip's file holds the
    source's momentum, moments and step counts, tensor by tensor."""
    from launch_helpers import convert, ok

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    src, tmp = muon_run["dir"], muon_run["tmp"]
    there = ok(convert("reshard", src, tmp / "zero2", "--num-gpus", 2, "--zero-stage", 2))
    said = "phase01-step0000006: optimizer state momentum_buffer, exp_avg, exp_avg_sq at step 12: the source's, exactly"
    assert said in there.stdout
    ok(convert("reshard", tmp / "zero2", tmp / "back", "--num-gpus", 1, "--zero-stage", 0))
    tag = (src / "checkpoints" / "latest").read_text().strip()
    source, back = _optimizer_file_state(src, tag), _optimizer_file_state(tmp / "back", tag)
    assert source.keys() == back.keys()
    kinds = set()
    for index, state in source.items():
        assert state.keys() == back[index].keys(), index
        kinds.add(tuple(sorted(state)))
        for key in set(state) - {"step"}:
            assert torch.equal(state[key], back[index][key]), (index, key)
    assert kinds == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}
    # DeepSpeed's FusedAdam counts on each group's last parameter; a written state holds the count on all
    steps = [max(int(state["step"]) for state in file.values() if "step" in state) for file in (source, back)]
    assert steps == [2 * STEPS, 2 * STEPS]


def test_to_megatron_writes_the_model_and_refuses_muons_state_in_one_line(muon_run, monkeypatch):
    """Megatron-Core keeps its Muon as a chained optimizer of its own split: the model is written (and
    verified by its logits), Muon's state is not, and one line says so."""
    from launch_helpers import convert, ok

    from megatron_multilevel.checkpoints.megatron_dist import MUON_NOT_WRITTEN, read

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    out = muon_run["tmp"] / "megatron"
    result = ok(convert("to-megatron", muon_run["dir"], out))
    assert result.stdout.count(MUON_NOT_WRITTEN) == 1
    assert json.loads((out / "megatron_multilevel.json").read_text())["optimizer"] == []
    assert read(str(out)).moments == {}


@pytest.mark.slow
def test_two_pipeline_stages_train_the_one_process_muon_v_cycle(corpus, tmp_path):
    """A V-cycle with Muon's state mapped, over two pipeline stages (each stage's matrices whole):
    the one-process run's losses, record by record."""
    from launch_helpers import SAME_RUN, launch, losses, ok, run_config

    multilevel = {"enabled": True, "num_levels": 2, "alpha": 0.5, "width_pairing": "adjacent", "optimizer_state": "map",
                  "levels": [{"steps_before": 3, "lr_before": {"peak": 2e-3, "warmup_steps": 1}, "steps_after": 3},
                             {"steps_before": 3, "lr_before": {"peak": 2e-3}}]}
    optimizer = {"type": "Muon", "params": {"lr": 2e-3, "muon_lr": 0.02, "torch_adam": True}}
    runs = {}
    for name, parallel, procs in (("one", {}, 1), ("pp2", {"pipeline_model_parallel_size": 2}, 2)):
        config = run_config(tmp_path, corpus, name, optimizer=optimizer, gradient_clipping=0.0, parallel=parallel,
                            multilevel=multilevel)
        ok(launch(config, "--num_procs", procs, env={"TORCH_COMPILE_DISABLE": "1"}))
        runs[name] = losses(tmp_path / name)
    assert [r[:2] for r in runs["pp2"]] == [r[:2] for r in runs["one"]] and len(runs["one"]) > 6
    assert [r[2] for r in runs["pp2"]] == pytest.approx([r[2] for r in runs["one"]], **SAME_RUN)
