"""What a complete checkpoint is made of: every file's size and CRC-32.

The sidecar of a checkpoint records them when it is saved (``checkpoint.save``, each rank
checksumming a share of the files right after they are written, while they are in the page
cache); a resume checks them before it loads, and falls back to the previous complete checkpoint
when one is missing, truncated or altered (``checkpoint.read_resumable``);
``tools/inspect_checkpoint.py --verify`` checks them on request. CRC-32 (zlib) finds what storage
does to files (truncation, partial copies, flipped bits); it is no defence against tampering,
which is what ``training.safe_load``'s allowlist is for. Plain files only, no torch.distributed.
"""

import os
import zlib
from typing import Iterable, Mapping, Optional

CHUNK = 1 << 22


def list_files(directory: str, *, skip: Iterable[str] = ()) -> list[str]:
    """The regular files under ``directory`` (paths relative to it, sorted), but ``skip`` and the
    temporary files of an atomic write."""
    skip = set(skip)
    out = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in skip and ".tmp" not in name:
                out.append(rel)
    return sorted(out)


def file_entry(path: str) -> list[int]:
    """``[size in bytes, CRC-32]`` of the file at ``path``."""
    crc, size = 0, 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return [size, crc]


def entries(directory: str, names: Iterable[str]) -> dict[str, list[int]]:
    """``{name: [size, CRC-32]}`` of the files ``names`` under ``directory``."""
    return {name: file_entry(os.path.join(directory, name)) for name in names}


def problem(directory: str, files: Mapping[str, list], names: Optional[Iterable[str]] = None) -> Optional[str]:
    """What is wrong with the files ``names`` (default: all) of ``files`` under ``directory``, in
    one phrase naming the first bad file; None when every one has its recorded size and CRC-32."""
    for name in sorted(files if names is None else names):
        size, crc = files[name]
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{path} has {actual} bytes, {size} when it was written"
        if file_entry(path)[1] != crc:
            return f"{path} does not match the checksum written with it"
    return None
