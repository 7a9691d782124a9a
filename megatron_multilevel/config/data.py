"""The ``data`` block: an indexed dataset, a weighted blend of them, or the embedded corpus."""

from dataclasses import dataclass
from typing import Any, Optional

from megatron_multilevel.config.parsing import check_positive

@dataclass
class DataConfig:
    """Training data: a Megatron indexed dataset, a weighted blend of them, or the embedded default corpus."""

    prefix: Optional[str] = None
    """Path prefix of a Megatron indexed dataset (``.bin``/``.idx``) made by
    ``tools/preprocess_data.py``; null (and no ``blend``) means the embedded corpus (the Python
    standard library's own source files, prepared once and cached)."""
    blend: Optional[list[Any]] = None
    """A weighted mixture of indexed datasets, written as Megatron's ``--data-path``: weight,
    prefix, weight, prefix, ... (``[0.3, "data/a", 0.7, "data/b"]``; weights are normalised).
    Each dataset is split by ``split`` on its own and sampled in proportion to its weight, through
    Megatron-Core's blended dataset builder. All tokenized with ``tokenizer_model``; not with ``prefix``."""
    tokenizer_model: Optional[str] = None
    """The tokenizer of ``prefix`` or ``blend`` (required with either): a SentencePiece model file,
    or a Hugging Face tokenizer directory (``tokenizer.json``, e.g. the one of a model imported with
    ``convert_checkpoint.py from-hf``)."""
    cache_dir: str = ".cache/megatron_multilevel"
    """Where the embedded corpus and Megatron's dataset indices are cached."""
    seq_length: int = 128
    """Tokens per training sequence."""
    split: str = "98,2,0"
    """Train, validation and test shares of the documents, by position in the dataset as in
    Megatron (the embedded corpus is stored in a random document order, so its held-out
    documents are a random sample)."""
    valid_seed: int = 0
    """Seed of the order (and, for BERT, the masking) of the validation samples. Independent of
    ``training.seed``, so that runs with different seeds, and every method of a comparison, are
    scored on the same validation samples."""
    order_samples: Optional[int] = None
    """Training samples the sample order is shuffled for; the run reads its first ones (null: the run's own number)."""
    masking_probability: float = 0.15
    """BERT: share of tokens masked."""
    short_sequence_probability: float = 0.1
    """BERT: probability of a shorter sequence."""
    num_workers: int = 0
    """Data-loader worker processes."""

    def __post_init__(self):
        check_positive("data.seq_length", self.seq_length)
        if self.order_samples is not None:
            check_positive("data.order_samples", self.order_samples)
        if self.prefix is not None and self.blend is not None:
            raise ValueError("data.prefix and data.blend are exclusive: prefix is one dataset, blend a mixture")
        if self.blend is not None:
            self._check_blend()
            if self.tokenizer_model is None:
                raise ValueError("data.blend needs data.tokenizer_model, the tokenizer of every blended dataset")
        elif (self.prefix is None) != (self.tokenizer_model is None):
            raise ValueError("data.prefix and data.tokenizer_model go together (both set, or both null)")
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts):
            raise ValueError(f"data.split must be three comma-separated numbers, got {self.split!r}")
        if float(parts[1]) <= 0:
            raise ValueError("data.split needs a validation share (the second number) above 0")

    def _check_blend(self) -> None:
        form = "weight, prefix, weight, prefix, ... as Megatron's --data-path, e.g. [0.3, \"data/a\", 0.7, \"data/b\"]"
        items = self.blend
        if len(items) < 2 or len(items) % 2:
            raise ValueError(f"data.blend = {items!r}: expected {form}")
        for i in range(0, len(items), 2):
            weight, prefix = items[i], items[i + 1]
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise ValueError(f"data.blend[{i}] = {weight!r}: a weight must be a number above 0; expected {form}")
            if not isinstance(prefix, str) or not prefix:
                raise ValueError(f"data.blend[{i + 1}] = {prefix!r}: a dataset prefix must be a path; expected {form}")
        prefixes = items[1::2]
        repeated = sorted({p for p in prefixes if prefixes.count(p) > 1})
        if repeated:
            raise ValueError(f"data.blend lists {repeated} more than once; give each dataset one weight")

    def blend_pairs(self) -> Optional[list[tuple[float, str]]]:
        """``[(weight, prefix), ...]`` of ``blend`` (weights as given), or None."""
        if self.blend is None:
            return None
        return [(float(w), p) for w, p in zip(self.blend[0::2], self.blend[1::2])]
