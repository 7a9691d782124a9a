"""A SentencePiece tokenizer with the interface Megatron-Core's datasets expect.

Megatron-Core 0.16's GPT and BERT datasets take a ``MegatronLegacyTokenizer`` (vocabulary,
``eod``, ``cls``/``sep``/``mask``/``pad`` ids and ``unique_identifiers`` for the index cache);
SentencePiece does the tokenising and the training. (Megatron's newer ``megatron.core.tokenizers``
SentencePiece wrapper raises on ``cls``/``sep``/``mask`` outside its legacy mode, and the masked-LM
dataset needs all three.)
"""

import io
import logging
from typing import Iterable, Iterator

import numpy
import sentencepiece as spm
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

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


class SentencePieceTokenizer(MegatronLegacyTokenizer):
    """Tokenizer for Megatron-Core datasets, backed by a SentencePiece model file."""

    def __init__(self, model_path: str):
        # The base class logs a deprecation notice on every construction.
        logging.getLogger("megatron.core.datasets.megatron_tokenizer").setLevel(logging.ERROR)
        super().__init__(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=model_path)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
        self._inv_vocab = {i: p for p, i in self._vocab.items()}
        missing = [p for p in SPECIAL_PIECES if p not in self._vocab]
        if missing or self._sp.pad_id() < 0 or self._sp.eos_id() < 0:
            raise ValueError(
                f"tokenizer {model_path!r} lacks the special pieces {missing or ['<pad>', '</s>']}; "
                f"train it with tools/preprocess_data.py"
            )

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def detokenize(self, ids: "numpy.ndarray | list[int]") -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab

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


def sentences_of(documents: Iterable[str], *, max_chars: int = 4096) -> Iterator[str]:
    """Lines of the documents (non-blank), cut to ``max_chars``: SentencePiece's training units."""
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line[:max_chars]
