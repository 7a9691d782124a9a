"""Checkpoint tools: consolidation, resharding, offline operators, Hugging Face exchange, errors."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from launch_helpers import ROOT, convert, launch, make_corpus, preprocess, records, small_config


def ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from megatron_multilevel.compat import KNOWN_NOTICES

    # the tool drops the libraries' known notices (every model it builds would log one)
    assert not [n for n in KNOWN_NOTICES.values() if n in result.stdout + result.stderr], result.stderr[-2000:]
    return result.stdout


def tensors(path):
    from megatron_multilevel.checkpoints.full import load_full

    return load_full(str(path))[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A GPT V-cycle killed in its coarse phase: its latest checkpoint is at level 1 (DP=2, ZeRO-3),
    and the pre-coalescing one at level 0 (TP=2, ZeRO-1)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    inputs = make_corpus(tmp / "corpus")
    assert preprocess(inputs, tmp / "gpt").returncode == 0
    base = json.loads(small_config(tmp / "base.json", kind="gpt", prefix=str(tmp / "gpt"),
                                   tokenizer_model=str(tmp / "gpt.model"), output_dir=tmp / "run").read_text())
    levels = base["multilevel"]["levels"]
    levels[0].update(tensor_model_parallel_size=2, deepspeed={"zero_optimization": {"stage": 1}})
    levels[1].update(tensor_model_parallel_size=1, deepspeed={"zero_optimization": {"stage": 3}})
    config = small_config(tmp / "run.json", kind="gpt", prefix=str(tmp / "gpt"), tokenizer_model=str(tmp / "gpt.model"),
                          output_dir=tmp / "run", multilevel={"levels": levels})
    crashed = launch(config, "--num_procs", 2, env={"MEGATRON_MULTILEVEL_CRASH_AT": "step7"})
    assert crashed.returncode != 0
    ckpts = tmp / "run" / "checkpoints"
    assert (ckpts / "latest").read_text() == "phase01-step0000003"
    return {"dir": tmp / "run", "config": config, "tmp": tmp, "fine_tag": ckpts / "phase00-step0000003",
            "coarse_tag": ckpts / "phase01-step0000003"}


def test_to_full_from_zero3_and_tensor_parallel(run, tmp_path):
    out = ok(convert("to-full", run["dir"], tmp_path / "coarse"))  # the latest: level 1, DP=2 ZeRO-3
    assert "bit for bit: yes" in out and "| source (TP=1) | consolidated (TP=1) |" in out
    out = ok(convert("to-full", run["fine_tag"], tmp_path / "fine", "--format", "torch"))  # TP=2, ZeRO-1
    assert "| source (TP=2) | consolidated (TP=1) |" in out
    fine, coarse = tensors(tmp_path / "fine"), tensors(tmp_path / "coarse")
    assert fine["embedding.word_embeddings.weight"].shape == (512, 64)
    assert coarse["embedding.word_embeddings.weight"].shape == (512, 32)
    meta = json.loads((tmp_path / "coarse" / "checkpoint.json").read_text())
    assert meta["level"] == 1 and meta["source"]["zero_stage"] == 3 and len(meta["level_maps"]) == 1
    info = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_checkpoint.py"), str(run["dir"])],
                          capture_output=True, text=True, timeout=300)
    assert "layout: TP=1, ZeRO stage 3" in info.stdout and "phase01-step0000003" in info.stdout
    assert "2 layers, hidden 32" in info.stdout


@pytest.mark.slow
def test_reshard_then_continue_training(run, tmp_path):
    resharded = tmp_path / "run_tp2"
    out = ok(convert("reshard", run["dir"], resharded, "--target-tp", 2))
    assert "loaded as the trainer does (TP=2, 2 rank(s))" in out
    # the weights survive resharding bit for bit, at both checkpoints the run needs
    ok(convert("to-full", run["dir"], tmp_path / "a"))
    ok(convert("to-full", resharded, tmp_path / "b"))
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (resharded / "checkpoints" / "phase00-step0000003").is_dir()
    # training continues from it at TP=2 (the run's second half, including the prolongation)
    result = launch(resharded / "config.json", "--num_procs", 2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming from phase01-step0000003" in result.stdout
    summary = json.loads((resharded / "summary.json").read_text())
    assert [p["level"] for p in summary["phases"]] == [0, 1, 0]
    assert records(resharded, "valid")[-1]["loss"] < 6.0


def test_offline_operators_round_trip(run, tmp_path):
    ok(convert("to-full", run["fine_tag"], tmp_path / "fine"))
    out = ok(convert("coalesce", tmp_path / "fine", tmp_path / "coarse", "--no-depth"))
    assert "| coalesced (coarse) | its de-coalesced fine model |" in out
    assert json.loads((tmp_path / "coarse" / "level_map.json").read_text())["layers"] is None
    ok(convert("decoalesce", tmp_path / "coarse", tmp_path / "fine2"))
    ok(convert("coalesce", tmp_path / "fine2", tmp_path / "coarse2", "--no-depth"))
    c1, c2 = tensors(tmp_path / "coarse"), tensors(tmp_path / "coarse2")
    assert all(torch.equal(c1[k], c2[k]) for k in c1)  # coalesce -> decoalesce -> coalesce is the identity
    ok(convert("interpolate", tmp_path / "fine2", tmp_path / "mix", "--alpha", "0.25", "--with", tmp_path / "fine"))
    f, f2, mix = tensors(tmp_path / "fine"), tensors(tmp_path / "fine2"), tensors(tmp_path / "mix")
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    torch.testing.assert_close(mix[name], 0.75 * f[name] + 0.25 * f2[name])


def _hf_gpt2(path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=120, n_positions=32,
                                       bos_token_id=None, eos_token_id=None))
    model.save_pretrained(path)
    return model


def test_hugging_face_round_trip_and_logits(tmp_path):
    from safetensors.torch import load_file

    _hf_gpt2(tmp_path / "hf")
    out = ok(convert("from-hf", tmp_path / "hf", tmp_path / "ours"))
    assert "bit for bit: yes" in out
    assert [line[:5] for line in out.splitlines() if line.startswith("[")] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    out = ok(convert("to-hf", tmp_path / "ours", tmp_path / "hf2"))
    # each stage says it started; DeepSpeed's notice of its loaded op is not among the lines
    assert [line[:5] for line in out.splitlines() if line.startswith("[")] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]"]
    assert "built successfully" not in out
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the exported model computes our Megatron model's logits
    from transformers import GPT2LMHeadModel

    from megatron_multilevel.checkpoints.full import load_full
    from megatron_multilevel.checkpoints.verify import fixed_tokens, logits_full

    ours, cfg, _ = load_full(str(tmp_path / "ours"))
    tokens = fixed_tokens(cfg)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf2").eval()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    assert (theirs - logits_full(ours, cfg, tokens)).abs().max() < 1e-4
    assert cfg.activation == "gelu_tanh"  # GPT-2's own GELU approximation is kept


def test_errors(run, tmp_path):
    from megatron_multilevel.checkpoints.full import save_full
    from megatron_multilevel.config import ModelConfig

    # wrong architecture for Hugging Face export: the feature is named
    llama = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, max_sequence_length=16,
                        normalization="RMSNorm")
    import sys as _sys

    _sys.path.insert(0, str(ROOT / "tests"))
    from conftest import random_state_dict
    from megatron_multilevel.distributed import init_distributed
    import tempfile

    init_distributed(1, init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    save_full(str(tmp_path / "rms"), random_state_dict(llama), llama)
    result = convert("to-hf", tmp_path / "rms", tmp_path / "x")
    assert result.returncode == 2 and "model.normalization is 'RMSNorm', it needs 'LayerNorm'" in result.stderr
    # a checkpoint missing shards
    broken = tmp_path / "broken"
    shutil.copytree(run["coarse_tag"], broken)
    next(broken.glob("*_optim_states.pt")).unlink()
    result = convert("to-full", broken, tmp_path / "y")
    assert result.returncode == 2 and "Expected 2 of '*_optim_states.pt'" in result.stderr
    shutil.rmtree(broken)
    shutil.copytree(run["fine_tag"], broken)
    next(broken.glob("mp_rank_01_model_states.pt")).unlink()
    result = convert("to-full", broken, tmp_path / "y")
    assert result.returncode == 2
    assert "missing the shards of model-parallel rank 1 (mp_rank_01_*: tensor-parallel rank 1" in result.stderr
    # a target TP size that does not divide the heads
    result = convert("reshard", run["dir"], tmp_path / "z", "--target-tp", 3)
    assert result.returncode == 2 and "--target-tp 3" in result.stderr and "does not divide" in result.stderr
    # an existing output directory is refused unless --overwrite
    (tmp_path / "exists").mkdir()
    result = convert("to-full", run["dir"], tmp_path / "exists")
    assert result.returncode == 2 and "exists; choose another or pass --overwrite" in result.stderr
    ok(convert("to-full", run["dir"], tmp_path / "exists", "--overwrite"))
    result = convert("to-full", tmp_path / "exists", tmp_path / "exists", "--overwrite")
    assert result.returncode == 2 and "is the source" in result.stderr


@pytest.mark.usefixtures("dist_single")
def test_init_run_says_which_level_it_builds_and_takes_overrides(tmp_path):
    """A full model's checkpoint given to the default config (an F-cycle, which starts at half depth)
    is refused in one line that says the cycle starts from its smaller model; ``key=value``
    overrides change the config as the launcher's do (here to a V-cycle, which starts from the
    full model: the line no longer names a smaller level)."""
    import json
    import subprocess
    import sys

    from conftest import random_state_dict
    from megatron_multilevel.checkpoints.full import save_full
    from megatron_multilevel.config import load_config
    from megatron_multilevel.pretrain import DEFAULT_CONFIG

    fine = load_config(json.loads(open(DEFAULT_CONFIG).read())).model
    save_full(str(tmp_path / "full"), random_state_dict(fine, seed=3), fine, source={"kind": "test"})
    tool = [sys.executable, "tools/convert_checkpoint.py", "init-run", str(tmp_path / "full")]
    done = subprocess.run(tool + [str(tmp_path / "run"), "--config", DEFAULT_CONFIG], capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "first level (1, 2 x 128: its 'f' cycle starts from its smaller model" in line, line
    done = subprocess.run(tool + [str(tmp_path / "run2"), "--config", DEFAULT_CONFIG, "training.steps_scale=x"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "training.steps_scale" in done.stderr, done.stderr
