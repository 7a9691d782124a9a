"""Reading a checkpoint never runs code from it: the checkpoint tools unpickle DeepSpeed files with
``weights_only=True`` and an allowlist of DeepSpeed's own few classes, and refuse anything else."""

import argparse
import shutil
import subprocess
import sys

import pytest
import torch

from launch_helpers import ROOT, launch, make_corpus, preprocess, small_config

ZERO0, ZERO2 = "phase02-step0000001", "phase01-step0000002"


def tool(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short V-cycle on one process: its coarse phase at ZeRO-2, its fine phases at ZeRO-0."""
    tmp = tmp_path_factory.mktemp("safe")
    assert preprocess(make_corpus(tmp / "corpus", documents=40), tmp / "gpt").returncode == 0
    levels = [{"steps_before": 2, "steps_after": 1, "deepspeed": {"zero_optimization": {"stage": 0}}},
              {"steps_before": 2, "deepspeed": {"zero_optimization": {"stage": 2}}}]
    config = small_config(
        tmp / "run.json", kind="gpt", prefix=str(tmp / "gpt"), tokenizer_model=str(tmp / "gpt.model"),
        output_dir=tmp / "run", multilevel={"levels": levels},
        model={"kind": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 512,
               "max_sequence_length": 32},
        training={"output_dir": str(tmp / "run"), "log_interval": 1, "eval_interval": 10, "eval_batches": 1,
                  "save_interval": 0, "seed": 5})
    result = launch(config, "--num_procs", 1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ckpts = tmp / "run" / "checkpoints"
    assert (ckpts / ZERO0).is_dir() and (ckpts / ZERO2).is_dir()
    return ckpts


class Payload:
    """Unpickling this calls ``exec``, which writes a file: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _tamper(src, dst, file_glob, extra):
    """A copy of the checkpoint tag ``src`` whose file ``file_glob`` also holds ``extra``."""
    from megatron_multilevel.training.safe_load import load_checkpoint_file

    shutil.copytree(src, dst)
    (path,) = dst.glob(file_glob)
    state = load_checkpoint_file(str(path))
    state["extra"] = extra
    torch.save(state, path)
    return path


def test_the_allowlist_is_what_real_checkpoints_hold(run):
    from megatron_multilevel.training.safe_load import allowed_classes, load_checkpoint_file

    allowed = {f"{c.__module__}.{c.__qualname__}" for c in allowed_classes()}
    found = set()
    for path in run.glob("*/*_states.pt"):  # model and optimizer states, ZeRO-0 and ZeRO-2
        found |= set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        assert isinstance(load_checkpoint_file(str(path)), dict)
    # every class the files ask for is allowed, and the fp32/bf16 ones are all in use
    assert found <= allowed and allowed - found == {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}
    info = tool("inspect_checkpoint.py", run / ZERO2)
    assert info.returncode == 0, info.stderr[-2000:]
    assert "layout: TP=1, ZeRO stage 2" in info.stdout


def test_a_malicious_checkpoint_is_refused_by_both_tools_and_nothing_runs(run, tmp_path):
    marker = tmp_path / "code_ran"
    model_states = _tamper(run / ZERO0, tmp_path / "zero0", "mp_rank_00_model_states.pt", Payload(marker))
    _tamper(run / ZERO2, tmp_path / "zero2", "*_optim_states.pt", Payload(marker))
    for result in (tool("inspect_checkpoint.py", tmp_path / "zero0"),
                   tool("convert_checkpoint.py", "to-full", tmp_path / "zero0", tmp_path / "out0"),
                   tool("inspect_checkpoint.py", tmp_path / "zero2"),
                   tool("convert_checkpoint.py", "to-full", tmp_path / "zero2", tmp_path / "out2")):
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        assert "refused to read" in result.stderr and "builtins.exec" in result.stderr
        assert "nothing from it was run" in result.stderr
        assert not marker.exists()
    assert not (tmp_path / "out0").exists() and not (tmp_path / "out2").exists()
    # the payload is live: an unrestricted load runs it
    torch.load(model_states, weights_only=False)
    assert marker.read_text() == "ran"


def test_a_class_outside_the_allowlist_is_named(run, tmp_path):
    from megatron.core.safe_globals import register_safe_globals

    from megatron_multilevel.training.safe_load import load_checkpoint_file

    path = _tamper(run / ZERO0, tmp_path / "args", "mp_rank_00_model_states.pt", argparse.Namespace(lr=1.0))
    # Megatron-Core allows argparse.Namespace process-wide; the tools' allowlist is theirs alone
    register_safe_globals()
    registered = len(torch.serialization.get_safe_globals())
    with pytest.raises(ValueError, match=r"it asks to load argparse\.Namespace, which is not among"):
        load_checkpoint_file(str(path))
    assert len(torch.serialization.get_safe_globals()) == registered  # put back as it was
    assert isinstance(torch.load(path, weights_only=True), dict)  # what Megatron's list alone lets through
