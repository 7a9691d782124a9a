"""End to end: data preparation, the real launcher on 1 and 2 processes, resume after a kill,
two nodes on localhost, and bad input failing fast."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from launch_helpers import (KEEP_ALL, ROOT, SAME_RUN, assert_close_to_reference, launch, module_states, ok, preprocess,
                            records, run_config)


def test_data_pipeline(corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_multilevel.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(corpus["model"])
    assert tok.vocab_size == 512 and len({tok.eod, tok.pad, tok.cls, tok.sep, tok.mask}) == 5
    gpt, bert = IndexedDataset(corpus["gpt"]), IndexedDataset(corpus["bert"])
    assert len(gpt.document_indices) - 1 == 120  # one document per text file and JSONL line
    assert all(gpt[i][-1] == tok.eod for i in range(len(gpt)))  # GPT: documents end in EOD
    assert len(bert) > len(bert.document_indices) - 1  # BERT: several sentences per document
    text = corpus["inputs"][0].read_text()
    assert tok.detokenize(list(gpt[0][:-1])) == text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no key"}\n')
    result = preprocess([bad], tmp_path / "x", tokenizer_model=corpus["model"])
    assert result.returncode == 1 and "bad.jsonl:2: no 'text' key" in result.stderr
    result = preprocess([tmp_path / "missing.txt"], tmp_path / "x")
    assert result.returncode == 2 and "no input matches" in result.stderr


def test_one_process_v_cycle(reference):
    run, out = reference["dir"], reference["stdout"]
    summary = json.loads((run / "summary.json").read_text())
    assert [p["level"] for p in summary["phases"]] == [0, 1, 0]
    assert [p["model"]["hidden_size"] for p in summary["phases"]] == [64, 32, 64]
    assert [p["steps"] for p in summary["phases"]] == [3, 5, 5]
    totals = summary["totals"]
    fine_only = summary["phases"][0]["flops"] / 3 * 13
    assert totals["flops"] == pytest.approx(sum(p["flops"] for p in summary["phases"]))
    assert totals["flops"] < fine_only  # the coarse steps are cheaper
    # the transitions' time is counted against the phase each leads into, never the first
    phases = summary["phases"]
    assert phases[0]["transition_seconds"] == 0.0 and min(p["transition_seconds"] for p in phases[1:]) > 0
    assert totals["transition_seconds"] == pytest.approx(sum(p["transition_seconds"] for p in phases))
    assert totals["wall_seconds"] == pytest.approx(totals["train_seconds"] + totals["transition_seconds"])
    valid = records(run, "valid")
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3  # it learns
    for shown in ("level 0 -> 1: coalesced", "level 1 -> 0: de-coalesced", "tok/s", "eta", "[level 1 | phase 2/3"):
        assert shown in out
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "latest").read_text().startswith("phase02")
    plot = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(run)], capture_output=True,
                          text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    for name in ("steps", "flops", "seconds"):
        assert (run / "plots" / f"loss_vs_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _crash_and_resume(tmp_path, corpus, crash_at, **blocks):
    config = run_config(tmp_path, corpus, "run", **blocks)
    crashed = launch(config, env={"MEGATRON_MULTILEVEL_CRASH_AT": crash_at})
    assert crashed.returncode != 0
    resumed = ok(launch(config))
    assert "resuming from" in resumed.stdout
    # a kill, even in the middle of a save, never leaves a checkpoint marked complete that is not
    assert "is damaged" not in resumed.stdout, resumed.stdout[-3000:]
    return tmp_path / "run"


# Where a kill lands (the trainer's fault injection), and the checkpoint phase each resume starts from:
# global step 7 in the coarse phase; coalescing into phase 1 (the coarse model built, its engine not
# yet); de-coalescing into phase 2; and inside the save at global step 6 (phase 1, step 3), after
# DeepSpeed wrote its files and before the checkpoint is marked complete, so the resume must skip
# that half-written checkpoint and coalesce again from the one before. mid-phase and during-prolong
# are slow: the kill during coalescing and the one while a checkpoint is being written cover the
# resume path in the default set.
@pytest.mark.parametrize("crash_at, resumed_phase", [
    pytest.param("step7", 1, id="mid-phase", marks=pytest.mark.slow),
    pytest.param("transition1", 0, id="during-coalesce"),
    pytest.param("transition2", 1, id="during-prolong", marks=pytest.mark.slow),
    pytest.param("save:phase01-step0000003", 0, id="mid-save"),
])
def test_resume_after_kill_follows_the_same_trajectory(reference, corpus, tmp_path, crash_at, resumed_phase):
    run = _crash_and_resume(tmp_path, corpus, crash_at)
    assert [r["phase"] for r in records(run, "resume")] == [resumed_phase]
    assert_close_to_reference(run, reference, **SAME_RUN)
    assert json.loads((run / "summary.json").read_text())["phases"][-1]["valid_loss"] == pytest.approx(
        json.loads((reference["dir"] / "summary.json").read_text())["phases"][-1]["valid_loss"], **SAME_RUN
    )


# Two launches of the same run can differ in the float32 losses' last bits (seen in CI: 1.2e-6
# relative, in phases before any kill, as in test_first_hour); a resume that lost any state (data
# position, RNG, optimizer, schedule) moves them by orders of magnitude more. SAME_RUN is the
# relative tolerance of a resumed run against the uninterrupted one in the same layout.
@pytest.fixture(scope="module")
def w_reference(tmp_path_factory, corpus):
    """An uninterrupted one-process GPT W-cycle over 2 levels: what its resumes must match."""
    tmp = tmp_path_factory.mktemp("w_reference")
    result = ok(launch(run_config(tmp, corpus, "run", multilevel={"cycle": "w"})))
    return {"dir": tmp / "run", "stdout": result.stdout}


def test_w_cycle(w_reference):
    run, out = w_reference["dir"], w_reference["stdout"]
    phases = json.loads((run / "summary.json").read_text())["phases"]
    assert [p["level"] for p in phases] == [0, 1, 0, 1, 0]
    assert [p["name"] for p in phases] == ["before", "coarsest", "before", "coarsest", "after"]
    assert [p["steps"] for p in phases] == [3, 5, 3, 5, 5]
    assert out.count("level 0 -> 1: coalesced") == 2
    assert out.count("level 1 -> 0: de-coalesced and interpolated (alpha 0.5)") == 2
    valid = records(run, "valid")
    # every phase that starts by de-coalescing is scored at its step 0
    assert [(r["phase"], r["global_step"]) for r in valid if r["step"] == 0] == [(2, 8), (4, 16)]
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3
    plot = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(run)], capture_output=True,
                          text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr


@pytest.mark.parametrize("crash_at", [
    pytest.param("step14", id="second-coarse-visit", marks=pytest.mark.slow),
    pytest.param("transition4", id="during-last-prolong", marks=pytest.mark.slow),
])
def test_w_cycle_resume_after_kill(w_reference, corpus, tmp_path, crash_at):
    """Killed in the second coarse visit (phase 3, global steps 12-16) or de-coalescing after it:
    the resume rebuilds level 0 as it was before its second coalescing (phase 2), not its first."""
    run = _crash_and_resume(tmp_path, corpus, crash_at, multilevel={"cycle": "w"})
    assert [r["phase"] for r in records(run, "resume")] == [3]
    assert_close_to_reference(run, w_reference, **SAME_RUN)
    assert json.loads((run / "summary.json").read_text())["phases"][-1]["valid_loss"] == pytest.approx(
        json.loads((w_reference["dir"] / "summary.json").read_text())["phases"][-1]["valid_loss"], **SAME_RUN
    )


def test_f_cycle(corpus, tmp_path):
    """Full multigrid over 2 levels, mapping AdamW's moments: the first arrival at the fine level
    grows it (alpha 1, AdamW afresh), the second interpolates and maps. On one learning-rate
    schedule over the run (``lr_schedule = "continue"``): the rate each step applied, as the
    optimizer held it, is the run-wide cosine at each level's peak, with the fine level's warm-ups
    as re-warm-ups."""
    config = run_config(tmp_path, corpus, "run", multilevel={"cycle": "f", "optimizer_state": "map",
                                                          "lr_schedule": "continue"},
                     training={"log_interval": 1})
    out = ok(launch(config)).stdout
    phases = json.loads((tmp_path / "run" / "summary.json").read_text())["phases"]
    assert [p["level"] for p in phases] == [1, 0, 1, 0]
    assert [p["steps"] for p in phases] == [5, 3, 5, 5]
    grown = out.index("level 1 -> 0: de-coalesced, grown (alpha 1.0)")
    assert out.index("level 1 -> 0: de-coalesced and interpolated (alpha 0.5)") > grown
    valid = records(tmp_path / "run", "valid")
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3
    # 18 steps, no warm-up in the first phase (the coarsest's): 0.1 + 0.45 (1 + cos(pi g / 18));
    # peaks 4e-3 (coarse) and 2e-3 (fine); the fine phases' warm-ups of 2 and 1 steps ramp to it
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * g / 18)) for g in range(18)]
    peaks = [4e-3] * 5 + [2e-3] * 3 + [4e-3] * 5 + [2e-3] * 5
    ramps = [1.0] * 5 + [0.5, 1.0, 1.0] + [1.0] * 10
    train = records(tmp_path / "run", "train")
    assert [r["global_step"] for r in train] == list(range(1, 19))
    assert [r["lr"] for r in train] == pytest.approx([c * p * r for c, p, r in zip(cosine, peaks, ramps)], rel=1e-6)


def test_two_data_parallel_ranks_with_accumulation_are_the_one_process_run(reference, corpus, tmp_path):
    """DP=2 with 2 micro-batches of 2 per rank and step (gradient accumulation through the trainer,
    on every level of the V-cycle): the one-process run of 8-sample batches, step by step."""
    config = run_config(tmp_path, corpus, "run", gradient_accumulation_steps=2, training=KEEP_ALL)
    out = ok(launch(config, "--num_procs", 2)).stdout
    assert "on 2 rank(s)" in out
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


def test_two_processes_with_changing_layouts(reference, corpus, tmp_path):
    """Level 0 at TP=2 with ZeRO-1, level 1 at DP=2 with ZeRO-3: the same run as one process."""
    levels = json.loads(run_config(tmp_path, corpus, "tmp").read_text())["multilevel"]["levels"]
    levels[0].update(tensor_model_parallel_size=2, deepspeed={"zero_optimization": {"stage": 1}})
    levels[1].update(tensor_model_parallel_size=1, deepspeed={"zero_optimization": {"stage": 3}})
    config = run_config(tmp_path, corpus, "run", multilevel={"levels": levels, "keep_fine": "disk"}, training=KEEP_ALL)
    out = ok(launch(config, "--num_procs", 2)).stdout
    # each level's layout is said when the run starts (sequence parallelism stays off on CPU by default)
    assert re.search(r"on 2 rank\(s\); levels: \d+x\d+ \(TP 2\), \d+x\d+\n", out), out[:3000]
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)
    assert list((tmp_path / "run" / "snapshots" / "level0" / "params").glob("*.rank1.pt"))
    # consolidation (what to-full writes) against the one-process run's own weights, read from
    # its ZeRO-0 module states: level 1 at DP=2 ZeRO-3, level 0 at TP=2 ZeRO-1
    from megatron_multilevel.checkpoints.convert import load_source

    for tag in ("phase01-step0000005", "phase02-step0000005"):
        full = load_source(str(tmp_path / "run" / "checkpoints" / tag)).tensors
        truth = module_states(reference["dir"] / "checkpoints" / tag)
        assert full.keys() == truth.keys(), sorted(set(full) ^ set(truth))
        for name, t in truth.items():
            assert full[name].shape == t.shape, name
            # the runs differ by float rounding only: far below any two tensors' own difference
            assert (full[name] - t).norm() <= 1e-3 * t.norm() + 1e-6, (tag, name)


# mapped moments, to check them across layouts too (perturbation_std across layouts:
# test_transitions.py::test_perturbation_is_the_same_in_every_layout)
BERT_MULTILEVEL = {"optimizer_state": "map"}


@pytest.fixture(scope="module")
def bert_reference(tmp_path_factory, corpus):
    """An uninterrupted one-process BERT V-cycle: what its TP=2 run and its export must match."""
    tmp = tmp_path_factory.mktemp("bert_reference")
    ok(launch(run_config(tmp, corpus, "run", kind="bert", multilevel=BERT_MULTILEVEL)))
    return {"dir": tmp / "run"}


def test_bert_two_processes_tensor_parallel(bert_reference, corpus, tmp_path):
    """BERT at TP=2 on every level: the same run as one process, step by step."""
    config = run_config(tmp_path, corpus, "run", kind="bert", parallel={"tensor_model_parallel_size": 2},
                     multilevel=BERT_MULTILEVEL)
    ok(launch(config, "--num_procs", 2))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [p["level"] for p in summary["phases"]] == [0, 1, 0]
    assert_close_to_reference(tmp_path / "run", bert_reference, abs=2e-4)
    valid = records(tmp_path / "run", "valid")
    assert valid[-1]["loss"] < valid[0]["loss"]


def test_bert_to_hf_computes_the_megatron_models_logits(bert_reference, tmp_path):
    """``to-hf`` of a trained BERT loads as transformers' MegatronBertForMaskedLM, offline, and
    computes the logits of our Megatron model built from DeepSpeed's own file of that checkpoint."""
    from transformers import MegatronBertForMaskedLM

    from megatron_multilevel.checkpoints.convert import load_source
    from megatron_multilevel.checkpoints.verify import fixed_tokens, logits_full

    run = bert_reference["dir"]
    export = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "to-hf", str(run),
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    ok(export)
    hf = MegatronBertForMaskedLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tag = (run / "checkpoints" / "latest").read_text().strip()
    cfg = load_source(str(run)).model  # its shape only: the weights come from DeepSpeed's file below
    assert cfg.kind == "bert"
    assert hf.config.num_hidden_layers == cfg.num_layers and hf.config.hidden_size == cfg.hidden_size
    tokens = fixed_tokens(cfg)
    with torch.no_grad():
        theirs = hf(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                    token_type_ids=torch.zeros_like(tokens)).logits
    ours = logits_full(module_states(run / "checkpoints" / tag), cfg, tokens)
    assert theirs.shape == ours.shape == (*tokens.shape, cfg.vocab_size)
    assert (theirs - ours).abs().max() < 1e-4 * max(1.0, ours.abs().max().item())


def test_a_copied_run_exports_with_its_own_tokenizer(reference, corpus, tmp_path):
    """A run keeps its tokenizer in its directory; that directory, copied elsewhere, exports to
    Hugging Face with it from any working directory (the export's own generation check passes)."""
    from megatron_multilevel.checkpoints.convert import load_source

    run = reference["dir"]
    assert (run / "tokenizer.model").read_bytes() == open(corpus["model"], "rb").read()
    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(run, copy)
    assert load_source(str(copy)).tokenizer == str(copy / "tokenizer.model")
    export = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "to-hf", str(copy),
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    ok(export)
    assert "without a tokenizer" not in export.stdout
    assert list((tmp_path / "hf").glob("tokenizer*")), sorted(p.name for p in (tmp_path / "hf").iterdir())


def test_two_nodes_on_localhost(reference, corpus, tmp_path):
    """Two "nodes" of one process each, started the DeepSpeed way without ssh."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    config = run_config(tmp_path, corpus, "run")
    port = str(29700 + os.getpid() % 200)
    common = ["--hostfile", hostfile, "--no_ssh", "--master_addr", "127.0.0.1", "--master_port", port]
    env = {**os.environ, "PYTHON": sys.executable}
    nodes = [
        subprocess.Popen(["bash", str(ROOT / "launch" / "pretrain_vcycle.sh"), str(config), *map(str, common),
                          "--node_rank", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=ROOT, env=env)
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "on 2 rank(s)" in outputs[0]
    assert_close_to_reference(tmp_path / "run", reference, abs=2e-4)


@pytest.mark.slow  # a fresh cache: the embedded corpus and its tokenizer prepared anew (about 6 minutes)
def test_default_command_runs_the_embedded_corpus(tmp_path):
    """The README's main job (shortened): no config, the embedded default corpus."""
    # preparing the corpus (a tokenizer trained on it) takes most of the time: 5-10 minutes on 2 slow cores
    result = ok(launch(
        f"training.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
        "multilevel.levels.0.steps_before=2", "multilevel.levels.1.steps_before=2",
        "multilevel.levels.0.steps_after=2", "training.eval_batches=1", timeout=1800,
    ))
    assert "preparing the embedded corpus" in result.stdout and "done: final validation loss" in result.stdout
    assert list((tmp_path / "cache").glob("stdlib-*/tokenizer.model"))


def _pretrain(config, *overrides):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + os.getpid() % 300)}
    return subprocess.run([sys.executable, "-m", "megatron_multilevel.pretrain", "--config", str(config),
                           *overrides], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.hidden_sise=64"], "unknown key(s) ['hidden_sise']"),
        (["model.num_layers=3"], "model.num_layers = 3 cannot be halved"),
        (["data.prefix=/nonexistent/corpus"], "'/nonexistent/corpus.bin' does not exist"),
        (["multilevel.levels.1.tensor_model_parallel_size=3"], "does not divide"),
        (["optimizer.type=Lion", "optimizer.params.eps=1e-8"],
         "optimizer.params.torch_adam and optimizer.params.eps are not parameters of optimizer.type = 'Lion'"),
    ],
)
def test_bad_input_fails_fast(corpus, tmp_path, overrides, message):
    result = _pretrain(run_config(tmp_path, corpus, "run"), *overrides)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_corrupt_dataset_fails_with_one_line(corpus, tmp_path):
    """A damaged index, or a .bin shorter than its index says: one clear line, nothing after it."""
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    shutil.copy(corpus["gpt"] + ".idx", tmp_path / "short.idx")
    (tmp_path / "short.bin").write_bytes(b"")
    for name in ("bad", "short"):
        result = _pretrain(run_config(tmp_path, corpus, "run"), f"data.prefix={tmp_path / name}")
        assert result.returncode == 1, result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "is not a valid Megatron indexed dataset" in lines[0], result.stderr[-3000:]


def test_resume_refuses_another_model(reference, corpus, tmp_path):
    result = _pretrain(run_config(tmp_path, corpus, "run"), f"training.output_dir={reference['dir']}",
                       "model.hidden_size=128")
    assert result.returncode == 1 and "is from a different model (" in result.stderr
    assert "model.hidden_size" in result.stderr


def test_resume_refuses_another_walk(reference, corpus, tmp_path):
    """The same steps per phase (3, 5, 5) over other levels (2, 1, 0 instead of 0, 1, 0)."""
    levels = [{"steps_after": 5}, {"steps_after": 5}, {"steps_before": 3}]
    config = run_config(tmp_path, corpus, "run", multilevel={"cycle": "grow", "num_levels": 3, "alpha": 1.0,
                                                          "levels": levels})
    result = _pretrain(config, f"training.output_dir={reference['dir']}")
    assert result.returncode == 1 and "follows a different schedule" in result.stderr, result.stderr[-3000:]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    config = run_config(tmp_path, corpus, "run", training={
        "output_dir": str(tmp_path / "run"), "save_interval": 1, "log_interval": 1, "eval_interval": 100,
        "eval_batches": 1})
    levels = json.loads(config.read_text())["multilevel"]["levels"]
    levels[1].update(steps_before=40, lr_before={"peak": 10.0})  # the coarse level blows up
    # Plain SGD without clipping at the largest rate a config takes: the steps grow with the
    # gradients until the loss is no longer finite (Adam's steps are bounded by the rate).
    config = run_config(tmp_path, corpus, "run", training=json.loads(config.read_text())["training"],
                     multilevel={"levels": levels}, gradient_clipping=0.0,
                     optimizer={"type": "SGD", "params": {"lr": 2e-3, "momentum": 0.9}})
    result = _pretrain(config)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    stops = ("loss is nan", "loss is inf", "weights are not finite")  # a step's update may overflow first
    assert any(stop in result.stderr for stop in stops), result.stderr[-2000:]
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text()
    sidecar = json.loads((tmp_path / "run" / "checkpoints" / latest / "multilevel.json").read_text())
    train = records(tmp_path / "run", "train")
    assert all(math.isfinite(r["loss"]) for r in train)  # only finite losses logged
    assert sidecar["state"]["global_step"] <= train[-1]["global_step"]
    # the checkpoint kept holds finite weights
    weights = module_states(tmp_path / "run" / "checkpoints" / latest)
    assert weights and all(torch.isfinite(t).all() for t in weights.values())


# G_stack (study.variants' gstack): a quarter-depth model (1 layer) from scratch, then the whole
# model stacked four times at once, through a half-depth level that trains no step; plain copies
GSTACK = {"cycle": "grow", "num_levels": 3, "alpha": 1.0, "coalesce_width": False, "coalesce_depth": True,
          "depth_pairing": "halves", "depth_scaling": "none",
          "levels": [{"steps_after": 5, "lr_after": {"peak": 2e-3, "warmup_steps": 1}}, {"steps_after": 0},
                     {"steps_before": 5, "lr_before": {"peak": 2e-3, "warmup_steps": 2}}]}


def test_gstack_stacks_the_small_model_and_resumes_after_a_kill_while_growing(corpus, tmp_path):
    """The walk 2, 1, 0 with no step at level 1; the model after the first growth (the checkpoint of
    the empty phase) is the small model's layer twice, read from the checkpoints' own files; a run
    killed during the second growth resumes on the uninterrupted run's losses."""
    reference = ok(launch(run_config(tmp_path, corpus, "reference", multilevel=GSTACK, training=KEEP_ALL)))
    run = tmp_path / "reference"
    phases = json.loads((run / "summary.json").read_text())["phases"]
    assert [(p["level"], p["steps"]) for p in phases] == [(2, 5), (1, 0), (0, 5)]
    assert reference.stdout.count("de-coalesced, grown (alpha 1.0)") == 2
    small = module_states(run / "checkpoints" / "phase00-step0000005")
    grown = module_states(run / "checkpoints" / "phase01-step0000000")
    layer = "decoder.layers."
    assert {k for k in small if k.startswith(layer)} == {k for k in small if k.startswith(layer + "0.")}
    for name, t in grown.items():
        source = layer + "0." + name.split(".", 3)[3] if name.startswith(layer) else name
        assert torch.equal(t, small[source]), name
    assert {k for k in grown if k.startswith(layer + "1.")}  # two layers
    crashed = _crash_and_resume(tmp_path, corpus, "transition2", multilevel=GSTACK, training=KEEP_ALL)
    assert_close_to_reference(crashed, {"dir": run}, **SAME_RUN)


MSG = {"cycle": "grow", "num_levels": 2, "alpha": 1.0, "coalesce_width": False, "coalesce_depth": True,
       "depth_pairing": "halves", "depth_scaling": "none", "growth_mask_steps": 4, "optimizer_state": "map",
       "levels": [{"steps_after": 6, "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
                  {"steps_before": 5, "lr_before": {"peak": 2e-3, "warmup_steps": 2}}]}


@pytest.fixture(scope="module")
def msg_reference(tmp_path_factory, corpus):
    """An uninterrupted one-process MSG run (grow cycle, the stacked layers masked in over 4 steps)."""
    tmp = tmp_path_factory.mktemp("msg_reference")
    ok(launch(run_config(tmp, corpus, "run", multilevel=MSG, training=KEEP_ALL)))
    return {"dir": tmp / "run"}


def test_msg_growth_keeps_the_small_models_loss_and_resumes_in_the_ramp(msg_reference, corpus, tmp_path):
    """MSG's mask in a real run: the grown model's validation loss before its first step is the
    small model's last one (the stacked copies masked out); a run killed while the mask ramps
    (saved at global step 6, phase 1 step 1; killed at step 8) resumes on the uninterrupted run's losses."""
    valid = [(r["phase"], r["step"], r["loss"]) for r in records(msg_reference["dir"], "valid")]
    small_end = [loss for phase, step, loss in valid if (phase, step) == (0, 5)]
    grown_start = [loss for phase, step, loss in valid if (phase, step) == (1, 0)]
    assert len(small_end) == len(grown_start) == 1
    assert grown_start[0] == pytest.approx(small_end[0], rel=1e-6)
    crashed = _crash_and_resume(tmp_path, corpus, "step8", multilevel=MSG, training=KEEP_ALL)
    assert_close_to_reference(crashed, msg_reference, **SAME_RUN)


def _peer_layouts(multilevel: dict, fine: dict) -> dict:
    """``multilevel`` with the fine level in layout ``fine`` and every coarser level at DP=2 under
    ZeRO-2 (a level that starts the run starts from the one-process initialisation in any layout
    but ZeRO-3, whose zero.Init draws the parameters Megatron initialises after construction anew)."""
    levels = json.loads(json.dumps(multilevel["levels"]))
    levels[0].update(fine)
    for level in levels[1:]:
        level.update(tensor_model_parallel_size=1, deepspeed={"zero_optimization": {"stage": 2}})
    return {**multilevel, "levels": levels}


TP2_ZERO1 = {"tensor_model_parallel_size": 2, "deepspeed": {"zero_optimization": {"stage": 1}}}
DP2_ZERO3 = {"tensor_model_parallel_size": 1, "deepspeed": {"zero_optimization": {"stage": 3}}}


@pytest.mark.parametrize("fine", [pytest.param(TP2_ZERO1, id="tp2"),
                                  pytest.param(DP2_ZERO3, id="zero3", marks=pytest.mark.slow)])
def test_msg_in_two_layouts_is_the_one_process_run(msg_reference, corpus, tmp_path, fine):
    """MSG grown from the small model at DP=2 (ZeRO-2) into the full one at TP=2 (the mask on each
    rank's replicated hidden states) or at DP=2 under ZeRO-3 (the layers stacked into partitioned
    parameters): the one-process run."""
    config = run_config(tmp_path, corpus, "run", multilevel=_peer_layouts(MSG, fine), training=KEEP_ALL)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", msg_reference, abs=2e-4)


@pytest.mark.slow
def test_gstack_in_two_layouts_is_the_one_process_run(corpus, tmp_path):
    """G_stack (three levels) from the quarter-depth model at DP=2 (ZeRO-2), through the empty
    half-depth level at DP=2 under ZeRO-3, to the full model at TP=2: the one-process run."""
    ok(launch(run_config(tmp_path, corpus, "reference", multilevel=GSTACK, training=KEEP_ALL)))
    layouts = _peer_layouts(GSTACK, TP2_ZERO1)
    layouts["levels"][1].update(DP2_ZERO3)
    config = run_config(tmp_path, corpus, "run", multilevel=layouts, training=KEEP_ALL)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", {"dir": tmp_path / "reference"}, abs=2e-4)


# bert2BERT: the half-width, half-depth model grown in width by AKI and in depth by stacking
BERT2BERT_AKI = {"cycle": "grow", "num_levels": 2, "alpha": 1.0, "coalesce_width": True, "coalesce_depth": True,
                 "depth_pairing": "halves", "depth_scaling": "none", "width_growth": "aki",
                 "levels": [{"steps_after": 8, "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
                            {"steps_before": 6, "lr_before": {"peak": 6e-3, "warmup_steps": 2}}]}


@pytest.fixture(scope="module")
def aki_reference(tmp_path_factory, corpus):
    """An uninterrupted one-process bert2BERT run grown by AKI."""
    tmp = tmp_path_factory.mktemp("aki_reference")
    result = ok(launch(run_config(tmp, corpus, "run", multilevel=BERT2BERT_AKI, training=KEEP_ALL)))
    return {"dir": tmp / "run", "stdout": result.stdout}


def test_bert2bert_aki_run_grows_and_learns(aki_reference):
    """A run of the small model grown by AKI (the growth itself is checked against the operators in
    tests/test_trainer_transitions.py): the growth says so, and the grown model learns, its
    validation loss going down after growth."""
    run = aki_reference["dir"]
    assert "de-coalesced, grown by AKI (alpha 1.0)" in aki_reference["stdout"]
    phases = json.loads((run / "summary.json").read_text())["phases"]
    assert [(p["level"], p["steps"], p["model"]["hidden_size"]) for p in phases] == [(1, 6, 32), (0, 8, 64)]
    valid = {(r["phase"], r["step"]): r["loss"] for r in records(run, "valid")}
    assert valid[(1, 8)] < valid[(1, 0)] - 0.05  # the grown model learns
    assert valid[(1, 8)] < valid[(0, 4)] - 0.3  # and the run as a whole


@pytest.mark.slow
def test_bert2bert_aki_in_two_layouts_is_the_one_process_run(aki_reference, corpus, tmp_path):
    """The small model at DP=2 (ZeRO-2) grown by AKI into the full one at TP=2 (ZeRO-1): the
    one-process run."""
    config = run_config(tmp_path, corpus, "run", multilevel=_peer_layouts(BERT2BERT_AKI, TP2_ZERO1), training=KEEP_ALL)
    ok(launch(config, "--num_procs", 2))
    assert_close_to_reference(tmp_path / "run", aki_reference, abs=2e-4)


def test_the_launcher_is_quiet_unless_asked(reference, corpus, tmp_path):
    """A run shows its own lines, not the DeepSpeed launcher's INFO lines nor its no-GPU warning;
    --launcher-log-level info brings the INFO lines back. A config error ends before the launcher
    starts, with one line, either way."""
    assert "[INFO]" not in reference["stdout"] and "Setting accelerator to CPU" not in reference["stdout"]
    config = run_config(tmp_path, corpus, "run")
    for flags in ((), ("--launcher-log-level", "info")):
        bad = launch(config, "multilevel.alpha=5", *flags)
        assert bad.returncode != 0 and "error: multilevel.alpha must be in [0, 1], got 5.0" in bad.stderr
        assert "[INFO]" not in bad.stdout + bad.stderr
    loud = ok(launch(config, "multilevel.enabled=false", "training.train_steps=2",
                     f"training.output_dir={tmp_path / 'loud'}", "--launcher-log-level", "info"))
    assert "[INFO] [runner.py" in loud.stdout + loud.stderr
