"""Raw text or JSONL -> tokenizer -> Megatron indexed dataset (``.bin``/``.idx``).

The way Megatron users prepare data (``tools/preprocess_data.py`` is the command line); the files
are written with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``. The tokenizer is
a SentencePiece model trained on the input, an existing one, or a Hugging Face tokenizer directory;
``PREFIX.meta.json`` records which (its fingerprint), so that a run refuses data made with another.
"""

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy

from megatron_multilevel.data.tokenizer import load_tokenizer, sentences_of, train_sentencepiece

META_SUFFIX = ".meta.json"  # PREFIX.meta.json: the tokenizer a dataset was made with, and its counts


def read_documents(paths: Sequence["str | os.PathLike"], *, json_key: str = "text") -> Iterator[str]:
    """Documents of text files (one document per file) and JSONL files (one per line)."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"input {str(path)!r} is not a file")
        if path.suffix in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
                    if not isinstance(record, dict) or json_key not in record:
                        raise ValueError(f"{path}:{n}: no {json_key!r} key")
                    yield str(record[json_key])
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def _dtype(vocab_size: int):
    return numpy.uint16 if vocab_size <= 65535 else numpy.int32


def write_indexed_dataset(
    documents: Iterable[str],
    tokenizer,
    prefix: str,
    *,
    split_sentences: bool = False,
    batch: int = 256,
) -> dict:
    """Tokenize ``documents`` into ``prefix.bin``/``prefix.idx``.

    GPT: one sequence per document, ending in the end-of-document token. BERT
    (``split_sentences``): each document's non-blank lines are its sentences (what Megatron's
    masked-LM dataset packs into segments), no end-of-document token. Written to temporary names
    and renamed, so that a crash never leaves a half dataset behind.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=_dtype(tokenizer.vocab_size))
    stats = {"documents": 0, "tokens": 0}

    def flush(docs: list[str]) -> None:
        for doc in docs:
            if split_sentences:
                sentences = [s for s in tokenizer.tokenize_batch([l for l in doc.split("\n") if l.strip()]) if s]
                if not sentences:
                    continue
                tokens = [t for s in sentences for t in s]
                lengths = [len(s) for s in sentences]
            else:
                tokens = tokenizer.tokenize(doc) + [tokenizer.eod]
                lengths = [len(tokens)]
            builder.add_document(tokens, lengths)
            stats["documents"] += 1
            stats["tokens"] += len(tokens)

    pending: list[str] = []
    for doc in documents:
        pending.append(doc)
        if len(pending) >= batch:
            flush(pending)
            pending = []
    flush(pending)
    if not stats["documents"]:
        raise ValueError("no documents to write: the inputs are empty")
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    return stats


def prepare(
    inputs: Sequence["str | os.PathLike"],
    prefix: str,
    *,
    vocab_size: int,
    tokenizer_model: "str | None" = None,
    split_sentences: bool = False,
    json_key: str = "text",
) -> dict:
    """Train (or load) a tokenizer and write the indexed dataset; returns counts and paths.

    ``tokenizer_model``: a SentencePiece model file or a Hugging Face tokenizer directory (None:
    train a SentencePiece model on the inputs, ``PREFIX.model``)."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    if os.path.exists(prefix + META_SUFFIX):  # it would describe the files being replaced
        os.remove(prefix + META_SUFFIX)
    if tokenizer_model is None:
        tokenizer_model = prefix + ".model"
        tmp = f"{tokenizer_model}.tmp{os.getpid()}"
        train_sentencepiece(sentences_of(read_documents(inputs, json_key=json_key)), tmp, vocab_size=vocab_size)
        os.replace(tmp, tokenizer_model)
    tokenizer = load_tokenizer(tokenizer_model)
    stats = write_indexed_dataset(
        read_documents(inputs, json_key=json_key), tokenizer, prefix, split_sentences=split_sentences
    )
    record = {"tokenizer": {"path": os.path.abspath(tokenizer_model), "kind": type(tokenizer).__name__,
                            "fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size},
              **stats, "split_sentences": split_sentences}
    with open(prefix + META_SUFFIX, "w") as f:
        json.dump(record, f, indent=1)
    return {**stats, "prefix": prefix, "tokenizer_model": tokenizer_model, "vocab_size": tokenizer.vocab_size}
