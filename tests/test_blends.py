"""Data blends (``data.blend``, Megatron's ``--data-path 0.3 A 0.7 B``): samples in proportion to
the weights, every dataset's own validation split, the same samples whatever the training seed or
a restart, and clear errors for a missing dataset or one made with another tokenizer."""

import json
import random

import numpy
import pytest

from launch_helpers import launch, losses, make_corpus, small_config
from megatron_multilevel.config import load_config

SAMPLES = 200


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """``words`` (made-up sentences) and ``digits`` (lines of digits), one tokenizer trained on both;
    ``other``: more sentences, with a tokenizer of its own."""
    from megatron_multilevel.data.preprocess import prepare

    tmp = tmp_path_factory.mktemp("blend")
    words = make_corpus(tmp / "words", documents=60)
    rng = random.Random(1)
    digits = tmp / "digits.jsonl"
    with open(digits, "w") as f:
        for _ in range(60):
            lines = [" ".join(str(rng.randint(0, 10**6)) for _ in range(rng.randint(6, 12))) for _ in range(12)]
            f.write(json.dumps({"text": "\n".join(lines)}) + "\n")
    prepare(words + [digits], str(tmp / "both"), vocab_size=512)  # trains both.model on both corpora
    model = str(tmp / "both.model")
    prepare(words, str(tmp / "words_ds"), vocab_size=512, tokenizer_model=model)
    prepare([digits], str(tmp / "digits_ds"), vocab_size=512, tokenizer_model=model)
    prepare(make_corpus(tmp / "more_words", seed=3), str(tmp / "other"), vocab_size=512)  # with other.model
    from megatron_multilevel.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(model)
    digit_ids = {i for p, i in tok.vocab.items() if p.strip("▁") and p.strip("▁").isdigit()}
    return {"tmp": tmp, "words": str(tmp / "words_ds"), "digits": str(tmp / "digits_ds"), "other": str(tmp / "other"),
            "model": model, "digit_ids": digit_ids}


def _config(datasets, *, blend=None, seed=1, valid_seed=0, cache="cache", **data):
    return load_config({
        "train_batch_size": 4,
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 512,
                  "max_sequence_length": 32},
        "data": {"blend": blend or [0.3, datasets["words"], 0.7, datasets["digits"]],
                 "tokenizer_model": datasets["model"], "seq_length": 32, "split": "80,20,0", "valid_seed": valid_seed,
                 "cache_dir": str(datasets["tmp"] / cache), **data},
        "training": {"seed": seed},
    })


def _samples(datasets, **kwargs):
    from megatron_multilevel.data.datasets import build_data

    data = build_data(_config(datasets, **kwargs), train_samples=SAMPLES, valid_samples=SAMPLES)
    train = [data.train[i] for i in range(SAMPLES)]
    valid = [data.valid[i] for i in range(SAMPLES)]
    return train, valid


def _is_digits(sample, digit_ids) -> bool:
    """Which corpus a sample came from, from its tokens alone: digit pieces only occur in ``digits``."""
    return bool(set(numpy.asarray(sample["tokens"]).tolist()) & digit_ids)


def _windows(samples, n=16) -> set:
    out = set()
    for s in samples:
        t = numpy.asarray(s["tokens"]).tolist()
        out |= {tuple(t[i:i + n]) for i in range(len(t) - n + 1)}
    return out


def test_samples_follow_the_weights_and_each_dataset_keeps_its_validation_split(dist_single, datasets):
    train, valid = _samples(datasets)
    for samples in (train, valid):
        from_digits = [_is_digits(s, datasets["digit_ids"]) for s in samples]
        # Megatron's BlendedDataset draws each sample from the dataset furthest behind its share
        assert [bool(s["dataset_id"]) for s in samples] == from_digits
        for n in (10, 50, SAMPLES):
            assert abs(sum(from_digits[:n]) - 0.7 * n) <= 1, (n, sum(from_digits[:n]))
    # no training sample shares a 16-token window with a validation sample: held-out documents
    assert not _windows(train) & _windows(valid)
    # the validation samples do not follow the training seed; the training samples do
    train2, valid2 = _samples(datasets, seed=2)
    assert all(numpy.array_equal(a["tokens"], b["tokens"]) for a, b in zip(valid, valid2))
    assert not all(numpy.array_equal(a["tokens"], b["tokens"]) for a, b in zip(train, train2))
    # a restart rebuilds the same samples, from the index cache or from scratch
    for kwargs in ({}, {"cache": "fresh_cache"}):
        train3, valid3 = _samples(datasets, **kwargs)
        assert all(numpy.array_equal(a["tokens"], b["tokens"]) for a, b in zip(train + valid, train3 + valid3))


def test_blend_errors(dist_single, datasets):
    from megatron_multilevel.data.datasets import build_data

    def build(**kwargs):
        return build_data(_config(datasets, **kwargs), train_samples=8, valid_samples=8)

    with pytest.raises(ValueError, match=r"data\.blend: '.*/missing\.bin' does not exist \(dataset '.*/missing'\)"):
        build(blend=[0.5, datasets["words"], 0.5, str(datasets["tmp"] / "missing")])
    with pytest.raises(ValueError, match=r"data\.blend mixes datasets made with different tokenizers: .*both\.model.*"
                                         r"other\.model"):
        build(blend=[0.5, datasets["words"], 0.5, datasets["other"]])
    with pytest.raises(ValueError, match=r"dataset '.*/other' was made with the tokenizer '.*other\.model'.* but "
                                         r"data\.tokenizer_model is '.*both\.model'"):
        build(blend=[1.0, datasets["other"]])
    for blend, message in [([0.3, datasets["words"], 0.7], r"expected weight, prefix, weight, prefix"),
                           ([datasets["words"], datasets["digits"]], r"data\.blend\[0\] = '.*': a weight must be"),
                           ([-1, datasets["words"]], r"data\.blend\[0\] = -1: a weight must be a number above 0")]:
        with pytest.raises(ValueError, match=message):
            _config(datasets, blend=blend)
    with pytest.raises(ValueError, match=r"data\.prefix and data\.blend are exclusive"):
        _config(datasets, prefix=datasets["words"])


@pytest.mark.slow
def test_a_blended_run_resumes_on_the_same_trajectory(datasets, tmp_path):
    """One process, a V-cycle on the blend: killed mid-phase and resumed, it logs the losses of an
    uninterrupted run."""
    def config(name):
        return small_config(tmp_path / f"{name}.json", kind="gpt", prefix=None, tokenizer_model=datasets["model"],
                            output_dir=tmp_path / name,
                            data={"prefix": None, "blend": [0.3, datasets["words"], 0.7, datasets["digits"]]},
                            model={"kind": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                                   "vocab_size": 512, "max_sequence_length": 32})

    reference = launch(config("reference"))
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    crashed = launch(config("run"), env={"MEGATRON_MULTILEVEL_CRASH_AT": "step7"})
    assert crashed.returncode != 0
    resumed = launch(config("run"))
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    ours, ref = losses(tmp_path / "run"), losses(tmp_path / "reference")
    assert [r[:2] for r in ours] == [r[:2] for r in ref]
    assert all(a[2] == pytest.approx(b[2], abs=1e-6) for a, b in zip(ours, ref))


def test_a_dataset_that_records_no_tokenizer_is_said(dist_single, datasets, tmp_path, capsys):
    """The dataset made with another tokenizer, its ``.meta.json`` gone (as Megatron's own
    preprocessing writes datasets): nothing can refuse it, so the run says that nothing checked it."""
    import shutil

    from megatron_multilevel.data.datasets import build_data

    bare = tmp_path / "bare"
    for suffix in (".bin", ".idx"):
        shutil.copy(datasets["other"] + suffix, str(bare) + suffix)
    build_data(_config(datasets, blend=[1.0, str(bare)]), train_samples=8, valid_samples=8)
    said = capsys.readouterr().out
    assert f"data: {bare} record(s) no tokenizer (no .meta.json" in said
    assert "made with another tokenizer of the same size trains without an error" in said
    build_data(_config(datasets, blend=[1.0, datasets["words"]]), train_samples=8, valid_samples=8)
    assert "record(s) no tokenizer" not in capsys.readouterr().out
