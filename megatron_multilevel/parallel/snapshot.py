"""Snapshots: a level's tensors kept for later (the fine model before coalescing or restriction,
optimizer state staged for the next engine), partitioned over the ranks of a group and held on the
device, in host memory or on disk.

A snapshot is written and read like a model (``write_model`` / ``write_layer``, ``read_model`` /
``read_layer``, vocabulary rows slab by slab), so that the transitions stream into and out of it as
they do with ``streams.ModelReader`` and ``streams.ModelWriter``. All methods are collective over
its group.
"""

import math
import os
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_multilevel.parallel.streams import Rows
from megatron_multilevel.parallel.zero import gather_range, write_range

Storage = Literal["memory", "cpu", "disk"]
STORAGES = ("memory", "cpu", "disk")


class Snapshot:
    """A level's tensors kept for later (the fine model before coalescing, staged moments),
    each stored as flat equal partitions over the ranks of ``group``.

    With ``group`` the world and full tensors, the snapshot no longer depends on the layout it
    came from; with the data-parallel group and local shards, it serves the fast path.
    """

    def __init__(self, group=None, *, storage: Storage = "memory", directory: Optional[str] = None):
        if storage not in STORAGES:
            raise ValueError(f"invalid snapshot storage {storage!r}; valid choices are {list(STORAGES)}")
        if storage == "disk" and not directory:
            raise ValueError("a snapshot stored on disk needs a directory")
        self.group, self.storage, self.directory = group, storage, directory
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._parts: dict[tuple[str, str], torch.Tensor] = {}
        self._shapes: dict[tuple[str, str], tuple[torch.Size, torch.dtype]] = {}
        self.model_names: list[str] = []
        self.layer_names: list[str] = []

    def write_model(self, values: dict[str, torch.Tensor], rows: Optional[Rows] = None) -> None:
        """Keep full tensors, or rows of them (written in order, from row 0)."""
        if rows is None:
            self._put("model", values, self.model_names)
            return
        for name, t in values.items():
            self._put_rows("model", name, rows, t)

    def write_layer(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        self._put(f"layer{layer}", values, self.layer_names)

    def read_model(self, names: Sequence[str], rows: Optional[Rows] = None) -> dict[str, torch.Tensor]:
        return {name: self._get("model", name) if rows is None else self._get_rows("model", name, rows)
                for name in names}

    def num_rows(self, name: str) -> int:
        return self._shapes["model", name][0][0]

    def read_layer(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {name: self._get(f"layer{layer}", name) for name in names}

    def _put(self, key: str, values: dict[str, torch.Tensor], names: list[str]) -> None:
        for name, t in values.items():
            if name not in names:
                names.append(name)
            flat = t.detach().reshape(-1)  # t.shape -> (t.numel(),)
            chunk = math.ceil(flat.numel() / self.size)
            device = t.device if self.storage == "memory" else torch.device("cpu")
            part = torch.zeros(chunk, dtype=t.dtype, device=device)
            mine = flat[self.rank * chunk : (self.rank + 1) * chunk]
            part[: mine.numel()].copy_(mine)
            self._shapes[key, name] = (t.shape, t.dtype)
            if self.storage == "disk":
                self._save(key, name, part)
            else:
                self._parts[key, name] = part

    def _put_rows(self, key: str, name: str, rows: Rows, t: torch.Tensor) -> None:
        """Keep rows of a tensor: this rank's overlap of their flat range. On disk, the partition
        is saved once its last row is in."""
        shape = torch.Size((rows.num_rows, *t.shape[1:]))
        if rows.start == 0:
            if name not in self.model_names:
                self.model_names.append(name)
            device = t.device if self.storage == "memory" else torch.device("cpu")
            self._parts[key, name] = torch.zeros(math.ceil(shape.numel() / self.size), dtype=t.dtype, device=device)
            self._shapes[key, name] = (shape, t.dtype)
        assert self._shapes[key, name] == (shape, t.dtype) and (key, name) in self._parts, (key, name, rows)
        width = math.prod(shape[1:])
        # t: (rows.stop - rows.start, *shape[1:]) -> ((rows.stop - rows.start) * width,)
        write_range(self._parts[key, name], self.group, rows.start * width, t.detach().reshape(-1), shape.numel())
        if self.storage == "disk" and rows.stop == rows.num_rows:
            self._save(key, name, self._parts.pop((key, name)))

    def _save(self, key: str, name: str, part: torch.Tensor) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = self._path(key, name)
        torch.save(part, path + ".tmp")
        os.replace(path + ".tmp", path)

    def _path(self, key: str, name: str) -> str:
        return os.path.join(self.directory, f"{key}.{name}.rank{self.rank}.pt")

    def _get_rows(self, key: str, name: str, rows: Rows) -> torch.Tensor:
        """Rows of a kept tensor, gathering only their flat range (from disk, memory-mapped)."""
        shape, dtype = self._shapes[key, name]
        part = torch.load(self._path(key, name), mmap=True) if self.storage == "disk" else self._parts[key, name]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else part.device
        width = math.prod(shape[1:])
        flat = gather_range(part, self.group, rows.start * width, rows.stop * width, device)
        # ((rows.stop - rows.start) * width,) -> (rows.stop - rows.start, *shape[1:])
        return flat.view(rows.stop - rows.start, *shape[1:]).to(dtype)

    def _get(self, key: str, name: str) -> torch.Tensor:
        shape, dtype = self._shapes[key, name]
        part = torch.load(self._path(key, name)) if self.storage == "disk" else self._parts[key, name]
        if torch.cuda.is_available():
            part = part.to(torch.device("cuda", torch.cuda.current_device()))
        if self.size > 1:
            gathered = part.new_empty(part.numel() * self.size)
            dist.all_gather_into_tensor(gathered, part, group=self.group)
            part = gathered
        # (size * chunk,) -> (prod(shape),), the padding dropped -> shape
        return part[: math.prod(shape)].view(shape).to(dtype)

    def local_bytes(self) -> int:
        """Bytes this rank holds in memory (zero for a snapshot on disk)."""
        return sum(t.numel() * t.element_size() for t in self._parts.values())
