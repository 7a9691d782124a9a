"""``data.order_samples``: runs of different lengths read prefixes of one training sample order (the
savings benchmark's budget fractions), on the same validation samples; a value below what a run
reads is refused before anything is built, and a resume that changes it is refused."""

import pytest
import torch

from launch_helpers import prepare_corpus
from megatron_multilevel.config import config_to_dict, load_config
from megatron_multilevel.data.datasets import build_data, micro_batches, sample_indices
from megatron_multilevel.training.config_drift import trajectory_changes

BATCH = 4
LONG, SHORT = 250, 100  # steps: 1000 samples (about two epochs of the test corpus's training split), 400 (one)
VALID_BATCHES = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("order")
    return {**prepare_corpus(tmp), "tmp": tmp}


def _config(corpus, kind: str, steps: int, order=None, **data):
    """A GPT or BERT run of ``steps`` on the test corpus; ``gpt-blend``: GPT on a blend of the corpus
    as documents and as sentences."""
    source = {"blend": [0.3, corpus["gpt"], 0.7, corpus["bert"]]} if kind == "gpt-blend" else {"prefix": corpus[kind]}
    return load_config({
        "train_batch_size": BATCH,
        "model": {"kind": kind.split("-")[0], "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                  "vocab_size": 512, "max_sequence_length": 32},
        "data": {**source, "tokenizer_model": corpus["model"], "seq_length": 32, "split": "80,20,0",
                 "cache_dir": str(corpus["tmp"] / "cache"), "order_samples": order, **data},
        "training": {"train_steps": steps, "eval_batches": VALID_BATCHES, "seed": 3,
                     "output_dir": str(corpus["tmp"] / f"run-{kind}-{steps}")},
    })


def _read(cfg) -> tuple[list, list]:
    """Every training batch of the run ``cfg`` and its validation batches, read as the trainer reads
    them (one rank: the whole global batch of each step in one micro-batch)."""
    from megatron_multilevel.training.trainer import run_samples

    data = build_data(cfg, train_samples=run_samples(cfg, 1), valid_samples=VALID_BATCHES * BATCH)

    def batches(dataset, steps):
        out = []
        for step in range(steps):
            b = micro_batches(dataset, cfg.model.kind, sample_indices(step, 0, global_batch=BATCH, micro_batch=BATCH,
                                                                       dp_rank=0, accumulation=1))
            out.append(torch.stack([b.tokens, b.labels, b.loss_mask.long()]))  # BERT: its masking too
        return out

    return batches(data.train, cfg.training.train_steps), batches(data.valid, VALID_BATCHES)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["gpt", "bert", "gpt-blend"])
def test_a_shorter_run_reads_a_prefix_of_the_longer_runs_order(dist_single, corpus, kind):
    long_train, long_valid = _read(_config(corpus, kind, LONG))
    # with the key, the 0.4 budget fraction reads exactly the full run's first 100 batches
    short_train, short_valid = _read(_config(corpus, kind, SHORT, order=LONG * BATCH))
    assert _same(short_train, long_train[:SHORT])
    assert _same(short_valid, long_valid)  # scored on the same validation samples
    # the full run with the key set to its own length reads what it reads without it
    assert _same(_read(_config(corpus, kind, LONG, order=LONG * BATCH))[0], long_train)
    # without the key, Megatron shuffles the shorter run's samples for its own length: another order
    own_train, own_valid = _read(_config(corpus, kind, SHORT))
    assert not _same(own_train, long_train[:SHORT])
    assert _same(own_valid, long_valid)


def test_too_few_samples_are_refused_before_anything_is_built(dist_single, corpus, tmp_path):
    from megatron_multilevel.training.trainer import Trainer

    cfg = _config(corpus, "gpt", SHORT, order=SHORT * BATCH - 1, cache_dir=str(tmp_path / "cache"))
    message = f"data.order_samples = {SHORT * BATCH - 1} is below the {SHORT * BATCH} training samples"
    with pytest.raises(ValueError, match=message):
        Trainer(cfg)
    with pytest.raises(ValueError, match=message):
        build_data(cfg, train_samples=SHORT * BATCH, valid_samples=BATCH)
    assert not (tmp_path / "cache").exists()  # no dataset index built
    for bad in (0, -4):
        with pytest.raises(ValueError, match=f"data.order_samples must be a positive integer, got {bad}"):
            _config(corpus, "gpt", SHORT, order=bad)
    with pytest.raises(ValueError, match="data.order_samples: expected an integer"):
        _config(corpus, "gpt", SHORT, order=1e4)


def test_a_resume_that_changes_the_order_is_refused(corpus):
    """The key is part of the run's trajectory: the config-drift check of a resume names it."""
    saved = config_to_dict(_config(corpus, "gpt", SHORT, order=LONG * BATCH))
    assert trajectory_changes(saved, config_to_dict(_config(corpus, "gpt", SHORT, order=LONG * BATCH))) == {}
    assert trajectory_changes(saved, config_to_dict(_config(corpus, "gpt", SHORT))) == {
        "data.order_samples": (LONG * BATCH, None)}
    assert trajectory_changes(saved, config_to_dict(_config(corpus, "gpt", SHORT, order=2 * LONG * BATCH))) == {
        "data.order_samples": (LONG * BATCH, 2 * LONG * BATCH)}
