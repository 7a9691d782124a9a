"""Run the real launcher (``launch/pretrain_vcycle.sh``) on a small corpus the tests make."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_multilevel.records import read_metrics

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "launch" / "pretrain_vcycle.sh"

WORDS = (
    "the a model layer level coarse fine width depth head token train loss step grid cycle "
    "operator average copy split sum weight bias norm embedding vocabulary batch gradient moment "
    "shard rank tensor parallel data pipeline checkpoint resume value function attention query key"
).split()


def make_corpus(directory: Path, *, documents: int = 120, seed: int = 0) -> list[Path]:
    """A deterministic corpus: text files and one JSONL file of made-up sentences."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)

    def document() -> str:
        lines = []
        for _ in range(rng.randint(8, 24)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
            lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
        return "\n".join(lines)

    paths = []
    for i in range(documents // 2):
        path = directory / f"doc{i:03d}.txt"
        path.write_text(document())
        paths.append(path)
    jsonl = directory / "more.jsonl"
    with open(jsonl, "w") as f:
        for _ in range(documents - documents // 2):
            f.write(json.dumps({"text": document()}) + "\n")
    paths.append(jsonl)
    return paths


def preprocess(inputs, prefix: Path, *, vocab_size: int = 512, split_sentences: bool = False,
               tokenizer_model: "str | None" = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", *map(str, inputs),
           "--output-prefix", str(prefix), "--vocab-size", str(vocab_size)]
    if split_sentences:
        cmd.append("--split-sentences")
    if tokenizer_model:
        cmd += ["--tokenizer-model", tokenizer_model]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def small_config(path: Path, *, kind: str, prefix: str, tokenizer_model: str, output_dir: Path, **blocks) -> Path:
    """A tiny run config (4 layers, hidden 64) on the test corpus; ``blocks`` update its blocks."""
    config = {
        "train_batch_size": 8,  # the same global batch on any number of ranks
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "model": {"kind": kind, "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                  "vocab_size": 512, "max_sequence_length": 32},
        "data": {"prefix": prefix, "tokenizer_model": tokenizer_model, "seq_length": 32, "split": "90,10,0",
                 "cache_dir": str(output_dir.parent / "cache")},
        "training": {"output_dir": str(output_dir), "log_interval": 2, "eval_interval": 4, "eval_batches": 2,
                     "save_interval": 3, "seed": 5},
        "multilevel": {
            # Adjacent pairing is shard-local at any TP size, so every layout trains the same model.
            "enabled": True, "num_levels": 2, "alpha": 0.5, "width_pairing": "adjacent",
            "levels": [
                {"steps_before": 3, "lr_before": {"peak": 2e-3, "warmup_steps": 2},
                 "steps_after": 5, "lr_after": {"peak": 2e-3, "warmup_steps": 1}},
                {"steps_before": 5, "lr_before": {"peak": 4e-3}},
            ],
        },
    }
    for block, values in blocks.items():
        if isinstance(values, dict) and isinstance(config.get(block), dict):
            config[block] = {**config[block], **values}
        else:
            config[block] = values
    path.write_text(json.dumps(config, indent=1))
    return path


def convert(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``tools/convert_checkpoint.py ARGS`` with this interpreter; output captured."""
    env = {"TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"), **os.environ}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def launch(*args, env: "dict | None" = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``launch/pretrain_vcycle.sh ARGS`` with this interpreter; output captured."""
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    full_env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    before = _shm_segments()
    result = subprocess.run(["bash", str(LAUNCHER), *map(str, args)], capture_output=True, text=True,
                            timeout=timeout, env=full_env, cwd=ROOT)
    # DeepSpeed's CPU all-reduce segments live in RAM; a run that leaves them fills the machine.
    assert _shm_segments() <= before, f"the run left shared memory behind: {_shm_segments() - before}"
    return result


def _shm_segments() -> set:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("deepspeed_allreduce_buffer_*")} if shm.is_dir() else set()


def load_tool(name: str):
    """The module of ``tools/<name>.py`` (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["type"] == kind]


def losses(run_dir: Path) -> list[tuple]:
    """(type, global step, loss) of every train and valid record."""
    return [(r["type"], r["global_step"], r["loss"]) for r in read_metrics(run_dir) if r["type"] in ("train", "valid")]


def module_states(tag_dir: Path) -> dict:
    """The parameters of a one-process ZeRO-0 checkpoint, read straight from DeepSpeed's file."""
    import torch

    (path,) = tag_dir.glob("mp_rank_00_model_states.pt")
    module = torch.load(path, map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in module.items() if not k.endswith("_extra_state")}


# every checkpoint of a run kept, to compare runs tag by tag
KEEP_ALL = {"keep_checkpoints": 100}
# a resumed run against the uninterrupted one: the same arithmetic, up to float rounding (two launches
# differ in the last bits: 1.2e-6 relative seen in CI on a W-cycle, 2.1e-6 on an ODE run's coarse phase)
SAME_RUN = dict(rel=1e-5)


def prepare_corpus(tmp: Path) -> dict:
    """The test corpus prepared as GPT and BERT datasets with one tokenizer, under ``tmp``."""
    inputs = make_corpus(tmp / "corpus")
    gpt = preprocess(inputs, tmp / "gpt")
    assert gpt.returncode == 0, gpt.stderr
    bert = preprocess(inputs, tmp / "bert", split_sentences=True, tokenizer_model=str(tmp / "gpt.model"))
    assert bert.returncode == 0, bert.stderr
    return {"gpt": str(tmp / "gpt"), "bert": str(tmp / "bert"), "model": str(tmp / "gpt.model"), "inputs": inputs}


def run_config(tmp_path: Path, corpus: dict, name: str, kind: str = "gpt", **blocks) -> Path:
    """``small_config`` of run ``name`` under ``tmp_path`` on the prepared corpus."""
    return small_config(tmp_path / f"{name}.json", kind=kind, prefix=corpus[kind], tokenizer_model=corpus["model"],
                        output_dir=tmp_path / name, **blocks)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def assert_close_to_reference(run: Path, reference: dict, **tol) -> None:
    """The train and valid losses of ``run``, record by record, against ``reference["dir"]``'s."""
    import pytest

    ours, ref = losses(run), losses(reference["dir"])
    assert [r[:2] for r in ours] == [r[:2] for r in ref]
    for a, b in zip(ours, ref):
        assert a[2] == pytest.approx(b[2], **tol), (a, b)


class PausedRun:
    """``launch/pretrain_vcycle.sh`` over ``procs`` ranks, each held at the crash points named ``pauses``
    (``training/checkpoint.py``: ``crash_point``) until the test releases it."""

    def __init__(self, config, tmp_path, *pauses, procs: int = 2):
        self.gate = tmp_path / "gate"
        env = {**os.environ, "PYTHON": sys.executable, "MEGATRON_MULTILEVEL_PAUSE_AT": ",".join(pauses),
               "MEGATRON_MULTILEVEL_PAUSE_FILE": str(self.gate)}
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
        # its own session, as a job step or a terminal's foreground job is: a group to signal
        self.process = subprocess.Popen(["bash", str(LAUNCHER), str(config), "--num_procs", str(procs)], cwd=ROOT,
                                        env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
        self.tree = []
        self.procs = procs

    def wait_paused(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        gates = [self.gate.with_name(f"gate.{rank}") for rank in range(self.procs)]
        while not all(g.exists() for g in gates):
            assert self.process.poll() is None, self.process.communicate()
            assert time.monotonic() < deadline, "the ranks never reached the pause"
            time.sleep(0.05)
        import psutil

        self.tree = psutil.Process(self.process.pid).children(recursive=True)
        assert len([p for p in self.tree if "--local_rank" in " ".join(p.cmdline())]) == self.procs

    def release(self) -> None:
        for rank in range(self.procs):
            self.gate.with_name(f"gate.{rank}").unlink()

    def finish(self, timeout: float = 300) -> subprocess.CompletedProcess:
        stdout, stderr = self.process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)

    def finish_or_fail(self, timeout: float, what: str) -> subprocess.CompletedProcess:
        """``finish``; where the ranks are still running after ``timeout`` s (out of step), every
        process of the run killed and the test failed, saying ``what`` happened to them."""
        import pytest

        try:
            return self.finish(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.communicate()
            pytest.fail(f"the ranks were still running {timeout} s after {what}: out of step")

    def ranks(self) -> list:
        return [p for p in self.tree if "--local_rank" in " ".join(p.cmdline())]

    def rank(self, local_rank: int):
        """The process of rank ``local_rank``."""
        (process,) = [p for p in self.ranks() if f"--local_rank={local_rank}" in p.cmdline()]
        return process

    def survivors(self) -> list:
        """The launcher's processes (DeepSpeed's launch, the ranks) still alive after it ended."""
        import psutil

        time.sleep(0.5)
        return [p for p in self.tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
