"""The check of every transition (``training/transition_check.py``): the loss on a fixed held-out
batch before, just after and some steps after each transition, in the metrics, the summary and
the console; a function-preserving transition that moves it stops the run."""

import json

import pytest
import torch

from launch_helpers import launch, ok, records, run_config

# An F-cycle grown function-preservingly (depth only, the new layers the identity), then
# coalesced and de-coalesced (which change the function by design).
F_IDENTITY = {"enabled": True, "cycle": "f", "num_levels": 2, "alpha": 1.0, "coalesce_width": False,
              "depth_pairing": "halves", "depth_scaling": "identity",
              "levels": [{"steps_before": 4, "lr_before": {"peak": 2e-3, "warmup_steps": 0},
                          "steps_after": 4, "lr_after": {"peak": 2e-3, "warmup_steps": 0}},
                         {"steps_before": 5, "lr_before": {"peak": 4e-3, "warmup_steps": 1}}]}
CHECK = {"output_dir": None, "transition_check_steps": 2, "log_interval": 2, "eval_interval": 100,
         "eval_batches": 2, "save_interval": 100, "seed": 5, "keep_checkpoints": 100}

# Planted in every process of a run (a ``sitecustomize`` on its PYTHONPATH): the growth's new layer
# is no longer the identity, its weights (residual outputs included) moved by a pattern of size 0.01
# (not a constant: a uniform shift of the residual stream is what LayerNorm removes)
PLANTED = '''
import torch
import megatron_multilevel.parallel.transition as transition
_decoalesce_layer = transition.decoalesce_layer
def _planted(coarse, level_map, member=0, **kwargs):
    out = _decoalesce_layer(coarse, level_map, member, **kwargs)
    if member == 1:
        out = {name: t + 0.01 * torch.sin(torch.arange(t.numel(), dtype=t.dtype)).reshape(t.shape)
               for name, t in out.items()}
    return out
transition.decoalesce_layer = _planted
'''


def _check_batch_loss(run_dir, tag: str, num_layers: int) -> float:
    """The loss of a checkpoint's model on the validation split's first global batch, computed here
    from its files (one process, the data read as Megatron's dataset builder lays it out)."""
    from megatron_multilevel.checkpoints.convert import load_source
    from megatron_multilevel.checkpoints.verify import single_process_model
    from megatron_multilevel.config import load_config
    from megatron_multilevel.data.datasets import build_data, micro_batches, sample_indices

    source = load_source(str(run_dir / "checkpoints" / tag))
    assert source.model.num_layers == num_layers
    cfg = load_config(json.loads((run_dir / "config.json").read_text()))
    steps = json.loads((run_dir / "summary.json").read_text())["totals"]["steps"]
    data = build_data(cfg, train_samples=8 * steps, valid_samples=8 * cfg.training.eval_batches)  # as the run
    batch = micro_batches(data.valid, "gpt", sample_indices(0, 0, global_batch=8, micro_batch=8, dp_rank=0,
                                                            accumulation=1))
    from megatron_multilevel.models import language_model_loss

    model = single_process_model(source.tensors, source.model)
    with torch.no_grad():
        return language_model_loss(model, source.model, batch.tokens, batch.labels, batch.loss_mask).item()


def test_every_transition_is_checked_and_a_growth_keeps_the_loss(corpus, tmp_path):
    training = {**CHECK, "output_dir": str(tmp_path / "run")}
    out = ok(launch(run_config(tmp_path, corpus, "run", multilevel=F_IDENTITY, training=training))).stdout
    checks = records(tmp_path / "run", "transition")
    # grow (level 1 -> 0), coalesce (0 -> 1), de-coalesce (1 -> 0): the returns at alpha 1 with
    # identity layers preserve the function, coalescing does not
    assert [(r["from_level"], r["level"], r["preserves_function"]) for r in checks] == [
        (1, 0, True), (0, 1, False), (1, 0, True)]
    grown = checks[0]
    assert abs(grown["jump"]) < 1e-5 and abs(checks[2]["jump"]) < 1e-5 and abs(checks[1]["jump"]) > 1e-4
    assert f"[level 1 -> 0] loss on the check batch {grown['loss_before']:.4f} -> {grown['loss_after']:.4f} " \
           f"(function-preserving, jump" in out
    assert len(records(tmp_path / "run", "transition_settled")) == 3
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [p.get("transition_check") for p in summary["phases"]]
    assert rows[0] is None and all(r["after_steps"] is not None and r["steps"] == 2 for r in rows[1:])
    # against an independent computation: the coarse model at the end of its phase, on that batch
    assert grown["loss_before"] == pytest.approx(_check_batch_loss(tmp_path / "run", "phase00-step0000005", 2),
                                                 rel=1e-5)


def test_a_planted_bug_in_a_function_preserving_growth_stops_the_run(corpus, tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(PLANTED)
    training = {**CHECK, "output_dir": str(tmp_path / "run")}
    config = run_config(tmp_path, corpus, "run", multilevel=F_IDENTITY, training=training)
    result = launch(config, env={"PYTHONPATH": str(planted)})
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "preserves the function, but the loss on the check batch moved" in errors[0], \
        result.stderr[-3000:]
    # warned only, the same run goes on to its end
    warn = {**training, "output_dir": str(tmp_path / "warned"), "transition_check": "warn"}
    config = run_config(tmp_path, corpus, "warned", multilevel=F_IDENTITY, training=warn)
    result = ok(launch(config, env={"PYTHONPATH": str(planted)}))
    assert "warning: the transition into phase 2 (level 1 -> 0) preserves the function" in result.stdout
    assert "done: final validation loss" in result.stdout
