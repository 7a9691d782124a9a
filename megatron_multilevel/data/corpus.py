"""The embedded default corpus: the Python standard library's own source files.

Real text (code, docstrings, comments) already present on every machine that has Python, so a
first run needs no download. It is tokenized once (a SentencePiece model trained on it) and
cached as Megatron indexed datasets under the data cache directory.
"""

import fcntl
import os
import random
import sys
import sysconfig
from contextlib import contextmanager
from pathlib import Path

from megatron_multilevel.data.preprocess import prepare
from megatron_multilevel.data.tokenizer import TRAINING_VERSION

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


CORPUS_VERSION = 2  # 2: documents in a fixed random order


def stdlib_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library, without tests, in a fixed random
    order: the validation split is the last documents (Megatron splits by position), and in
    directory order those would all come from the last few packages (``xml*``, ``zoneinfo``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise ValueError(f"no Python sources under {root}: the embedded corpus needs the standard library")
    random.Random(0).shuffle(files)
    return files


@contextmanager
def _exclusive(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def corpus_root(cache_dir: str, vocab_size: int) -> Path:
    """Where the embedded corpus of a vocabulary size is prepared (its ``tokenizer.model`` and datasets)."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cache_dir) / f"stdlib-{version}-c{CORPUS_VERSION}-v{vocab_size}-t{TRAINING_VERSION}"


def default_corpus(cache_dir: str, *, vocab_size: int, kind: str) -> tuple[str, str]:
    """``(dataset prefix, tokenizer model)`` of the embedded corpus, preparing it on first use.

    Safe to call from several processes at once: one prepares, the others wait for it.
    """
    root = corpus_root(cache_dir, vocab_size)
    tokenizer_model = root / "tokenizer.model"
    prefix = root / ("gpt_document" if kind == "gpt" else "bert_sentence")
    with _exclusive(root.with_suffix(".lock")):
        if not Path(f"{prefix}.idx").exists():
            model = str(tokenizer_model) if tokenizer_model.exists() else None
            if model is None:
                print(f"preparing the embedded corpus (once) in {root} ...", flush=True)
            prepare(
                stdlib_files(), str(prefix), vocab_size=vocab_size, tokenizer_model=model,
                split_sentences=kind == "bert",
            )
            if model is None:
                os.replace(f"{prefix}.model", tokenizer_model)
    return str(prefix), str(tokenizer_model)
