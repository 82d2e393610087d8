"""The chunked logprob's two reductions alone (issue 26): `chunk_stats` (forward: logprob of the
target and entropy per row) and `chunk_grad_logits` (backward: dL/dlogits) over one chunk's
logits [C, V] in bf16, timed eager, compiled as the trainer compiled them until session 15
(dynamic shapes), compiled for one static shape, with and without coordinate-descent tuning,
and the hand-written Triton kernels the trainer runs now (`logprob_kernels`: one pass forward,
one read and one write backward); values compared with eager. A bench, not a timed test.

    python bench/logprob_kernels.py                  # C = 512, V = 151,936 (Qwen), H100/H200

The floor: each call reads the [C, V] bf16 logits a few times (and the backward writes a [C, V]
bf16 gradient): at C = 512, 156 MB a pass, about 0.05 ms per pass at 3.35 TB/s (H100). The G1
profile of session 14 measured 2.6 ms (forward) and 2.1 ms (backward) per call, compiled with
dynamic shapes: 1.32 s of a 2.59 s update's device time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from reinforge.train.packing import logprob_kernels
from reinforge.train.packing.logprob_math import chunk_grad_logits, chunk_stats


def timed(fn, *args, repeats: int = 20) -> float:
    """Median seconds of one call (after two warm-up calls, which also compile)."""
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def variants():
    import torch._inductor.config as inductor

    def compiled(fn, dynamic, tune=False):
        if not tune:
            return torch.compile(fn, dynamic=dynamic)
        inner = torch.compile(fn, dynamic=dynamic, mode="max-autotune-no-cudagraphs")

        def tuned(*args):  # compiling happens at the first call: the setting must hold then
            with inductor.patch(coordinate_descent_tuning=True):
                return inner(*args)

        return tuned

    def triton_stats(logits, targets, temperature):
        return logprob_kernels.row_stats(logits, targets, temperature)[:2]

    def triton_grad(logits, targets, g_logp, g_ent, temperature):
        # the trainer passes the forward's logsumexp and entropy; here they come with the call
        _, entropy, lse = logprob_kernels.row_stats(logits, targets, temperature)
        return logprob_kernels.grad_logits(
            logits, targets, lse, entropy, g_logp, g_ent, temperature
        )

    stats_of: dict = {}  # the forward's stats, computed once per input (the trainer saves them)

    def triton_grad_alone(logits, targets, g_logp, g_ent, temperature):
        key = (logits.data_ptr(), temperature)
        if key not in stats_of:
            stats_of[key] = logprob_kernels.row_stats(logits, targets, temperature)
        _, entropy, lse = stats_of[key]
        return logprob_kernels.grad_logits(
            logits, targets, lse, entropy, g_logp, g_ent, temperature
        )

    return {
        "triton (the trainer's since session 15; backward as it runs: stats from the forward)": (
            triton_stats,
            triton_grad_alone,
        ),
        "triton, backward with its own stats pass": (triton_stats, triton_grad),
        "eager": (chunk_stats, chunk_grad_logits),
        "compiled, dynamic (the trainer's)": (
            compiled(chunk_stats, True),
            compiled(chunk_grad_logits, True),
        ),
        "compiled, static": (compiled(chunk_stats, False), compiled(chunk_grad_logits, False)),
        "compiled, static, tuned": (
            compiled(chunk_stats, False, True),
            compiled(chunk_grad_logits, False, True),
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--out", default=None, help="write the table's rows as JSON here")
    args = p.parse_args()
    assert torch.cuda.is_available(), "a CUDA GPU is needed"
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    g_logp = torch.randn(args.rows, device="cuda")
    g_ent = torch.randn(args.rows, device="cuda") * 0.01
    ref_stats = chunk_stats(logits, targets, 1.0)
    ref_grad = chunk_grad_logits(logits, targets, g_logp, g_ent, 1.0)
    pass_bytes = logits.numel() * logits.element_size()
    bandwidth = 3.35e12 if "H100" in torch.cuda.get_device_name() else 4.8e12
    rows = []
    for name, (stats, grad) in variants().items():
        try:
            fwd = timed(stats, logits, targets, 1.0)
            bwd = timed(grad, logits, targets, g_logp, g_ent, 1.0)
            logp, ent = stats(logits, targets, 1.0)
            err = max(
                (logp - ref_stats[0]).abs().max().item(),
                (ent - ref_stats[1]).abs().max().item(),
                (grad(logits, targets, g_logp, g_ent, 1.0).float() - ref_grad.float())
                .abs()
                .max()
                .item(),
            )
        except Exception as e:  # a variant that does not compile here is a row, not a crash
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        rows.append(
            {
                "variant": name,
                "forward_ms": 1e3 * fwd,
                "backward_ms": 1e3 * bwd,
                "forward_passes_at_bandwidth": fwd * bandwidth / pass_bytes,
                "backward_passes_at_bandwidth": bwd * bandwidth / pass_bytes,
                "max_abs_diff_vs_eager": err,
            }
        )
    print(f"{torch.cuda.get_device_name()}, logits [{args.rows}, {args.vocab}] bf16")
    print(
        "| variant | forward ms | backward ms | fwd / bwd in bf16 passes at bandwidth | max diff |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | - | - | - | {r['error']} |")
            continue
        print(
            f"| {r['variant']} | {r['forward_ms']:.3f} | {r['backward_ms']:.3f} "
            f"| {r['forward_passes_at_bandwidth']:.1f} / {r['backward_passes_at_bandwidth']:.1f} "
            f"| {r['max_abs_diff_vs_eager']:.1e} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
