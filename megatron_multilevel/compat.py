"""What differs between the Megatron-Core versions this project supports, in one place.

Python 3.10-3.11 installs megatron-core 0.16.1 and Python 3.12+ the 0.19 series (``pyproject.toml``;
Megatron-Core 0.17+ needs Python 3.12). What differs between them for this project:

- 0.17 removed ``megatron.core.datasets.megatron_tokenizer.MegatronLegacyTokenizer``, the base class
  of the tokenizers that Megatron's GPT and BERT datasets read (vocabulary, special ids and
  ``unique_identifiers`` for the index cache). Its replacement, ``megatron.core.tokenizers``, wraps
  tokenizer libraries of its own; the datasets still read the same attributes, so the base class is
  kept here, with the same interface, for the versions that no longer ship it.

The same on both, and tested on both (tests/test_compat.py, the model, transition and checkpoint
tests): the parameter names and layouts, ``get_gpt_layer_local_spec`` / ``bert_layer_local_spec``,
the dataset config fields the project sets, the ``parallel_state`` calls and the three CUDA points
of ``cpu_shims``. 0.19 logs that ``GPTModel`` is deprecated in favour of its ``HybridModel``; it
builds and trains the same, and ``quiet_library_notices`` drops that notice.

The torch builds differ too: PyPI's torch for Python 3.12 is built with CUDA. On a machine with a
CUDA toolkit but no GPU, importing ``torch.utils.cpp_extension`` (Megatron-Core's
``tensor_parallel.random`` and DeepSpeed's op builder do) logs that no CUDA runtime was found, which
concerns nothing a CPU run does; ``quiet_library_notices`` drops it as well.
"""

import json
import logging
import os
import re
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any


def megatron_core_version() -> tuple:
    """(major, minor) of the Megatron-Core in use, a wheel or a source checkout alike."""
    from megatron.core.package_info import MAJOR, MINOR

    return MAJOR, MINOR


# Library log records that tell a user of this project nothing it can act on: logger name -> the
# start of the record's message. Only these records are dropped; the loggers' other records pass.
KNOWN_NOTICES = {
    # Megatron-Core 0.19+, on every GPTModel built (each level's model, each transition).
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    # torch built with CUDA, on importing its extension builder without a usable GPU.
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


# Library warnings that tell a user of this project nothing it can act on: (the start of the message,
# its category, each module that warns it). Only these are dropped, in this process and, through
# PYTHONWARNINGS, in the processes it starts (a tool's ranks import Megatron-Core before any code of
# theirs runs); every other warning of these modules passes.
KNOWN_WARNINGS = (
    # Megatron-Core, on import without Transformer Engine or Apex (every CPU machine): it falls back
    # to torch's implementations, which are the ones this project uses.
    ("Transformer Engine and Apex are not installed", UserWarning, (
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision", "megatron.core.optimizer",
        "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads")),
    # torch 2.13 on every all_gather_into_tensor, which parallel/snapshot.py gathers a pipeline's stages with
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning, ("torch.distributed.c10d_logger",)),
)


def _python_warnings() -> list[str]:
    """``KNOWN_WARNINGS`` as ``PYTHONWARNINGS`` entries (``ignore:message:category:module``)."""
    return [f"ignore:{start}:{category.__name__}:{module}"
            for start, category, modules in KNOWN_WARNINGS for module in modules]


class _DropNotice(logging.Filter):
    """Drops the records of one logger whose message starts with ``start``."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_library_notices() -> None:
    """Drop the ``KNOWN_NOTICES`` records, in this process, from now on, and the ``KNOWN_WARNINGS``
    here and in the processes it starts (idempotent).

    Call it before Megatron-Core or DeepSpeed is imported: torch's extension builder logs its notice
    once, when either first imports it. The filters sit on the loggers themselves, which exist
    before the modules that log through them are imported. Without a GPU it also names DeepSpeed's
    accelerator (``DS_ACCELERATOR=cpu``, inherited by the ranks a tool spawns)."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():  # as the launcher does: DeepSpeed told, not warning on every rank
            os.environ["DS_ACCELERATOR"] = "cpu"
    for name, start in KNOWN_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.start == start for f in logger.filters):
            logger.addFilter(_DropNotice(start))
    for start, category, modules in KNOWN_WARNINGS:
        for module in modules:
            warnings.filterwarnings("ignore", message=re.escape(start), category=category,
                                    module=re.escape(module) + r"\Z")
    given = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(given + [w for w in _python_warnings() if w not in given])


def sequence_parallel_supported(kind: str) -> bool:
    """Whether a model of ``kind`` ("gpt", "bert") can run sequence-parallel with what is installed:
    GPT everywhere (``models.SequenceParallelTorchNorm`` stands in for Megatron's torch norm); BERT
    only with Apex's fused norm, since Megatron's BERT LM head builds its norm itself and its torch
    fallback rejects sequence parallelism."""
    if kind == "gpt":
        return True
    from megatron.core.fusions.fused_layer_norm import HAVE_FUSED_LAYER_NORM

    return bool(HAVE_FUSED_LAYER_NORM)


def has_legacy_tokenizer() -> bool:
    """Whether Megatron-Core still ships ``MegatronLegacyTokenizer`` (up to 0.16)."""
    return megatron_core_version() < (0, 17)


class _TokenizerBase(ABC):
    """``MegatronLegacyTokenizer``'s interface, for Megatron-Core 0.17+: what its datasets read.

    ``unique_identifiers`` name the tokenizer in the datasets' index cache; a subclass gives the
    vocabulary, and the special ids it lacks raise ``NotImplementedError``, which the datasets catch."""

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text: str):
        """Token ids of ``text``."""

    @property
    @abstractmethod
    def vocab(self) -> dict:
        """Piece -> id."""

    @property
    @abstractmethod
    def inv_vocab(self) -> dict:
        """Id -> piece."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids."""

    def _missing(self, what: str):
        raise NotImplementedError(f"{type(self).__name__} has no {what!r}")

    def detokenize(self, ids):
        self._missing("detokenize")

    def offsets(self, ids, text: str):
        self._missing("offsets")

    cls = property(lambda self: self._missing("cls"))
    sep = property(lambda self: self._missing("sep"))
    pad = property(lambda self: self._missing("pad"))
    eod = property(lambda self: self._missing("eod"))
    bos = property(lambda self: self._missing("bos"))
    eos = property(lambda self: self._missing("eos"))
    mask = property(lambda self: self._missing("mask"))


def __getattr__(name: str):
    """``TokenizerBase``: ``MegatronLegacyTokenizer`` where Megatron-Core ships it, else the copy above.

    Resolved on first use rather than on import, so that importing this module does not import
    Megatron-Core: ``quiet_library_notices`` must run before Megatron-Core's imports log."""
    if name != "TokenizerBase":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if has_legacy_tokenizer():
        from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer as base
    else:
        base = _TokenizerBase
    globals()["TokenizerBase"] = base
    return base
