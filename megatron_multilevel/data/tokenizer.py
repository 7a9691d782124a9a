"""Tokenizers with the interface Megatron-Core's datasets expect: SentencePiece, or Hugging Face.

Megatron-Core 0.16's GPT and BERT datasets take a ``MegatronLegacyTokenizer`` (vocabulary,
``eod``, ``cls``/``sep``/``mask``/``pad`` ids and ``unique_identifiers`` for the index cache).
A SentencePiece model file is the tokenizer this project trains (``train_sentencepiece``); a Hugging
Face tokenizer directory (``tokenizer.json`` or GPT-2's ``vocab.json``/``merges.txt``) is one that
came with a model, e.g. GPT-2's, so that an imported model continues on its own tokenizer.
(Megatron's newer ``megatron.core.tokenizers`` SentencePiece wrapper raises on ``cls``/``sep``/``mask``
outside its legacy mode, and the masked-LM dataset needs all three.)
"""

import hashlib
import io
import logging
import os
from typing import Iterable, Iterator, Optional

import numpy
import sentencepiece as spm
from megatron_multilevel.compat import TokenizerBase as MegatronLegacyTokenizer

# Fixed ids of the special pieces, the same in every tokenizer this project trains.
UNK, BOS, EOS, PAD = 0, 1, 2, 3
SPECIAL_PIECES = ("<cls>", "<sep>", "<mask>")  # ids 4, 5, 6
NEWLINE = "\n"  # id 7: a piece of its own, so that code and text keep their lines
TRAINING_VERSION = 2  # changes whenever the training options below change (cache keys use it)


def train_sentencepiece(sentences: Iterable[str], model_path: str, *, vocab_size: int, seed_sentences: int = 2_000_000) -> None:
    """Train a BPE SentencePiece model on ``sentences`` and write it to ``model_path``."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,  # no unknown characters: every byte has a piece
        unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=PAD,
        user_defined_symbols=[*SPECIAL_PIECES, NEWLINE],
        normalization_rule_name="identity",  # no NFKC: decoding gives back the exact text
        input_sentence_size=seed_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=16384,
        remove_extra_whitespaces=False,  # code: indentation is meaning
        split_digits=True,
        allow_whitespace_only_pieces=True,
        num_threads=2,
        minloglevel=2,
    )
    with open(model_path, "wb") as f:
        f.write(model.getvalue())


class _Tokenizer(MegatronLegacyTokenizer):
    """What Megatron-Core's datasets read of a tokenizer, from ``_vocab`` (piece -> id), which
    each subclass builds."""

    def __init__(self, path: str):
        # The base class logs a deprecation notice on every construction.
        logging.getLogger("megatron.core.datasets.megatron_tokenizer").setLevel(logging.ERROR)
        super().__init__(path)
        self._vocab: dict = {}
        self._inv_vocab: dict = {}

    def _set_vocab(self, vocab: dict) -> None:
        self._vocab = vocab
        self._inv_vocab = {i: p for p, i in vocab.items()}

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab


class SentencePieceTokenizer(_Tokenizer):
    """Tokenizer for Megatron-Core datasets, backed by a SentencePiece model file."""

    def __init__(self, model_path: str):
        super().__init__(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=model_path)
        self._set_vocab({self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())})
        missing = [p for p in SPECIAL_PIECES if p not in self._vocab]
        if missing or self._sp.pad_id() < 0 or self._sp.eos_id() < 0:
            raise ValueError(
                f"tokenizer {model_path!r} lacks the special pieces {missing or ['<pad>', '</s>']}; "
                f"train it with tools/preprocess_data.py"
            )

    @property
    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) of the model: equal for the same tokenizer wherever it lies."""
        return hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()[:16]

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def detokenize(self, ids: "numpy.ndarray | list[int]") -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def cls(self) -> int:
        return self._vocab["<cls>"]

    @property
    def sep(self) -> int:
        return self._vocab["<sep>"]

    @property
    def mask(self) -> int:
        return self._vocab["<mask>"]


class HuggingFaceTokenizer(_Tokenizer):
    """Tokenizer for Megatron-Core datasets, backed by a Hugging Face tokenizer directory (offline).

    Text is tokenized without added special tokens; ``eod`` is the tokenizer's end-of-sequence
    token (GPT-2's ``<|endoftext|>``), ``pad`` its padding token or else ``eod``."""

    def __init__(self, path: str):
        super().__init__(path)
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise ValueError(f"tokenizer {path!r} is a Hugging Face tokenizer; reading it needs transformers: "
                             f"pip install 'megatron-multilevel[hf]'") from None
        hf_logging.set_verbosity_error()
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer {path!r} is not a readable Hugging Face tokenizer directory ({e})") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {path!r} has no end-of-sequence token (eos_token), the end-of-document "
                             f"token of GPT datasets")
        self._set_vocab(dict(self._tok.get_vocab()))

    @property
    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) of the vocabulary and merges (the backend's serialized form)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else repr(sorted(self._vocab.items(), key=lambda kv: kv[1]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def tokenize(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    def detokenize(self, ids: "numpy.ndarray | list[int]") -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._tok.eos_token_id

    @property
    def pad(self) -> int:
        return self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eod

    def _special(self, name: str) -> int:
        token_id = getattr(self._tok, f"{name}_token_id")
        if token_id is None:
            raise ValueError(f"tokenizer {self.unique_identifiers['tokenizer_path'][0]!r} has no {name} token; "
                             f"BERT (masked LM) data needs cls, sep and mask tokens")
        return token_id

    @property
    def cls(self) -> int:
        return self._special("cls")

    @property
    def sep(self) -> int:
        return self._special("sep")

    @property
    def mask(self) -> int:
        return self._special("mask")


HF_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str) -> "SentencePieceTokenizer | HuggingFaceTokenizer":
    """A SentencePiece model file, or a Hugging Face tokenizer directory."""
    # A SentencePiece model is a protobuf, a Hugging Face tokenizer JSON and text files read with
    # local_files_only and no remote code: neither holds a pickle, nothing in them runs.
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in HF_TOKENIZER_FILES):
            raise ValueError(f"tokenizer {path!r} is a directory without Hugging Face tokenizer files "
                             f"({', '.join(HF_TOKENIZER_FILES)}); give a SentencePiece model or a tokenizer directory")
        return HuggingFaceTokenizer(path)
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer {path!r} does not exist; give a SentencePiece model file or a Hugging Face "
                         f"tokenizer directory")
    try:
        return SentencePieceTokenizer(path)
    except (RuntimeError, OSError) as e:  # sentencepiece's parse error
        raise ValueError(f"tokenizer {path!r} is not a SentencePiece model ({e})") from None


def sentences_of(documents: Iterable[str], *, max_chars: int = 4096) -> Iterator[str]:
    """Lines of the documents (non-blank), cut to ``max_chars``: SentencePiece's training units."""
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line[:max_chars]


RUN_TOKENIZER = ("tokenizer.model", "tokenizer")  # in a run directory: a SentencePiece file, or a directory


def keep_tokenizer(tokenizer_path: str, run_dir: str) -> str:
    """A copy of a run's tokenizer in its run directory (``tokenizer.model``, or ``tokenizer/`` for a
    Hugging Face directory), written once and atomically, so that the run directory exports with
    its tokenizer from anywhere, copied anywhere. Returns the copy's path."""
    import shutil

    name = RUN_TOKENIZER[1] if os.path.isdir(tokenizer_path) else RUN_TOKENIZER[0]
    target = os.path.join(run_dir, name)
    if os.path.exists(target):
        return target
    tmp = f"{target}.tmp{os.getpid()}"
    if os.path.isdir(tokenizer_path):
        shutil.copytree(tokenizer_path, tmp)
    else:
        shutil.copyfile(tokenizer_path, tmp)
    os.replace(tmp, target)
    return target


def run_tokenizer_copy(run_dir: str) -> Optional[str]:
    """The tokenizer kept in ``run_dir`` by :func:`keep_tokenizer`, or None."""
    for name in RUN_TOKENIZER:
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            return os.path.abspath(path)
    return None
