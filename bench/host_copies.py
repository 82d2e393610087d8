"""Pinned host <-> device copy bandwidth on this machine (what moving activations between the
rollout and the update through host memory would cost): one copy of each size, 10 times.

    python bench/host_copies.py
"""

from __future__ import annotations

import time

import torch


def main() -> None:
    for mib in (11, 64, 512):
        n = mib << 20
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for name, dst, src in (("H2D", dev, host), ("D2H", host, dev)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / 10
            print(f"pinned {name} {mib} MiB: {seconds * 1e3:.2f} ms, {n / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
