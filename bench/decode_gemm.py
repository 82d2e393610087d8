"""The decode step's matrix products alone, one shape at a time, against their floor (a bench tool).

    python bench/decode_gemm.py [--shape qwen2.5-0.5b] [--rows 256] [--out DIR]

For each weight the engine multiplies per decode step (fused q/k/v, o, fused gate/up, down, the
LM head) at `rows` sequences: `F.linear` (cuBLAS, what the engine runs) replayed from a CUDA graph,
and a split-K Triton product over tile sizes and split counts (the partial sums added in float32
with atomics, then cast), each against the shape's floor: max(bytes / measured bandwidth, FLOPs /
measured peak). A small-N product at 256 rows has few output tiles (down at N = 896: 14 tiles of
128 x 128 on 132 SMs), so cuBLAS may run it at latency speed; splitting K puts more SMs on it.
Two more candidates per shape (session 24): cuBLASLt (`torch.backends.cuda.preferred_blas_library`),
whose heuristics choose among other kernels than cuBLAS's, and Inductor's autotuned Triton
product (`torch.compile(mode="max-autotune-no-cudagraphs")`, static shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import graph_ms, measure_bandwidth, measure_matmul_flops


@triton.jit
def _splitk_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BN)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = pid_k * k_per
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(0, k_per, BK):  # k_per is a multiple of BK
        kk = k0 + i + rk
        a = tl.load(
            x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K)
        )
        b = tl.load(
            w_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K)
        )
        acc += tl.dot(a, b)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def splitk_linear(x, w, bm, bn, bk, splits, warps, stages, scratch=None):
    M, K = x.shape
    N = w.shape[0]
    k_per = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), triton.cdiv(K, k_per))
    if grid[1] == 1:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
        _splitk_kernel[grid](
            x, w, out, M, N, K, k_per, BM=bm, BN=bn, BK=bk, ATOMIC=False,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out
    acc = (
        scratch if scratch is not None else torch.empty(M, N, device=x.device, dtype=torch.float32)
    )
    acc.zero_()
    _splitk_kernel[grid](
        x, w, acc, M, N, K, k_per, BM=bm, BN=bn, BK=bk, ATOMIC=True,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return acc.to(x.dtype)


CONFIGS = [  # (BM, BN, BK, warps, stages)
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (64, 64, 128, 4, 3),
]
SPLITS = (1, 2, 4, 8)


def other_libraries(x, w, ref) -> tuple[float, float]:
    """(cuBLASLt us, Inductor's autotuned product us) for `x @ w.T`; NaN where one fails or
    differs from `ref` by more than bf16 rounding."""
    out = []
    lib = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
        ok = (fn().float() - ref.float()).abs().max().item() < 0.1
        out.append(graph_ms(fn) * 1e3 if ok else float("nan"))
    except Exception as error:
        print(f"  cuBLASLt: {error!r:.100}")
        out.append(float("nan"))
    finally:
        torch.backends.cuda.preferred_blas_library(lib)
    try:
        compiled = torch.compile(
            torch.nn.functional.linear, mode="max-autotune-no-cudagraphs", dynamic=False
        )
        fn = lambda: compiled(x, w)  # noqa: E731
        ok = (fn().float() - ref.float()).abs().max().item() < 0.1
        out.append(graph_ms(fn) * 1e3 if ok else float("nan"))
    except Exception as error:
        print(f"  Inductor: {error!r:.100}")
        out.append(float("nan"))
    return out[0], out[1]


def decode_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    return {  # name: (N, K)
        "qkv": (heads * d + 2 * kv * d, h),
        "o": (h, heads * d),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (cfg["vocab_size"], h),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, action="append")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()
    cfg = json.loads((Path(__file__).parent / "shapes" / f"{args.shape}.json").read_text())
    bw = measure_bandwidth()
    peak = measure_matmul_flops()
    print(f"bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    layers = cfg["num_hidden_layers"]
    for M in args.rows or [256]:
        total = {"cublas": 0.0, "best": 0.0, "floor": 0.0}
        for name, (N, K) in decode_shapes(cfg).items():
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
            ref = torch.nn.functional.linear(x, w)
            floor_us = max((N * K + M * K + M * N) * 2 / bw, 2 * M * N * K / peak) * 1e6
            cublas_us = graph_ms(lambda: torch.nn.functional.linear(x, w)) * 1e3  # noqa: B023
            lt_us, inductor_us = other_libraries(x, w, ref)
            scratch = torch.empty(M, N, device="cuda", dtype=torch.float32)
            rows = []
            for bm, bn, bk, warps, stages in CONFIGS:
                for splits in SPLITS:
                    if splits > 1 and K // splits < bk:
                        continue
                    fn = lambda: splitk_linear(x, w, bm, bn, bk, splits, warps, stages, scratch)  # noqa: B023,E731
                    try:
                        err = (fn().float() - ref.float()).abs().max().item()
                        us = graph_ms(fn) * 1e3
                    except Exception as error:  # a configuration that does not compile or fit
                        print(f"  {name} {bm}/{bn}/{bk}/{warps}/{stages} x{splits}: {error!r:.100}")
                        continue
                    rows.append((us, bm, bn, bk, warps, stages, splits, err))
            rows.sort()
            best = rows[0]
            n = 1 if name == "lm_head" else layers
            total["cublas"] += n * cublas_us
            total["best"] += n * min(best[0], cublas_us)
            total["floor"] += n * floor_us
            print(
                f"M={M} {name:8s} N={N:6d} K={K:5d}: floor {floor_us:6.1f} us, cuBLAS "
                f"{cublas_us:6.1f} us ({floor_us / cublas_us:4.0%} of floor), cuBLASLt "
                f"{lt_us:6.1f} us, Inductor {inductor_us:6.1f} us, split-K best "
                f"{best[0]:6.1f} us {best[1:7]} max err {best[7]:.3g}; top 4: "
                + ", ".join(f"{r[0]:.1f}{r[1:7]}" for r in rows[:4]),
                flush=True,
            )
            results.append(
                dict(
                    rows=M, name=name, N=N, K=K, floor_us=floor_us, cublas_us=cublas_us,
                    cublaslt_us=lt_us, inductor_us=inductor_us,
                    best_us=best[0], best=best[1:7], best_err=best[7],
                )
            )  # fmt: skip
        print(
            f"M={M} a decode step's products ({layers} layers + head): cuBLAS "
            f"{total['cublas'] / 1e3:.3f} ms, with the best of each {total['best'] / 1e3:.3f} ms, "
            f"floor {total['floor'] / 1e3:.3f} ms",
            flush=True,
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
