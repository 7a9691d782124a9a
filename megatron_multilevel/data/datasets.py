"""Training and validation data through Megatron-Core's dataset classes.

GPT: ``GPTDataset`` (causal LM); BERT: ``BERTMaskedWordPieceDataset`` (masked LM), both built by
``BlendedMegatronDatasetBuilder`` from one indexed dataset (``data.prefix``), or a weighted blend
of several (``data.blend``: each split by ``data.split`` on its own, then mixed in proportion to
the weights by Megatron's ``BlendedDataset``), with a held-out validation split.
Batches are addressed by global step, so a resumed run reads exactly the samples an
uninterrupted run would have read, whatever the data-parallel size of each level. Megatron
shuffles the training split for the number of samples asked for; ``data.order_samples`` asks for
one number whatever the run's length, so runs of different lengths read prefixes of one order.
"""

import os
from dataclasses import dataclass
from typing import Optional

import numpy
import torch
import torch.distributed as dist

from megatron_multilevel.config import RunConfig
from megatron_multilevel.config.parsing import read_json_object
from megatron_multilevel.data.corpus import default_corpus
from megatron_multilevel.data.preprocess import META_SUFFIX
from megatron_multilevel.data.tokenizer import load_tokenizer


@dataclass
class Data:
    train: object
    valid: object
    tokenizer: object  # SentencePieceTokenizer or HuggingFaceTokenizer
    tokenizer_path: Optional[str] = None  # its file (SentencePiece) or directory (Hugging Face)


@dataclass
class DataSources:
    """The datasets of a run and their tokenizer."""

    prefixes: list[str]
    weights: Optional[list[float]]  # None: one dataset
    tokenizer: str


def resolve_data(cfg: RunConfig) -> DataSources:
    """The configured dataset or blend, or the embedded corpus (prepared once per cache
    directory). Raises ``ValueError`` naming a missing file."""
    if cfg.data.prefix is None and cfg.data.blend is None:
        prefix, model = default_corpus(cfg.data.cache_dir, vocab_size=cfg.model.vocab_size, kind=cfg.model.kind)
        return DataSources([prefix], None, model)
    pairs = cfg.data.blend_pairs() or [(1.0, cfg.data.prefix)]
    key = "data.blend" if cfg.data.blend is not None else "data.prefix"
    for _, prefix in pairs:
        for path in (prefix + ".bin", prefix + ".idx"):
            if not os.path.isfile(path):
                raise ValueError(f"{key}: {path!r} does not exist (dataset {prefix!r}); prepare data with "
                                 f"tools/preprocess_data.py")
    if not os.path.exists(cfg.data.tokenizer_model):
        raise ValueError(f"data.tokenizer_model: {cfg.data.tokenizer_model!r} does not exist")
    weights = [w for w, _ in pairs] if cfg.data.blend is not None else None
    return DataSources([p for _, p in pairs], weights, cfg.data.tokenizer_model)


def dataset_tokenizer(prefix: str) -> Optional[dict]:
    """What ``PREFIX.meta.json`` says of the tokenizer a dataset was made with (None: not recorded)."""
    path = prefix + META_SUFFIX
    if not os.path.isfile(path):
        return None
    return read_json_object(path).get("tokenizer")


def check_tokenizers(prefixes: list[str], tokenizer) -> None:
    """Every dataset that records its tokenizer was made with ``tokenizer`` (the same fingerprint)."""
    recorded = {p: dataset_tokenizer(p) for p in prefixes}
    recorded = {p: t for p, t in recorded.items() if t}
    fingerprints = {t["fingerprint"] for t in recorded.values()}
    if len(fingerprints) > 1:
        listing = "; ".join(f"{p!r} with {t['path']!r} ({t['fingerprint']})" for p, t in recorded.items())
        raise ValueError(f"data.blend mixes datasets made with different tokenizers: {listing}. "
                         f"Tokenize every blended dataset with the same tokenizer")
    for prefix, t in recorded.items():
        if t["fingerprint"] != tokenizer.fingerprint:
            gone = "" if os.path.exists(t["path"]) else ", no longer at that path"
            raise ValueError(
                f"data: dataset {prefix!r} was made with the tokenizer {t['path']!r} ({t['fingerprint']}{gone}), but "
                f"data.tokenizer_model is {tokenizer.unique_identifiers['tokenizer_path'][0]!r} "
                f"({tokenizer.fingerprint}); set data.tokenizer_model to the dataset's tokenizer")
    unrecorded = [p for p in prefixes if p not in recorded]
    if unrecorded and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"data: {', '.join(unrecorded)} record(s) no tokenizer (no {META_SUFFIX}, as Megatron's own "
              f"preprocessing leaves it): nothing checks that data.tokenizer_model "
              f"({tokenizer.unique_identifiers['tokenizer_path'][0]}) made them; a dataset made with another tokenizer "
              f"of the same size trains without an error and exports with the wrong tokenizer", flush=True)


def check_dataset(prefix: str, tokenizer, vocab_size: int) -> None:
    """Open the indexed dataset once, turning a corrupt file into a clear error.

    The index is read alone first and the ``.bin`` size checked against it: ``IndexedDataset``
    opens the ``.bin`` and then the index in its constructor, and one that fails half-way fails
    again in its ``__del__`` (``AttributeError``), printing a traceback after our error."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexReader

    try:  # raw arrays (numpy memmap and frombuffer), no pickle: nothing in them runs
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


def ordered_samples(cfg: RunConfig, train_samples: int) -> int:
    """How many training samples Megatron shuffles for a run that reads ``train_samples`` (the run
    reads the first ones): ``data.order_samples``, else ``train_samples``. A ``ValueError`` naming the
    key where it is below ``train_samples``."""
    wanted = cfg.data.order_samples
    if wanted is None:
        return train_samples
    if wanted < train_samples:
        raise ValueError(f"data.order_samples = {wanted} is below the {train_samples} training samples the run in "
                         f"{cfg.training.output_dir} reads; set it to at least {train_samples}, or null")
    return wanted


def build_data(cfg: RunConfig, *, train_samples: int, valid_samples: int) -> Data:
    """Megatron datasets of at least the given numbers of samples (collective over all ranks).

    The training samples follow ``training.seed`` and are shuffled for ``data.order_samples`` samples
    where it is set (:func:`ordered_samples`), so that runs of different lengths read prefixes of one
    order; the validation samples follow ``data.valid_seed`` alone, so every run on the same data is
    scored on the same samples."""
    order = ordered_samples(cfg, train_samples)
    sources = resolve_data(cfg)
    tokenizer = load_tokenizer(sources.tokenizer)
    check_tokenizers(sources.prefixes, tokenizer)
    for prefix in sources.prefixes:
        check_dataset(prefix, tokenizer, cfg.model.vocab_size)
    if cfg.model.kind == "bert":
        _ = tokenizer.cls, tokenizer.sep, tokenizer.mask  # a clear error now rather than in Megatron's builder
    # Megatron builds every split of non-zero share, and BERT's sample mapping needs a number of
    # samples for each: the split a call does not use gets one sample.
    train = _build_split(cfg, sources, tokenizer, seed=cfg.training.seed, sizes=[order, 1, 1])
    valid = _build_split(cfg, sources, tokenizer, seed=cfg.data.valid_seed, sizes=[1, valid_samples, 1])
    return Data(train[0], valid[1], tokenizer, os.path.abspath(sources.tokenizer))


def _build_split(cfg: RunConfig, sources: DataSources, tokenizer, *, seed: int, sizes: list):
    """The splits of ``sizes`` (None: not built) through Megatron's dataset builder, shuffled by ``seed``
    (a blend: ``BlendedDataset``s over every dataset's own split, in proportion to the weights)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    common = dict(
        random_seed=seed,
        sequence_length=cfg.data.seq_length,
        blend=(sources.prefixes, sources.weights),
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
    if dist.get_rank() == 0:  # Megatron builds the cache on rank 0; the others read it after its barrier
        check_index_cache(config.path_to_cache)
    return BlendedMegatronDatasetBuilder(dataset_cls, sizes, lambda: True, config).build()


def check_index_cache(directory: str) -> None:
    """Refuse, in one line, a ``*.npy`` in Megatron-Core's cache of sample indices that is not a plain
    array: Megatron loads them with ``numpy.load(allow_pickle=True)``, which unpickles any other file.
    (The datasets themselves, ``.bin`` and ``.idx``, are raw arrays: no pickle.)"""
    if not os.path.isdir(directory):
        return
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".npy")):
        path = os.path.join(directory, name)
        try:  # the header alone, parsed as a literal
            with open(path, "rb") as f:
                version = numpy.lib.format.read_magic(f)
                header = {(1, 0): numpy.lib.format.read_array_header_1_0,
                          (2, 0): numpy.lib.format.read_array_header_2_0}.get(version)
                problem = f".npy version {version}" if header is None else None
                if header is not None and header(f)[2].hasobject:
                    problem = "an array of Python objects"
        except (OSError, ValueError) as e:
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
        if problem:
            raise ValueError(f"refused to read {path}: Megatron-Core's cached sample index is not a plain .npy array "
                             f"({problem}) and would be unpickled; delete it (Megatron builds it again)")


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
