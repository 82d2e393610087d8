"""The update's attention alone at G1's shape, one kernel against another (a bench tool).

    python bench/train_attention.py [--segments 19] [--length 640] [--out DIR]

A G1 micro-batch of ~12k tokens as `segments` causal sequences of `length` tokens, 14 query heads
over 2 K/V heads of 64, bf16: forward and backward of torch's packed flash kernel
(`varlen_attn`, what the trainer runs: `train.packing.attention`) and of SDPA on the same rows
laid out as [segments, heads, length, 64] with each backend torch has (flash, cuDNN, memory
efficient), K/V heads shared (enable_gqa) or repeated. Each timed as the median of CUDA-event
replays of one CUDA graph, with the FLOP rate of causal attention (forward 2 products, backward 5).
Then (alone with --ragged-only) cuDNN's packed form against the packed flash kernel: values and
gradients on the same rows, and times. Session 23 (H200): dense cuDNN with shared K/V heads 1.71x
the packed flash kernel; the packed cuDNN form's gradients were wrong (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import graph_ms

from reinforge.engine.varlen import torch_varlen_attn, varlen_options

HQ, HKV, D = 14, 2, 64


def fwd_bwd(fn, *inputs):
    """A closure running fn(*inputs) forward and backward into the inputs' .grad."""
    grad_out = None

    def run():
        nonlocal grad_out
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        if grad_out is None:
            grad_out = torch.randn_like(out)
        out.backward(grad_out)

    return run


def ragged(S: int, T: int, results: dict, report) -> None:
    """cuDNN's packed (ragged) attention, `aten._cudnn_attention_forward` with cumulative
    lengths, against torch's packed flash on the same rows: whether it runs (GQA, autograd),
    agrees, and where its causal diagonal sits when a segment has more keys than queries."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    varlen = torch_varlen_attn()
    causal = {"window_size": (-1, 0)} if "window_size" in varlen_options() else {"is_causal": True}

    def cudnn(q, k, v, cu_q, cu_k, max_q, max_k):
        return torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True, False, scale=D**-0.5
        )[0]

    def flash(q, k, v, cu_q, cu_k, max_q, max_k):
        k, v = k.repeat_interleave(HQ // k.shape[1], 1), v.repeat_interleave(HQ // v.shape[1], 1)
        return varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=D**-0.5, **causal)

    for kv_heads in (HKV, HQ):
        for keys_extra in (0, 128):  # 128: a shared prompt's keys before each segment's queries
            tq, tk = T - keys_extra, T
            q = torch.randn(S * tq, HQ, D, device=dev, dtype=dt, requires_grad=True)
            k = torch.randn(S * tk, kv_heads, D, device=dev, dtype=dt, requires_grad=True)
            v = torch.randn(S * tk, kv_heads, D, device=dev, dtype=dt, requires_grad=True)
            cu_q = torch.arange(0, (S + 1) * tq, tq, device=dev, dtype=torch.int32)
            cu_k = torch.arange(0, (S + 1) * tk, tk, device=dev, dtype=torch.int32)
            name = f"cudnn ragged, {kv_heads} K/V heads, {tq} queries / {tk} keys"
            try:
                ref = flash(q, k, v, cu_q, cu_k, tq, tk)
                grad = torch.randn_like(ref)
                ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
                out = cudnn(q, k, v, cu_q, cu_k, tq, tk)
                grads = torch.autograd.grad(out, (q, k, v), grad)
            except Exception as error:
                print(f"  {name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
                continue
            diffs = [(out - ref).abs().max().item()] + [
                (a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True)
            ]
            print(f"  {name}: max |diff| vs flash (out, dq, dk, dv) {diffs}", flush=True)
            results[name + " diffs"] = diffs
            report(
                name,
                fwd_bwd(lambda a, b, c: cudnn(a, b, c, cu_q, cu_k, tq, tk), q, k, v),  # noqa: B023
            )
            report(
                "flash varlen, " + name[len("cudnn ragged, ") :],
                fwd_bwd(lambda a, b, c: flash(a, b, c, cu_q, cu_k, tq, tk), q, k, v),  # noqa: B023
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=19)
    parser.add_argument("--length", type=int, default=640)
    parser.add_argument("--ragged-only", action="store_true", help="only the cuDNN packed part")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()
    S, T = args.segments, args.length
    dev, dt = torch.device("cuda"), torch.bfloat16
    flops_fwd = 2 * 2 * S * HQ * (T * (T + 1) / 2) * D  # QK^T and PV over the causal half
    results = {}

    def report(name, run):
        try:
            run()  # warm-up outside the graph (compiles, allocates .grad)
            ms = graph_ms(run)
        except Exception as error:  # a backend that does not take this shape
            print(f"  {name:40s} not run: {type(error).__name__}: {str(error)[:120]}", flush=True)
            return
        tflops = flops_fwd * 3.5 / (ms / 1e3) / 1e12
        results[name] = {"ms": ms, "tflops": tflops}
        print(f"  {name:40s} {ms * 1e3:8.1f} us fwd+bwd  {tflops:6.1f} TFLOP/s", flush=True)

    if args.ragged_only:
        ragged(S, T, results, report)
        return
    q = torch.randn(S * T, HQ, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(S * T, HKV, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(S * T, HKV, D, device=dev, dtype=dt, requires_grad=True)
    cu = torch.arange(0, (S + 1) * T, T, device=dev, dtype=torch.int32)
    print(
        f"{S} x {T} tokens, {HQ}/{HKV} heads of {D}, bf16; varlen options: {sorted(varlen_options())}"
    )
    varlen = torch_varlen_attn()
    causal = {"window_size": (-1, 0)} if "window_size" in varlen_options() else {"is_causal": True}
    if "enable_gqa" in varlen_options():
        report(
            "varlen_attn (flash), shared K/V heads",
            fwd_bwd(
                lambda a, b, c: varlen(a, b, c, cu, cu, T, T, enable_gqa=True, **causal), q, k, v
            ),
        )
    rep = HQ // HKV
    report(
        "varlen_attn (flash), repeated K/V heads",
        fwd_bwd(
            lambda a, b, c: varlen(
                a, b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1), cu, cu, T, T, **causal
            ),
            q,
            k,
            v,
        ),
    )
    qb = torch.randn(S, HQ, T, D, device=dev, dtype=dt, requires_grad=True)
    kb = torch.randn(S, HKV, T, D, device=dev, dtype=dt, requires_grad=True)
    vb = torch.randn(S, HKV, T, D, device=dev, dtype=dt, requires_grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ):

        def shared(a, b, c, backend=backend):
            with sdpa_kernel(backend):
                return sdpa(a, b, c, is_causal=True, enable_gqa=True)

        def repeated(a, b, c, backend=backend):
            with sdpa_kernel(backend):
                b, c = b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1)
                return sdpa(a, b, c, is_causal=True)

        report(f"sdpa {backend.name}, shared K/V heads", fwd_bwd(shared, qb, kb, vb))
        report(f"sdpa {backend.name}, repeated K/V heads", fwd_bwd(repeated, qb, kb, vb))
    ragged(S, T, results, report)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "train_attention.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
