"""What checkpoint integrity costs: CRC-32 of a checkpoint-sized file against writing it.

    python tools/benchmark_checksum.py --megabytes 512

Every save checksums its files (each rank a share, right after they are written: ``training/
manifest.py``), and every resume checks them again before loading; this prints the time of both
against ``torch.save`` of the same bytes, fsynced.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--megabytes", type=int, default=512, help="size of the file (default 512)")
    p.add_argument("--dir", default=None, help="where to write it (default: the system's temporary directory)")
    args = p.parse_args(argv)
    import torch

    from megatron_multilevel.training.manifest import file_entry

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "model_states.pt")
        tensor = torch.randn(args.megabytes * 2**20 // 4)
        t0 = time.perf_counter()
        torch.save({"module": tensor}, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        size, _ = file_entry(path)
        crc = time.perf_counter() - t0
    print(f"{size / 1e6:.0f} MB: torch.save + fsync {save:.2f} s; CRC-32 {crc:.2f} s ({size / crc / 1e9:.2f} GB/s per "
          f"rank), {100 * crc / save:.0f}% of the save")
    return 0


if __name__ == "__main__":
    sys.exit(main())
