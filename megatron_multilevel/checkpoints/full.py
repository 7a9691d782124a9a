"""Consolidated checkpoints: one file of full fp32 tensors plus ``checkpoint.json``.

``checkpoint.json`` holds the model config, the level, the level maps (the groupings that
de-coalescing must reuse), where the tensors came from, and a checksum per tensor.
"""

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Optional

import torch

from megatron_multilevel.config import ModelConfig
from megatron_multilevel.config.parsing import parse_dataclass, read_json_object
from megatron_multilevel.training.safe_load import load_restricted

META = "checkpoint.json"
FORMATS = ("safetensors", "torch")
FILES = {"safetensors": "model.safetensors", "torch": "model.pt"}
KIND = "megatron-multilevel-full"
TOKENIZER_FILE, TOKENIZER_DIR = "tokenizer.model", "tokenizer"  # a SentencePiece model, or Hugging Face files


def checksum(t: torch.Tensor) -> str:
    """SHA-256 (first 16 hex digits) of a tensor's fp32 bytes."""
    data = t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def prepare_output(path: str, overwrite: bool, *sources: str) -> str:
    """A fresh output directory: refuse an existing one unless ``overwrite``, and never a source."""
    for source in sources:
        if os.path.abspath(source) == os.path.abspath(path):
            raise ValueError(f"output {path!r} is the source; conversions write a new directory")
    if os.path.exists(path):
        if not overwrite:
            raise ValueError(f"output {path!r} exists; choose another or pass --overwrite")
        shutil.rmtree(path)
    return path


def save_full(path: str, tensors: dict[str, torch.Tensor], model: ModelConfig, *, level: int = 0,
              level_maps: Optional[list[str]] = None, source: Optional[dict] = None, fmt: str = "safetensors",
              extra: Optional[dict] = None, tokenizer: Optional[str] = None) -> None:
    """Write a consolidated checkpoint into the directory ``path`` (written whole, then renamed).

    ``tokenizer`` (a SentencePiece model file or a Hugging Face tokenizer directory) is copied in,
    so that the checkpoint carries the tokenizer its token ids belong to."""
    if fmt not in FORMATS:
        raise ValueError(f"invalid format {fmt!r}; valid choices are {list(FORMATS)}")
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in tensors.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(tmp, FILES[fmt]))
    else:
        torch.save(tensors, os.path.join(tmp, FILES[fmt]))
    if tokenizer is not None and os.path.isdir(tokenizer):  # only its tokenizer files, not a model beside them
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(os.path.join(tmp, TOKENIZER_DIR))
    elif tokenizer is not None:
        shutil.copy(tokenizer, os.path.join(tmp, TOKENIZER_FILE))
    meta = {
        "kind": KIND, "version": 1, "format": fmt, "model": dataclasses.asdict(model), "level": level,
        "tokenizer": None if tokenizer is None else TOKENIZER_DIR if os.path.isdir(tokenizer) else TOKENIZER_FILE,
        "level_maps": level_maps or [], "source": source or {},
        "parameters": sum(v.numel() for v in tensors.values()),
        "checksums": {k: checksum(v) for k, v in tensors.items()},
        **(extra or {}),
    }
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, path)


def is_full(path: str) -> bool:
    meta = os.path.join(path, META)
    return os.path.isfile(meta) and read_json_object(meta).get("kind") == KIND


def load_full(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """``(tensors, model config, metadata)``; checksums are verified."""
    meta = read_json_object(os.path.join(path, META))
    if meta.get("kind") != KIND:
        raise ValueError(f"{path} is not a consolidated checkpoint of this project")
    if meta.get("format") not in FORMATS:
        raise ValueError(f"{path}: {META} names the format {meta.get('format')!r}; valid choices are {list(FORMATS)}")
    file = os.path.join(path, FILES[meta["format"]])
    if meta["format"] == "safetensors":  # tensors and a JSON header: no pickle
        from safetensors.torch import load_file

        tensors = load_file(file)
    else:
        tensors = load_restricted(file, (), "a consolidated checkpoint of this project")
    bad = [k for k, v in tensors.items() if meta["checksums"].get(k) != checksum(v)]
    if bad or set(tensors) != set(meta["checksums"]):
        raise ValueError(f"{path}: tensors do not match their checksums: {bad[:6] or 'missing or extra tensors'}")
    return tensors, parse_dataclass(ModelConfig, meta["model"], "checkpoint.model"), meta
