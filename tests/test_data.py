"""The data split: validation samples that do not depend on the training seed, and an embedded
corpus whose held-out documents are a random sample rather than the last packages on disk."""

import numpy
import pytest

from launch_helpers import make_corpus, preprocess
from megatron_multilevel.config import load_config
from megatron_multilevel.data.datasets import sample_indices


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    result = preprocess(make_corpus(tmp / "corpus"), tmp / "gpt")
    assert result.returncode == 0, result.stderr
    return str(tmp / "gpt"), str(tmp / "gpt.model"), tmp


def _data(dataset, *, seed: int, valid_seed: int = 0):
    from megatron_multilevel.data.datasets import build_data

    prefix, model, tmp = dataset
    cfg = load_config({
        "train_batch_size": 4,
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 512,
                  "max_sequence_length": 32},
        "data": {"prefix": prefix, "tokenizer_model": model, "seq_length": 32, "split": "80,20,0",
                 "valid_seed": valid_seed, "cache_dir": str(tmp / "cache")},
        "training": {"seed": seed},
    })
    data = build_data(cfg, train_samples=16, valid_samples=16)
    return ([numpy.asarray(data.train[i]["tokens"]) for i in range(16)],
            [numpy.asarray(data.valid[i]["tokens"]) for i in range(16)])


def test_validation_samples_do_not_follow_the_training_seed(dist_single, dataset):
    train_a, valid_a = _data(dataset, seed=1)
    train_b, valid_b = _data(dataset, seed=2)
    assert all(numpy.array_equal(a, b) for a, b in zip(valid_a, valid_b))  # scored on the same samples
    assert not all(numpy.array_equal(a, b) for a, b in zip(train_a, train_b))  # trained in another order
    _, valid_c = _data(dataset, seed=1, valid_seed=7)
    assert not all(numpy.array_equal(a, b) for a, b in zip(valid_a, valid_c))
    # validation documents are never trained on
    seen = {tuple(t) for t in train_a + train_b}
    assert not seen & {tuple(t) for t in valid_a}


def test_embedded_corpus_holds_out_a_random_sample_of_files():
    """The validation split of the embedded corpus (its last documents) is a fixed random sample of
    the standard library's files, whatever the run's seeds. Which files it holds depends on the
    Python version (each has its own standard library), so the test checks the property, not a list."""
    import random

    from megatron_multilevel.data.corpus import stdlib_files

    random.seed(1)
    files = stdlib_files()
    random.seed(2)
    assert files == stdlib_files()  # a fixed order, not drawn from the global random state
    assert len(set(files)) == len(files) > 100  # every file once
    library = sorted(files)  # the library's own order: a package's files side by side
    assert files != library
    held_out = files[-max(1, len(files) // 50):]  # the validation share of the default split, 2%
    # Spread over the library, not one corner of it: the held-out files fall in at least three of
    # the four quarters of the library's order. The tail of the library's order falls in one (the
    # xml and zoneinfo packages); a uniform random sample of a dozen files misses two of them
    # less than once in a thousand draws.
    rank = {f: i for i, f in enumerate(library)}
    quarters = {4 * rank[f] // len(files) for f in held_out}
    assert len(quarters) >= 3, sorted(rank[f] for f in held_out)


@pytest.mark.parametrize("dp, accumulation", [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2)])
def test_every_sample_of_a_global_batch_is_read_once_per_step(dp, accumulation):
    """Over the data-parallel ranks and micro-batches of a step, the samples read are exactly that
    step's global batch, each once, in the order of (rank, micro-batch): rank r reads the r-th
    contiguous block of the batch (enumerated here by hand, not through the sampler's formula)."""
    global_batch = 16
    micro = global_batch // (dp * accumulation)
    for step in range(3):
        reads = {(r, m): list(sample_indices(step, m, global_batch=global_batch, micro_batch=micro, dp_rank=r,
                                             accumulation=accumulation))
                 for r in range(dp) for m in range(accumulation)}
        flat = [i for r in range(dp) for m in range(accumulation) for i in reads[(r, m)]]
        assert flat == list(range(step * global_batch, (step + 1) * global_batch))
        for r in range(dp):
            block = [i for m in range(accumulation) for i in reads[(r, m)]]
            per_rank = global_batch // dp
            assert block == list(range(step * global_batch + r * per_rank, step * global_batch + (r + 1) * per_rank))
