"""Training and validation data through Megatron-Core's dataset classes.

GPT: ``GPTDataset`` (causal LM); BERT: ``BERTMaskedWordPieceDataset`` (masked LM), both built by
``BlendedMegatronDatasetBuilder`` from one indexed dataset with a held-out validation split.
Batches are addressed by global step, so a resumed run reads exactly the samples an
uninterrupted run would have read, whatever the data-parallel size of each level.
"""

import os
from dataclasses import dataclass

import numpy
import torch

from megatron_multilevel.config import RunConfig
from megatron_multilevel.data.tokenizer import SentencePieceTokenizer


@dataclass
class Data:
    train: object
    valid: object
    tokenizer: SentencePieceTokenizer


def resolve_data_paths(cfg: RunConfig) -> tuple[str, str]:
    """``(prefix, tokenizer model)``: the configured dataset, or the embedded corpus (prepared
    once per cache directory). Raises ``ValueError`` for missing or corrupt files."""
    from megatron_multilevel.data.corpus import default_corpus

    if cfg.data.prefix is None:
        return default_corpus(cfg.data.cache_dir, vocab_size=cfg.model.vocab_size, kind=cfg.model.kind)
    prefix, model = cfg.data.prefix, cfg.data.tokenizer_model
    for path in (prefix + ".bin", prefix + ".idx", model):
        if not os.path.isfile(path):
            raise ValueError(f"data: {path!r} does not exist; prepare data with tools/preprocess_data.py")
    return prefix, model


def check_dataset(prefix: str, tokenizer: SentencePieceTokenizer, vocab_size: int) -> None:
    """Open the indexed dataset once, turning a corrupt file into a clear error.

    The index is read alone first and the ``.bin`` size checked against it: ``IndexedDataset``
    opens the ``.bin`` and then the index in its constructor, and one that fails half-way fails
    again in its ``__del__`` (``AttributeError``), printing a traceback after our error."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexReader

    try:
        index = _IndexReader(prefix + ".idx", multimodal=False)
        assert len(index) > 0, "no sequences"
        needed = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
        size = os.path.getsize(prefix + ".bin")
        assert size >= max(needed, 1), f"the index needs {needed} bytes of .bin, it has {size}"
        dataset = IndexedDataset(prefix)  # kept while ``last``, a view of its memory map, is read
        last = dataset[len(index) - 1]
    except Exception as e:  # the reader raises assorted errors on damaged files
        raise ValueError(f"data: {prefix}.bin/.idx is not a valid Megatron indexed dataset ({e!r})") from None
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(
            f"data: the tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size = {vocab_size}"
        )
    if int(numpy.max(last, initial=0)) >= vocab_size:
        raise ValueError(f"data: {prefix} holds token ids beyond model.vocab_size = {vocab_size}")


def build_data(cfg: RunConfig, *, train_samples: int, valid_samples: int) -> Data:
    """Megatron datasets of at least the given numbers of samples (collective over all ranks).

    The training samples follow ``training.seed``; the validation samples follow
    ``data.valid_seed`` alone, so every run on the same data is scored on the same samples."""
    prefix, model = resolve_data_paths(cfg)
    tokenizer = SentencePieceTokenizer(model)
    check_dataset(prefix, tokenizer, cfg.model.vocab_size)
    # Megatron builds every split of non-zero share, and BERT's sample mapping needs a number of
    # samples for each: the split a call does not use gets one sample.
    train = _build_split(cfg, prefix, tokenizer, seed=cfg.training.seed, sizes=[train_samples, 1, 1])
    valid = _build_split(cfg, prefix, tokenizer, seed=cfg.data.valid_seed, sizes=[1, valid_samples, 1])
    return Data(train[0], valid[1], tokenizer)


def _build_split(cfg: RunConfig, prefix: str, tokenizer, *, seed: int, sizes: list):
    """The splits of ``sizes`` (None: not built) through Megatron's dataset builder, shuffled by ``seed``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    common = dict(
        random_seed=seed,
        sequence_length=cfg.data.seq_length,
        blend=([prefix], None),
        split=cfg.data.split,
        path_to_cache=os.path.join(cfg.data.cache_dir, "index"),
        tokenizer=tokenizer,
    )
    if cfg.model.kind == "gpt":
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        dataset_cls = GPTDataset
        config = GPTDatasetConfig(
            **common, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            create_attention_mask=False,
        )
    else:
        from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig

        dataset_cls = BERTMaskedWordPieceDataset
        config = BERTMaskedWordPieceDatasetConfig(
            **common,
            masking_probability=cfg.data.masking_probability,
            short_sequence_probability=cfg.data.short_sequence_probability,
            masking_max_ngram=3,
            masking_do_full_word=False,
            masking_do_permutation=False,
            masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False,
            classification_head=cfg.model.add_binary_head,
        )
    return BlendedMegatronDatasetBuilder(dataset_cls, sizes, lambda: True, config).build()


@dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    padding_mask: "torch.Tensor | None" = None
    tokentype_ids: "torch.Tensor | None" = None

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(*(move(getattr(self, f)) for f in ("tokens", "labels", "loss_mask", "padding_mask", "tokentype_ids")))


def collate(samples: list[dict], kind: str) -> Batch:
    stack = lambda key: torch.stack([torch.as_tensor(numpy.asarray(s[key])) for s in samples]).long()  # noqa: E731
    if kind == "gpt":
        return Batch(stack("tokens"), stack("labels"), stack("loss_mask").float())
    return Batch(stack("text"), stack("labels"), stack("loss_mask").float(), stack("padding_mask").float(), stack("types"))


def sample_indices(step: int, micro: int, *, global_batch: int, micro_batch: int, dp_rank: int, accumulation: int) -> range:
    """The samples of one micro-batch: data-parallel rank ``r`` takes the ``r``-th contiguous
    block of each global batch."""
    start = step * global_batch + (dp_rank * accumulation + micro) * micro_batch
    return range(start, start + micro_batch)


def micro_batches(dataset, kind: str, indices: range) -> Batch:
    return collate([dataset[i] for i in indices], kind)
