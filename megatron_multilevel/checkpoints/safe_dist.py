"""Read a Megatron-Core ``torch_dist`` checkpoint without running code from it.

Such a directory is a set of pickles, and the libraries that read it trust them: torch's
distributed-checkpoint reader unpickles ``.metadata`` with plain ``pickle.load``, Megatron-Core
loads ``common.pt`` with ``torch.load``'s default, and torch's load planner unpickles the byte
items of the ``.distcp`` shards with ``weights_only=False``. Here each file is read with what it
may hold and nothing else:

- ``.metadata``: an unpickler that admits ``METADATA_CLASSES`` alone, read before any other file
  of the directory is unpickled; its shards must lie in the directory;
- ``common.pt``: ``weights_only=True`` with ``COMMON_CLASSES`` (Megatron-LM's ``args``);
- the ``.distcp`` shards: tensors only (``weights_only=True``, torch's own types); byte items
  (pickled objects) are refused.

A file that asks for anything else is refused with a one-line ``ValueError`` naming the file and
what it asked for, and nothing from it runs. :func:`load` is ``dist_checkpointing.load`` reading
through these readers.
"""

import argparse
import dataclasses
import os
import pickle

import torch
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from megatron_multilevel.training.safe_load import load_restricted, only_safe_globals, refusal

METADATA = ".metadata"
COMMON = "common.pt"

# What a ``.metadata`` may ask for, module -> names: the classes in those Megatron-Core 0.16 writes
# with torch 2.13 (its ``Metadata`` with the save plans of every rank), the two placeholder classes
# Megatron-Core keeps to read its older checkpoints, and the ``TensorProperties`` of older torch;
# besides, every torch dtype. All are data holders: building them runs nothing else.
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties", "MEM_FORMAT_ENCODING"),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCoreMetadata", "MCoreSavePlan"),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),  # a tensor layout by its name
}
COMMON_CLASSES = (argparse.Namespace,)  # Megatron-LM's args
COMMON_HOLDER = "a torch_dist checkpoint's common state"
SHARDS_HOLDER = "a torch_dist checkpoint's shard"


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in METADATA_CLASSES.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def read_metadata(directory: str) -> Metadata:
    """The checkpoint's ``.metadata``, unpickled with ``METADATA_CLASSES`` alone."""
    path = os.path.join(directory, METADATA)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise ValueError(f"refused to read {path}: it asks to load {e}, which is not among the classes a torch_dist "
                         f"checkpoint's metadata holds (torch.distributed.checkpoint's metadata classes); nothing "
                         f"from it was run (unpickling it could execute code)") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 (whatever a damaged pickle raises)
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(f"{path} is not a torch_dist checkpoint's metadata ({type(e).__name__}: {first})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not a torch_dist checkpoint's metadata")
    for info in (metadata.storage_data or {}).values():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or where in ("", ".", "..") or os.path.basename(where) != where:
            raise ValueError(f"refused to read {path}: it places a shard at {where!r}, outside its directory")
    return metadata


def tensor_shapes(metadata: Metadata) -> dict:
    """The global shape of every tensor the checkpoint holds, by its key."""
    return {key: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def load_common(directory: str) -> dict:
    """The checkpoint's common (non-sharded) state, ``common.pt``, read with ``COMMON_CLASSES``."""
    path = os.path.join(directory, COMMON)
    if not os.path.isfile(path):
        raise ValueError(f"{directory} has no {COMMON} (the common state of a torch_dist checkpoint)")
    common = load_restricted(path, COMMON_CLASSES, COMMON_HOLDER)
    if not isinstance(common, dict):
        raise ValueError(f"{path} holds a {type(common).__name__}, not a torch_dist checkpoint's common state")
    return common


class _CommonReader(TorchCommonLoadStrategy):
    """Megatron-Core's common-state loading, through :func:`load_common`."""

    def load_common(self, checkpoint_dir):
        return load_common(str(checkpoint_dir))

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        raise ValueError(f"{checkpoint_dir}: its sharded objects (pickles) are not read here, only tensors")


class _ShardReader(FileSystemReader):
    """torch's file reader with the metadata of :func:`read_metadata` and tensors only from the
    shards; ``refused`` keeps its refusal (torch wraps what a reader raises in its own exception)."""

    def __init__(self, path):
        super().__init__(path)
        self.refused = None
        self._metadata = None

    def read_metadata(self) -> Metadata:  # no ``rank``: torch then never reads the ranks' own metadata files
        if self._metadata is None:
            try:
                self._metadata = read_metadata(str(self.path))
            except ValueError as e:
                self._refuse(str(e))
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan, planner) -> Future:
        by_file = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            path = os.path.join(self.path, name)
            if any(item.type == LoadItemType.BYTE_IO for item in items):
                self._refuse(f"refused to read {path}: the checkpoint asks to unpickle objects from it, which are not "
                             f"read here (only tensors)")
            try:
                with only_safe_globals(()):
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as e:
                self._refuse(refusal(path, e, (), SHARDS_HOLDER))
        done = Future()
        done.set_result(None)
        return done

    def _refuse(self, message: str):
        self.refused = message
        raise ValueError(message)


def load(sharded_state_dict: dict, directory: str) -> dict:
    """``dist_checkpointing.load(sharded_state_dict, directory)`` with every file read as above
    (Megatron-Core builds its torch readers by name: those names are ours for the call)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    readers = []

    class Reader(_ShardReader):
        def __init__(self, path):
            super().__init__(path)
            readers.append(self)

    saved = strategy.FileSystemReader, strategy.CachedMetadataFileSystemReader
    strategy.FileSystemReader = strategy.CachedMetadataFileSystemReader = Reader
    try:
        loaded = dist_checkpointing.load(sharded_state_dict, directory, common_strategy=_CommonReader())
    except BaseException:
        refused = next((r.refused for r in readers if r.refused), None)
        if refused is None:
            raise
        raise ValueError(refused) from None
    finally:
        strategy.FileSystemReader, strategy.CachedMetadataFileSystemReader = saved
    assert readers, "Megatron-Core read the checkpoint without the restricted reader"
    return loaded
