"""The ODE strategy end to end through the real launcher: phases, schedules, FLOPs, checkpoints at
every transition, resume after a kill anywhere, SGD and AdamW, GPT and BERT, two processes."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

from launch_helpers import (ROOT, SAME_RUN, assert_close_to_reference, launch, losses, make_corpus, module_states,
                            preprocess, records, small_config)

SEQ, GLOBAL_BATCH = 32, 8
ODE = {
    "cycles": 2, "pre_steps": 2, "coarse_steps": 3, "post_steps": 2, "final_steps": 2,
    "fine_lr": {"peak": 2e-3, "decay": "constant"}, "coarse_lr": {"peak": 4e-3, "decay": "constant"},
    "final_lr": {"peak": 1e-3, "decay": "constant"},
}
# AdamW, moments mapped, coherence (ungated: installed every cycle) and line search on: every piece
# of state a resume needs
FULL = {**ODE, "optimizer_state": "map", "coherence": "first_order", "coherence_max_ratio": None, "line_search": True,
        "prolongation": "linear"}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    inputs = make_corpus(tmp / "corpus")
    assert preprocess(inputs, tmp / "gpt").returncode == 0
    bert = preprocess(inputs, tmp / "bert", split_sentences=True, tokenizer_model=str(tmp / "gpt.model"))
    assert bert.returncode == 0, bert.stderr
    return {"gpt": str(tmp / "gpt"), "bert": str(tmp / "bert"), "model": str(tmp / "gpt.model")}


def _config(tmp_path, corpus, name, *, ode, kind="gpt", **blocks):
    """The tests' tiny run (4 layers, hidden 64) with the ODE strategy's block."""
    path = small_config(tmp_path / f"{name}.json", kind=kind, prefix=corpus[kind], tokenizer_model=corpus["model"],
                        output_dir=tmp_path / name, **blocks)
    config = json.loads(path.read_text())
    config["multilevel"] = {"enabled": True, "strategy": "ode", "ode": ode}
    path.write_text(json.dumps(config, indent=1))
    return path


def _tool(name, *args):
    """``tools/NAME ARGS`` with this interpreter; output captured."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def _summary(run):
    return json.loads((run / "summary.json").read_text())


def _uninterrupted(tmp, corpus, ode: dict) -> dict:
    """A one-process run of the ODE block ``ode`` that keeps every checkpoint."""
    training = {"output_dir": str(tmp / "run"), "log_interval": 1, "eval_interval": 4, "eval_batches": 2,
                "save_interval": 3, "seed": 5, "keep_checkpoints": 100}
    result = _ok(launch(_config(tmp, corpus, "run", ode=ode, training=training)))
    return {"dir": tmp / "run", "stdout": result.stdout}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    return _uninterrupted(tmp_path_factory.mktemp("reference"), corpus, FULL)


# The coarse step in the forward pass, the coarse weights copied: the same coarse function at restriction
EXPLICIT = {**FULL, "parametrisation": "explicit"}


@pytest.fixture(scope="module")
def explicit_reference(tmp_path_factory, corpus):
    return _uninterrupted(tmp_path_factory.mktemp("explicit"), corpus, EXPLICIT)


def _flops(num_layers):
    from megatron_multilevel.config import ModelConfig
    from megatron_multilevel.flops import flops_per_token

    cfg = ModelConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4, vocab_size=512,
                      max_sequence_length=SEQ)
    return flops_per_token(cfg, SEQ) * SEQ * GLOBAL_BATCH  # one step


def test_one_process_ode_cycles(reference):
    run, out = reference["dir"], reference["stdout"]
    summary = _summary(run)
    phases = summary["phases"]
    assert summary["strategy"] == "ode"
    assert [(p["level"], p["name"], p["steps"]) for p in phases] == [
        (0, "pre", 2), (1, "coarse", 3), (0, "post", 2), (0, "pre", 2), (1, "coarse", 3), (0, "post", 2),
        (0, "final", 2)]
    assert [p.get("fine_layers") for p in phases if p["level"] == 1] == [[0, 2], [1, 3]]  # alternating
    assert [p["model"]["num_layers"] for p in phases] == [4, 2, 4, 4, 2, 4, 4]
    assert {p["model"]["hidden_size"] for p in phases} == {64}
    assert "restricted to the even fine layers [0, 2] of 4" in out and "restricted to the odd fine layers [1, 3]" in out
    assert out.count("prolonged (linear") == 2 and out.count("carried over with its optimizer state") == 2
    # each phase trains at its own schedule
    lrs = {(r["phase"], r["lr"]) for r in records(run, "train")}
    assert lrs == {(0, 2e-3), (1, 4e-3), (2, 2e-3), (3, 2e-3), (4, 4e-3), (5, 2e-3), (6, 1e-3)}
    # FLOPs: coarse steps have half the layers; coherence costs a fine and a coarse step, the line
    # search a fine forward pass (a third of a step) per loss
    fine, coarse = _flops(4), _flops(2)
    searches = records(run, "line_search")
    assert [r["phase"] for r in searches] == [2, 5]
    for p in phases:
        extra = 0.0
        if p["name"] == "coarse":
            extra = fine + coarse + fine / 3
        elif p["name"] == "post":
            extra = fine / 3 * len(searches[p["cycle"]]["losses"])
        assert p["extra_flops"] == pytest.approx(extra, rel=1e-12), p
        assert p["flops"] == pytest.approx(p["steps"] * (coarse if p["level"] else fine) + extra, rel=1e-12), p
    totals = summary["totals"]
    assert totals["flops"] == pytest.approx(sum(p["flops"] for p in phases), rel=1e-12)
    assert records(run, "train")[-1]["flops"] == pytest.approx(totals["flops"], rel=1e-12)
    # a checkpoint at the end of every phase, i.e. at every transition
    ckpts = run / "checkpoints"
    for p in phases:
        assert (ckpts / f"phase{p['phase']:02d}-step{p['steps']:07d}").is_dir(), p
    coarse_ckpt = ckpts / "phase01-step0000001"  # periodic, mid coarse phase
    sidecar = json.loads((coarse_ckpt / "multilevel.json").read_text())
    assert json.loads(sidecar["selection"])["parity"] == 0 and sidecar["state"]["open_levels"] == {"0": "phase00-step0000002"}
    assert "reference_loss" in sidecar["state"]["ode"] and (coarse_ckpt / "coherence.pt").is_file()
    # the coherence diagnostics: measured at every restriction (ungated here: installed), and the
    # coarse phase's change at every prolongation, in the metrics, the summary rows and the console
    measured = records(run, "coherence")
    assert [(r["phase"], r["cycle"], r["installed"], r["max_ratio"]) for r in measured] == [
        (1, 0, True, None), (4, 1, True, None)]
    for r in measured:
        assert 0 < r["rho"] < float("inf") and -1 <= r["cosine"] <= 1 and r["v_norm"] > 0, r
        assert r["v_norm"] == pytest.approx(r["rho"] * r["fine_grad_norm"], rel=1e-9)
    assert [p["coherence"]["rho"] for p in phases if p["name"] == "coarse"] == [r["rho"] for r in measured]
    changes = records(run, "coarse_change")
    assert [r["phase"] for r in changes] == [1, 4]
    assert all(r["norm"] > 0 and isinstance(r["v_dot"], float) and not r["bounded"] for r in changes), changes
    assert [p["coarse_change"]["norm"] for p in phases if p["name"] == "post"] == [r["norm"] for r in changes]
    assert out.count("first-order term on") == 2 and out.count("|P change|") == 2
    # every return to the fine level is scored at once, and the run learns
    valid = records(run, "valid")
    assert [(r["phase"], r["step"]) for r in valid if r["step"] == 0] == [(2, 0), (5, 0)]
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3


def test_a_closed_gate_is_the_run_without_the_term(reference, corpus, tmp_path):
    """``coherence_max_ratio`` below every rho: the term is measured (and its passes counted) but never
    installed, so the run is the one with ``coherence: none`` step for step; nothing is saved for it
    and the console says so."""
    training = {"log_interval": 1, "eval_interval": 4, "eval_batches": 2, "save_interval": 3, "seed": 5,
                "keep_checkpoints": 100}
    runs = {}
    for name, ode in (("gated", {**FULL, "coherence_max_ratio": 1e-9}), ("none", {**FULL, "coherence": "none"})):
        config = _config(tmp_path, corpus, name, ode=ode, training={**training, "output_dir": str(tmp_path / name)})
        runs[name] = _ok(launch(config)).stdout
    gated = tmp_path / "gated"
    assert_close_to_reference(gated, {"dir": tmp_path / "none"}, **SAME_RUN)
    assert runs["gated"].count("the coarse loss alone this phase") == 2 and "first-order term on" not in runs["gated"]
    assert [r["installed"] for r in records(gated, "coherence")] == [False, False]
    # the first restriction measures what the ungated reference measured there (the same point)
    assert records(gated, "coherence")[0]["rho"] == pytest.approx(records(reference["dir"], "coherence")[0]["rho"],
                                                                   rel=1e-6)
    assert not list(gated.glob("checkpoints/*/coherence.pt"))
    assert all(r["v_dot"] is None for r in records(gated, "coarse_change"))
    extra = [p["extra_flops"] for p in _summary(gated)["phases"] if p["name"] == "coarse"]
    assert extra == [p["extra_flops"] for p in _summary(reference["dir"])["phases"] if p["name"] == "coarse"]
    # killed mid coarse phase, the resumed run installs no term either (and looks for no vector)
    (tmp_path / "resumed").mkdir()
    resumed = _crash_and_resume(tmp_path / "resumed", corpus, "step4", {**FULL, "coherence_max_ratio": 1e-9},
                                training={**training, "output_dir": str(tmp_path / "resumed" / "run")})
    assert [r["phase"] for r in records(resumed, "resume")] == [1]
    _assert_same_run(resumed, gated, **SAME_RUN)


def test_the_trust_radius_bounds_the_written_back_change(corpus, tmp_path):
    """``trust_radius`` far below the coarse phases' changes: each is scaled to the radius (the record
    says by how much), so the fine model comes back as it was, its validation loss with it."""
    training = {"output_dir": str(tmp_path / "run"), "log_interval": 1, "eval_interval": 4, "eval_batches": 2,
                "seed": 5}
    radius = 1e-4
    out = _ok(launch(_config(tmp_path, corpus, "run", ode={**ODE, "trust_radius": radius}, training=training))).stdout
    run = tmp_path / "run"
    changes = records(run, "coarse_change")
    assert len(changes) == 2 and all(r["bounded"] and r["norm"] > 100 * radius for r in changes), changes
    assert [r["correction_scale"] for r in changes] == pytest.approx([radius / r["norm"] for r in changes], rel=1e-9)
    assert out.count("(bounded by multilevel.ode.trust_radius)") == 2
    phases, valid = _summary(run)["phases"], records(run, "valid")
    for post in (p for p in phases if p["name"] == "post"):
        coarse = phases[post["phase"] - 1]
        before = phases[post["phase"] - 2]["valid_loss"]  # the fine model the coarse phase started from
        after = next(r["loss"] for r in valid if r["phase"] == post["phase"] and r["step"] == 0)
        assert abs(after - before) < 1e-3 < abs(coarse["valid_loss"] - before), (before, after, coarse["valid_loss"])


def _crash_and_resume(tmp_path, corpus, crash_at, ode, **blocks):
    config = _config(tmp_path, corpus, "run", ode=ode, **blocks)
    crashed = launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": crash_at})
    assert crashed.returncode != 0
    resumed = _ok(launch(config))
    assert "resuming from" in resumed.stdout
    return tmp_path / "run"


def _assert_same_run(run, reference_dir, **tol):
    """Every train and valid loss of ``run`` equal to the reference's: ``SAME_RUN`` in one layout,
    the layout tests' ``abs=2e-4`` across layouts."""
    assert_close_to_reference(run, {"dir": reference_dir}, **tol)
    assert _summary(run)["totals"]["final_valid_loss"] == pytest.approx(
        _summary(reference_dir)["totals"]["final_valid_loss"], **tol)


# Global steps: pre 1-2, coarse 3-5 (a checkpoint at 3), post 6-7, pre 8-9, coarse 10-12, post 13-14, final 15-16.
# The kills during a transition are slow; mid-coarse resumes the coarse model and its restriction.
def test_the_trainers_coherence_term_is_mg_opts(reference):
    """The vector the trainer installed at the first restriction (``coherence.pt``) is ``P^T grad
    L_fine(theta) - grad L_coarse(R theta)`` on the first coarse step's batch, computed here apart
    from the trainer: the fine model of the checkpoint at restriction, its gradient restricted by
    hand for ``linear`` prolongation at residual scale 2 (coarse layer 0 = fine 0 + fine 1 / 2,
    coarse layer 1 = fine 2 + fine 1 / 2 + fine 3, the residual-branch outputs halved), the coarse
    model built from fine layers 0 and 2 with those outputs doubled."""
    _check_coherence_vector(reference["dir"], batches=1)


def test_the_coherence_term_averaged_over_batches(corpus, tmp_path):
    """``coherence_batches`` 3: the vector is the mean over the coarse phase's first three batches
    (gradients of both models on each), and its six passes count in the FLOPs."""
    training = {"output_dir": str(tmp_path / "run"), "log_interval": 1, "eval_interval": 4, "eval_batches": 2,
                "save_interval": 1, "seed": 5, "keep_checkpoints": 100}
    _ok(launch(_config(tmp_path, corpus, "run", ode={**FULL, "coherence_batches": 3}, training=training)))
    _check_coherence_vector(tmp_path / "run", batches=3)
    coarse_phases = [p for p in _summary(tmp_path / "run")["phases"] if p["name"] == "coarse"]
    fine, coarse = _flops(4), _flops(2)
    for p in coarse_phases:  # and the line search's fine forward pass
        assert p["extra_flops"] == pytest.approx(3 * (fine + coarse) + fine / 3, rel=1e-12)


def _check_coherence_vector(run, *, batches: int, explicit: bool = False) -> None:
    """The trainer's first coherence vector against MG/OPT's, averaged over ``batches`` batches;
    ``explicit``: nothing scaled, the coarse model taking its step x2 in the forward pass instead."""
    from megatron_multilevel.config import load_config
    from megatron_multilevel.data.datasets import build_data, micro_batches
    from megatron_multilevel.distributed import init_single_process
    from megatron_multilevel.models import build_model, language_model_loss
    from megatron_multilevel.residual_step import set_residual_step

    cfg = load_config(json.loads((run.parent / "run.json").read_text()))
    init_single_process()
    total = ODE["cycles"] * (ODE["pre_steps"] + ODE["coarse_steps"] + ODE["post_steps"]) + ODE["final_steps"]
    data = build_data(cfg, train_samples=total * GLOBAL_BATCH, valid_samples=2 * GLOBAL_BATCH)
    step = ODE["pre_steps"]  # the first coarse step's global step
    batches = [micro_batches(data.train, "gpt", range(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH))
               for s in range(step, step + batches)]
    residual = ("self_attention.linear_proj.", "mlp.linear_fc2.")

    def gradient(model_cfg, params, step=1):
        """The mean gradient over the batches."""
        model = set_residual_step(build_model(model_cfg), step)
        missing, unexpected = model.load_state_dict(params, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing)
        for batch in batches:
            loss = language_model_loss(model, model_cfg, batch.tokens, batch.labels, batch.loss_mask)
            (loss / len(batches)).backward()
        return {n: p.grad.double() for n, p in model.named_parameters()}

    fine = module_states(run / "checkpoints" / f"phase00-step{step:07d}")
    g = gradient(cfg.model, fine)

    def layer(source, i):
        prefix = f"decoder.layers.{i}."
        return {n[len(prefix):]: t for n, t in source.items() if n.startswith(prefix)}

    def scaled(values, factor):
        return {n: t * factor if n.startswith(residual) else t for n, t in values.items()}

    shared = {n: t for n, t in g.items() if not n.startswith("decoder.layers.")}
    sums = [{n: g0 + g1 / 2 for (n, g0), g1 in zip(layer(g, 0).items(), layer(g, 1).values())},
            {n: g2 + g1 / 2 + g3 for (n, g2), g1, g3 in zip(layer(g, 2).items(), layer(g, 1).values(),
                                                           layer(g, 3).values())}]
    weights = 1.0 if explicit else 2.0  # the step folded into the weights or not
    restricted = dict(shared)
    for i, values in enumerate(sums):
        restricted.update({f"decoder.layers.{i}.{n}": t for n, t in scaled(values, 1 / weights).items()})
    coarse_params = {n: t for n, t in fine.items() if not n.startswith("decoder.layers.")}
    for i, j in enumerate((0, 2)):
        coarse_params.update({f"decoder.layers.{i}.{n}": t for n, t in scaled(layer(fine, j), weights).items()})
    coarse_cfg = dataclasses.replace(cfg.model, num_layers=2)
    g_coarse = gradient(coarse_cfg, coarse_params, step=2 if explicit else 1)
    installed = torch.load(run / "checkpoints" / f"phase01-step{1:07d}" / "coherence.pt", weights_only=True)
    assert set(installed) == set(g_coarse)
    for name, v in installed.items():
        expected = restricted[name] - g_coarse[name]
        assert torch.allclose(v.double(), expected, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("crash_at, resumed_phase, explicit", [
    pytest.param("step4", 1, False, id="mid-coarse"),
    pytest.param("transition2", 1, False, id="during-prolongation", marks=pytest.mark.slow),
    pytest.param("transition4", 3, False, id="during-restriction", marks=pytest.mark.slow),
    pytest.param("step4", 1, True, id="explicit-mid-coarse", marks=pytest.mark.slow),
])
def test_resume_after_kill_follows_the_same_trajectory(request, corpus, tmp_path, crash_at, resumed_phase, explicit):
    """Explicit: the resumed coarse model takes its step in the forward pass again."""
    training = {"output_dir": str(tmp_path / "run"), "log_interval": 1, "eval_interval": 4, "eval_batches": 2,
                "save_interval": 3, "seed": 5, "keep_checkpoints": 100}
    run = _crash_and_resume(tmp_path, corpus, crash_at, EXPLICIT if explicit else FULL, training=training)
    assert [r["phase"] for r in records(run, "resume")] == [resumed_phase]
    _assert_same_run(run, request.getfixturevalue("explicit_reference" if explicit else "reference")["dir"], **SAME_RUN)


def test_the_explicit_step_starts_from_the_same_function_and_trains_otherwise(reference, explicit_reference):
    """Against the folded run of the same config: the same fine steps, the same loss on the first
    coarse batch (the same coarse function), then other losses (other gradients: the explicit
    coarse model's residual-branch parameters move the function twice as much per step); it learns,
    and its coherence vector is MG/OPT's with nothing scaled."""
    run, folded = explicit_reference["dir"], reference["dir"]
    assert "restricted to the even fine layers [0, 2] of 4, residual-branch outputs x2 in the forward pass" in \
        explicit_reference["stdout"]
    sidecar = json.loads((run / "checkpoints" / "phase01-step0000001" / "multilevel.json").read_text())
    assert json.loads(sidecar["selection"])["parametrisation"] == "explicit"
    ours, theirs = ({r["global_step"]: r["loss"] for r in records(d, "train")} for d in (run, folded))
    assert [ours[s] for s in (1, 2)] == [theirs[s] for s in (1, 2)]  # fine, before any coarse step
    assert ours[3] == pytest.approx(theirs[3], abs=1e-6)  # the coarse model at the restricted point
    assert all(abs(ours[s] - theirs[s]) > 1e-5 for s in (4, 5))
    valid = records(run, "valid")
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3
    _check_coherence_vector(run, batches=1, explicit=True)


@pytest.mark.slow
def test_at_residual_scale_1_the_parametrisations_are_one_run(corpus, tmp_path):
    """No step to fold or to take: the explicit and folded runs are the same run, loss for loss."""
    ode = {**ODE, "cycles": 1, "residual_scale": 1, "optimizer_state": "map"}
    for name in ("folded", "explicit"):
        _ok(launch(_config(tmp_path, corpus, name, ode={**ode, "parametrisation": name})))
    assert losses(tmp_path / "explicit") == losses(tmp_path / "folded")
    assert [p["level"] for p in _summary(tmp_path / "explicit")["phases"]] == [0, 1, 0, 0]


@pytest.fixture(scope="module")
def sgd_reference(tmp_path_factory, corpus):
    """SGD with momentum kept across the coarse phases, always the even layers, constant prolongation."""
    tmp = tmp_path_factory.mktemp("sgd")
    ode = {**ODE, "optimizer_state": "keep", "coarse": "even", "prolongation": "constant",
           "fine_lr": {"peak": 0.05}, "coarse_lr": {"peak": 0.05}, "final_lr": None}
    result = _ok(launch(_config(tmp, corpus, "run", ode=ode, optimizer=SGD)))
    return {"dir": tmp / "run", "stdout": result.stdout, "ode": ode}


def test_sgd_with_momentum_kept(sgd_reference):
    run = sgd_reference["dir"]
    phases = _summary(run)["phases"]
    assert [p.get("fine_layers") for p in phases if p["level"] == 1] == [[0, 2], [0, 2]]
    assert sgd_reference["stdout"].count("prolonged (constant, change x1)") == 2
    valid = records(run, "valid")
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3


@pytest.mark.slow
def test_sgd_resume_mid_coarse_phase(sgd_reference, corpus, tmp_path):
    """Killed in the first coarse phase after its checkpoint at global step 3: the kept momentum of
    the fine model comes back from the checkpoint before the coarse phase."""
    run = _crash_and_resume(tmp_path, corpus, "step5", sgd_reference["ode"], optimizer=SGD)
    assert [r["phase"] for r in records(run, "resume")] == [1]
    _assert_same_run(run, sgd_reference["dir"], **SAME_RUN)


@pytest.mark.slow
def test_bert_sgd_without_momentum(corpus, tmp_path):
    ode = {**ODE, "coherence": "first_order", "line_search": True, "optimizer_state": "keep", "fine_lr": {"peak": 0.1},
           "coarse_lr": {"peak": 0.1}, "final_lr": None}
    optimizer = {"type": "SGD", "params": {"lr": 0.1}}
    out = _ok(launch(_config(tmp_path, corpus, "run", kind="bert", ode=ode, optimizer=optimizer))).stdout
    assert "carried over (no optimizer state to carry)" in out
    summary = _summary(tmp_path / "run")
    assert [p["level"] for p in summary["phases"]] == [0, 1, 0, 0, 1, 0, 0]
    valid = records(tmp_path / "run", "valid")
    assert valid[-1]["loss"] < valid[0]["loss"]


def _layout_config(tmp_path, corpus, name, **blocks):
    training = {"output_dir": str(tmp_path / name), "log_interval": 1, "eval_interval": 4, "eval_batches": 2,
                "save_interval": 3, "seed": 5}
    return _config(tmp_path, corpus, name, ode=FULL, training=training, **blocks)


def test_two_processes_tensor_parallel(reference, corpus, tmp_path):
    """TP=2 with ZeRO-1: every rank restricts and prolongs its own shards; the one-process run."""
    config = _layout_config(tmp_path, corpus, "run", parallel={"tensor_model_parallel_size": 2},
                            zero_optimization={"stage": 1})
    _ok(launch(config, "--num_procs", 2))
    _assert_same_run(tmp_path / "run", reference["dir"], abs=2e-4)


@pytest.mark.slow
def test_two_processes_zero3(corpus, tmp_path):
    """DP=2 with ZeRO-3 (parameters gathered one at a time, the fine model kept on disk): the
    one-process ZeRO-3 run. (A ZeRO-3 model is initialised under ``deepspeed.zero.Init``, whose
    plain-torch parameters get their own seeded initialisation, so it does not start from the
    weights a ZeRO-0 run starts from.)"""
    one = _layout_config(tmp_path, corpus, "one", zero_optimization={"stage": 3})
    _ok(launch(one))
    two = _layout_config(tmp_path, corpus, "two", zero_optimization={"stage": 3})
    data = json.loads(two.read_text())
    data["multilevel"]["keep_fine"] = "disk"
    two.write_text(json.dumps(data))
    _ok(launch(two, "--num_procs", 2))
    _assert_same_run(tmp_path / "two", tmp_path / "one", abs=2e-4)
    assert list((tmp_path / "two" / "snapshots" / "level0" / "params").glob("*.rank1.pt"))


# The fine model at TP=2 with ZeRO-1, the coarse models at TP=1 (DP=2) with ZeRO-3.
COARSE_LAYOUT = {"coarse_tensor_model_parallel_size": 1, "coarse_deepspeed": {"zero_optimization": {"stage": 3}}}


def _coarse_layout_config(tmp_path, corpus, name):
    training = {"output_dir": str(tmp_path / name), "log_interval": 1, "eval_interval": 4, "eval_batches": 2,
                "save_interval": 3, "seed": 5, "keep_checkpoints": 100}
    return _config(tmp_path, corpus, name, ode={**FULL, **COARSE_LAYOUT}, training=training,
                   parallel={"tensor_model_parallel_size": 2}, zero_optimization={"stage": 1})


@pytest.fixture(scope="module")
def coarse_layout_run(tmp_path_factory, corpus):
    """Two processes, the coarse models in their own layout; not interrupted."""
    tmp = tmp_path_factory.mktemp("coarse_layout")
    result = _ok(launch(_coarse_layout_config(tmp, corpus, "run"), "--num_procs", 2))
    return {"dir": tmp / "run", "stdout": result.stdout}


def _ranks_of(checkpoint):
    """(tensor-parallel ranks, data-parallel ranks) whose files a checkpoint holds."""
    tp = {p.name.split("mp_rank_")[1][:2] for p in checkpoint.glob("*mp_rank_*_model_states.pt")}
    dp = {p.name.split("_")[3] for p in checkpoint.glob("*optim_states.pt")}
    return len(tp), len(dp)


def test_two_processes_coarse_tensor_parallel_change(reference, coarse_layout_run):
    """Fine TP=2 (ZeRO-1), coarse TP=1 over DP=2 (ZeRO-3): every transition gathers and reshards; AdamW
    moments mapped, coherence and line search on, as the one-process run."""
    run = coarse_layout_run["dir"]
    _assert_same_run(run, reference["dir"], abs=2e-4)
    ckpts = run / "checkpoints"
    assert _ranks_of(ckpts / "phase00-step0000002") == (2, 1)  # fine: two TP shards, one data-parallel rank
    assert _ranks_of(ckpts / "phase01-step0000003") == (1, 2)  # coarse: one TP rank, ZeRO-3 over two
    assert _ranks_of(ckpts / "phase02-step0000002") == (2, 1)


@pytest.mark.slow
def test_coarse_tensor_parallel_change_resumes_on_the_same_trajectory(coarse_layout_run, corpus, tmp_path):
    """Killed mid coarse phase (after its checkpoint at global step 3): the tools read the coarse
    checkpoint in its own layout; the resumed run rebuilds the fine model from the TP=2 checkpoint
    before the coarse phase and the coherence vector at TP=1, and follows the run that was not killed."""
    config = _coarse_layout_config(tmp_path, corpus, "run")
    crashed = launch(config, "--num_procs", 2, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step5"})
    assert crashed.returncode != 0
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text() == "phase01-step0000001"

    info = _tool("inspect_checkpoint.py", run)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "layout: TP=1, ZeRO stage 3" in info.stdout and "the even fine layers [0, 2] of 4" in info.stdout
    full = _tool("convert_checkpoint.py", "to-full", run, tmp_path / "full")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    resumed = _ok(launch(config, "--num_procs", 2))
    assert "resuming from phase01-step0000001" in resumed.stdout
    _assert_same_run(run, coarse_layout_run["dir"], **SAME_RUN)


@pytest.mark.slow
def test_checkpoint_tools_on_a_coarse_phase(corpus, tmp_path):
    """A run killed in its second coarse phase (the odd layers), at TP=2 with ZeRO-1: the tools say
    which fine layers the latest checkpoint holds, consolidate it, refuse to de-coalesce it, and
    reshard the run, which then finishes at the new size."""
    training = {"output_dir": str(tmp_path / "run"), "log_interval": 1, "eval_interval": 100, "eval_batches": 1,
                "save_interval": 11, "seed": 5}
    config = _config(tmp_path, corpus, "run", ode=FULL, training=training,
                     parallel={"tensor_model_parallel_size": 2}, zero_optimization={"stage": 1})
    crashed = launch(config, "--num_procs", 2, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step12"})
    assert crashed.returncode != 0
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text() == "phase04-step0000002"  # global step 11, mid coarse phase

    info = _tool("inspect_checkpoint.py", tmp_path / "run")
    assert info.returncode == 0, info.stderr[-3000:]
    assert "level 1: gpt, 2 layers, hidden 64" in info.stdout and "layout: TP=2, ZeRO stage 1" in info.stdout
    assert "ODE strategy, coarse model: holds the odd fine layers [1, 3] of 4, residual-branch outputs x2" in info.stdout
    out = _tool("convert_checkpoint.py", "to-full", tmp_path / "run", tmp_path / "full")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| source (TP=2) | consolidated (TP=1) |" in out.stdout
    info = _tool("inspect_checkpoint.py", tmp_path / "full", "--json")
    assert json.loads(info.stdout)["ode_selection"]["fine_layers"] == [1, 3]
    out = _tool("convert_checkpoint.py", "decoalesce", tmp_path / "full", tmp_path / "fine")
    assert out.returncode == 2 and "is a coarse model of the ODE strategy (the odd fine layers [1, 3]" in out.stderr
    fine = _tool("convert_checkpoint.py", "to-full", ckpts / "phase03-step0000002", tmp_path / "fine_full")
    assert fine.returncode == 0, fine.stderr[-3000:]
    assert "ode_selection" not in json.loads(_tool("inspect_checkpoint.py", tmp_path / "fine_full", "--json").stdout)
    out = _tool("convert_checkpoint.py", "reshard", tmp_path / "run", tmp_path / "tp1", "--target-tp", 1, "--num-gpus", 1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "tp1" / "checkpoints" / "phase04-step0000002" / "coherence.pt").is_file()
    assert (tmp_path / "tp1" / "checkpoints" / "phase03-step0000002").is_dir()  # the fine model before the phase
    resumed = _ok(launch(tmp_path / "tp1" / "config.json"))
    assert "resuming from phase04-step0000002" in resumed.stdout
    assert [p["level"] for p in _summary(tmp_path / "tp1")["phases"]] == [0, 1, 0, 0, 1, 0, 0]


@pytest.mark.slow
def test_checkpoint_tools_on_an_explicit_coarse_phase(explicit_reference, tmp_path):
    """The explicit coarse model's checkpoint (the fine layers' weights, the step in the forward
    pass): the tools say so, consolidate it, export it to transformers and start a plain 2-layer run
    from it (the step folded into the weights), each checking its logits against the model that
    takes the step; the run as it stood at the end of that phase reshards to TP=2, the new
    checkpoint loaded as the trainer loads it."""
    import shutil

    ckpts = explicit_reference["dir"] / "checkpoints"
    coarse = ckpts / "phase01-step0000003"  # the end of the first coarse phase
    info = _tool("inspect_checkpoint.py", coarse)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "holds the even fine layers [0, 2] of 4, residual-branch outputs x2 in the forward pass" in info.stdout
    run = tmp_path / "run"
    for tag in ("phase00-step0000002", "phase01-step0000003"):  # the coarse checkpoint and the one it needs
        shutil.copytree(ckpts / tag, run / "checkpoints" / tag)
    (run / "checkpoints" / "latest").write_text("phase01-step0000003")
    config = json.loads((explicit_reference["dir"].parent / "run.json").read_text())  # a plain 2-layer run
    config.update(multilevel={"enabled": False}, model={**config["model"], "num_layers": 2})
    config["training"]["train_steps"] = 4
    (tmp_path / "coarse.json").write_text(json.dumps(config))
    for args in (("to-full", coarse, tmp_path / "full"), ("to-hf", coarse, tmp_path / "hf"),
                 ("init-run", coarse, tmp_path / "init", "--config", tmp_path / "coarse.json"),
                 ("reshard", run, tmp_path / "tp2", "--target-tp", 2)):
        out = _tool("convert_checkpoint.py", *args)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    info = _tool("inspect_checkpoint.py", tmp_path / "full", "--json")
    assert json.loads(info.stdout)["ode_selection"]["parametrisation"] == "explicit"


def test_coarse_first_writes_the_change_into_both_layers_of_each_pair(corpus, tmp_path):
    """Nested iteration: no fine step before the first coarse phase, so the coarse model of the even
    layers trains from the initialisation; the ``constant`` prolongation then gives both layers of
    every pair (2k, 2k + 1) coarse layer k's change, residual-branch outputs halved. Checked by hand
    on the checkpoints: the fresh fine model, the coarse model at the end of its phase, the fine
    model after prolongation."""
    ode = {"cycles": 1, "pre_steps": 0, "coarse_steps": 4, "post_steps": 0, "final_steps": 0, "coarse": "even",
           "prolongation": "constant", "optimizer_state": "map", "residual_scale": 2,
           "coarse_lr": {"peak": 4e-3, "warmup_steps": 1, "decay": "constant"}, "fine_lr": {"peak": 2e-3}}
    training = {"output_dir": str(tmp_path / "run"), "log_interval": 1, "eval_interval": 100, "eval_batches": 1,
                "save_interval": 100, "seed": 5, "keep_checkpoints": 100}
    out = _ok(launch(_config(tmp_path, corpus, "run", ode=ode, training=training))).stdout
    assert "prolonged (constant, change x1)" in out
    summary = _summary(tmp_path / "run")
    assert [(p["level"], p["steps"]) for p in summary["phases"]] == [(0, 0), (1, 4), (0, 0)]
    ckpts = tmp_path / "run" / "checkpoints"
    fresh, coarse, fine = (module_states(ckpts / tag) for tag in
                           ("phase00-step0000000", "phase01-step0000004", "phase02-step0000000"))
    residual = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")  # what a coarse layer's step doubles
    layer = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
    checked = 0
    for name, end in coarse.items():
        match = layer.match(name)
        if not match:  # shared: the coarse model started from a copy, so its change is all of it
            assert not torch.equal(end, fresh[name]), name
            torch.testing.assert_close(fine[name], end, rtol=0, atol=1e-6)
            continue
        k, local = int(match.group(1)), match.group(2)
        scale = 2.0 if local in residual else 1.0
        change = (end - scale * fresh[f"decoder.layers.{2 * k}.{local}"]) / scale
        assert change.abs().max() > 0, name
        for j in (2 * k, 2 * k + 1):
            torch.testing.assert_close(fine[f"decoder.layers.{j}.{local}"], fresh[f"decoder.layers.{j}.{local}"] + change,
                                       rtol=0, atol=1e-6)
        checked += 1
    assert checked == 2 * 12 and set(fine) == set(fresh)  # 2 coarse layers of 12 tensors (4 doubled)


def _probe_config(tmp_path, name, **ode):
    """``configs/gpt_ode_coherence_probe.json`` (GPT 12 x 64, SGD 0.1 with momentum 0.9, 4 cycles
    alternating the even and odd coarse models, the embedded corpus) with ``ode`` keys changed."""
    config = json.loads((ROOT / "configs" / "gpt_ode_coherence_probe.json").read_text())
    config["training"]["output_dir"] = str(tmp_path / name)
    config["multilevel"]["ode"].update(ode)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


@pytest.mark.slow
def test_the_gated_coherence_term_does_no_harm(tmp_path):
    """The setting where the ungated term diverges (from the first odd coarse model on, rho is above
    1 and every step length of the written-back change raises the fine loss): with the defaults (the
    gate at 1.0, the line search) no prolongation leaves the fine model more than 0.25 nats above
    where the cycle's coarse phase started, and the run ends within 0.05 of the one without the term."""
    for name, ode in (("gated", {}), ("none", {"coherence": "none"})):
        _ok(launch(_probe_config(tmp_path, name, **ode), timeout=1200))
    run = tmp_path / "gated"
    phases = _summary(run)["phases"]
    valid = records(run, "valid")
    for post in (p for p in phases if p["name"] == "post"):
        before = next(p for p in phases if p["name"] == "pre" and p["cycle"] == post["cycle"])["valid_loss"]
        after = next(r["loss"] for r in valid if r["phase"] == post["phase"] and r["step"] == 0)
        assert after <= before + 0.25, (post["cycle"], before, after)
    measured = records(run, "coherence")
    assert len(measured) == 4 and any(not r["installed"] for r in measured)  # the gate closed somewhere here
    final = _summary(run)["totals"]["final_valid_loss"]
    assert final == pytest.approx(_summary(tmp_path / "none")["totals"]["final_valid_loss"], abs=0.05)
