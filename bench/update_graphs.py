"""How much of a micro-batch's update is the host's? (issue 26, item 1: a device-bound update)

One packed micro-batch of G1's sequences (groups of 8 x 512 completion tokens sharing a 128-token
prompt, cut by the trainer's own `micro_batches` at `--tokens`), forward and backward through the
trainer's path (`packed_logprobs`: varlen attention, the chunked LM head, gradient checkpointing,
compiled layers), timed two ways on the same model and batch:

- as the trainer runs it (kernels launched by Python each time), and
- replayed from one CUDA graph captured over the same forward and backward (gradients
  accumulating into the same `.grad` tensors): the device's time alone, what a device-bound
  update would take.

The gap is the host's per-layer work that item 1 removes; the captured time over the model's
FLOPs is the MFU a device-bound update reaches. A bench, not a test; prints one line per size:

    python bench/update_graphs.py [--shape bench/shapes/qwen2.5-0.5b.json] [--tokens 16384,8192]
        [--compile dynamic|static|autotune] [--no-checkpointing]

`--compile` (session 24) weighs Inductor's choices for the layers: `dynamic` (the trainer's:
one compile for every micro-batch length), `static` (one shape, which a kept update graph has),
`autotune` (static with `max-autotune-no-cudagraphs`: Triton products, with the norms, SiLU and
residual adds fused into their epilogues where that measures faster). `--no-checkpointing`
shows what the recomputation costs (and how much memory it saves).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from reinforge.models.shapes import build_shape_model, shape_source  # noqa: E402
from reinforge.train.packing import PackSequence, pack_one  # noqa: E402
from reinforge.train.packing.attention import select_packed_attention  # noqa: E402
from reinforge.train.packing.forward import micro_batches, packed_logprobs  # noqa: E402
from reinforge.train.policy.model import compile_layers  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s (SXM)


def g1_batch(tokens: int, vocab: int, device, prompt_len=128, new_tokens=512, group=8, prompts=32):
    """The largest of G1's micro-batches at `tokens` per micro-batch, packed."""
    rng = random.Random(0)
    seqs = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab - 2) for _ in range(prompt_len)]
        for _ in range(group):
            seqs.append(PackSequence(prompt, [rng.randrange(vocab - 2) for _ in range(new_tokens)]))
    plan = micro_batches(
        [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs], tokens, lockstep=False
    )
    largest = max(plan, key=lambda b: sum(seqs[i].num_tokens for i in b))
    return pack_one(seqs, largest).to(device)


def forward_backward(model, batch) -> None:
    _, logprobs_K, _ = packed_logprobs(model, batch, 1.0)
    (logprobs_K.float().sum() * 1e-4).backward()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def flops(model, batch, passes: int = 4) -> float:
    """Forward + backward + the checkpointed recomputation: 4 x 2 x params x tokens, plus
    attention's 4 x 2 x 2 x (keys per query) x head_dim x heads per layer (causal, per segment);
    `passes` 3 without the recomputation."""
    c = model.config
    params = sum(p.numel() for p in model.parameters()) - c.vocab_size * c.hidden_size
    tokens = batch.num_tokens
    head = 3 * 2 * c.vocab_size * c.hidden_size * len(batch.targets_K)  # fwd + bwd, no recompute
    attn_pairs = float(tokens) * 640 / 2  # keys per query ~ half of a 640-token sequence
    attn = 4 * 2 * 2 * attn_pairs * c.hidden_size * c.num_hidden_layers
    return passes * 2 * params * tokens + attn * passes / 4 + head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="bench/shapes/qwen2.5-0.5b.json")
    p.add_argument("--tokens", default="16384,8192")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="eager layers (no torch.compile)")
    p.add_argument("--compile", choices=("dynamic", "static", "autotune"), default="dynamic")
    p.add_argument("--no-checkpointing", action="store_true")
    a = p.parse_args()
    # without CUDA: a smoke run of the trainer's path only (no graph, no memory figures)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_shape_model(shape_source(f"shape:{a.shape}", 0), device, torch.bfloat16)
    model.config.use_cache = False
    if not a.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    print("attention:", select_packed_attention(model, "auto"), flush=True)
    if a.no_compile:
        pass
    elif a.compile == "dynamic":
        compile_layers(model)
    else:
        mode = "max-autotune-no-cudagraphs" if a.compile == "autotune" else None
        for layer in model.get_decoder().layers:
            layer.compile(dynamic=False, mode=mode)
    print(f"compile: {'none' if a.no_compile else a.compile}", flush=True)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), 989e12)
    for tokens in [int(t) for t in a.tokens.split(",")]:
        batch = g1_batch(tokens, model.config.vocab_size, device)
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        start = time.perf_counter()
        for _ in range(3):  # compile, autotune, allocator warm
            forward_backward(model, batch)
        sync()
        print(f"first three (compile, autotune): {time.perf_counter() - start:.1f} s", flush=True)
        eager = timed(functools.partial(forward_backward, model, batch), a.iters)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            forward_backward(model, batch)
        eager_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        work = flops(model, batch, 3 if a.no_checkpointing else 4)
        line = (
            f"tokens {batch.num_tokens:6d} | as the trainer runs it {eager * 1e3:7.1f} ms "
            f"(MFU {work / eager / peak:5.1%}, peak {eager_peak:.2f} GiB)"
        )
        if not cuda:
            print(line, flush=True)
            continue
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    forward_backward(model, batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward_backward(model, batch)
            captured = timed(graph.replay, a.iters)
            line += (
                f" | one CUDA graph {captured * 1e3:7.1f} ms (MFU {work / captured / peak:5.1%}) "
                f"| host share {1 - captured / eager:5.1%}"
            )
            del graph
        except Exception as e:  # the capture's limits are part of what this measures
            line += f" | capture failed: {type(e).__name__}: {str(e)[:300]}"
        print(line, flush=True)
        del batch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
