"""Generation benchmarks E1 / E2 (shared/BENCHMARKS.md): reinforge's PagedEngine and HF
`model.generate` on the same randomly initialised model, in the same process, on one GPU.

    python bench/engine_bench.py --workload E1 [--workload E2] [--kernels] [--profile]
    python bench/engine_bench.py --workload E2 --lora 32 --skip-hf   # plain, adapters, merged
    python bench/engine_bench.py --workload E4 --skip-hf --record-routes  # routing replay's cost

Prints tokens/s of both, their ratio, peak memory, and each as a fraction of the memory-bandwidth
floor (weight bytes + KV bytes read per decode step, over a device copy bandwidth measured in the
same job); writes the full numbers as JSON to $OUT (or --out) and prints a short table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from reinforge.engine.base import SamplingParams  # noqa: E402
from reinforge.engine.layout import fuse_projections  # noqa: E402
from reinforge.engine.paged import PagedEngine  # noqa: E402
from reinforge.engine.pool_size import kv_bytes_per_block  # noqa: E402
from reinforge.engine.qwen_forward import ModelShape  # noqa: E402


@dataclass(frozen=True)
class Workload:
    shape: str
    num_prompts: int
    n: int
    prompt_len: int
    new_tokens: int
    hf_batch: int = 256
    hf_new_tokens: int | None = None  # None: the full length
    hf_batches: int | None = None  # None: all sequences


WORKLOADS = {
    "E1": Workload("qwen2.5-0.5b", 32, 8, 128, 512),
    # HF generate at 7B takes minutes for the whole workload: by default it is timed on one batch
    # of 256 and 256 new tokens (shorter contexts than the workload: flatters HF)
    "E2": Workload("qwen2.5-7b", 64, 8, 256, 1024, hf_new_tokens=256, hf_batches=1),
    # issue 27: Qwen3-30B-A3B (128 experts, 8 per token); HF timed as for E2
    "E4": Workload("qwen3-30b-a3b", 64, 8, 256, 1024, hf_new_tokens=256, hf_batches=1),
}


class NullTokenizer:
    """What the engine asks of a tokenizer, for random token ids."""

    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def log(*args) -> None:
    print(*args, flush=True)


def measure_bandwidth(num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * num_bytes / statistics.median(times)


def measure_matmul_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 10 * 2 * n**3 / (start.elapsed_time(end) / 1e3)


def build_model(shape_name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = json.loads((HERE / "shapes" / f"{shape_name}.json").read_text())
    config = AutoConfig.for_model(**shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval(), config


def floor_seconds(model, config, w: Workload, new_tokens: int, num_seqs: int, bw, flops):
    """(bandwidth floor, roofline floor, weight bytes, KV bytes per token) of the workload.

    Bandwidth floor (BENCHMARKS.md): every decode step reads all weights once and each sequence's
    whole context of K/V, at the measured copy bandwidth. Roofline floor: each decode step's
    matrix products take max(FLOPs / matmul rate, weight bytes / bandwidth) and its attention
    max(FLOPs / matmul rate, K/V bytes / bandwidth): at 512 sequences a 7B step is bound by
    FLOPs, not bytes. The prefill counts its matrix FLOPs in both."""
    import torch.nn as nn

    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = kv_bytes_per_block(model, 1)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    linear_bytes = 2 * linear_params
    if getattr(config, "num_experts", 0):  # MoE: experts are read only where a token went
        stacked = [p for n, p in model.named_parameters() if ".experts." in n]
        expert_bytes = sum(p.numel() * p.element_size() for p in stacked)
        active = config.num_experts_per_tok / config.num_experts
        linear_params += sum(p.numel() for p in stacked) * active  # each token: k experts
        # a step of B tokens reads each expert with probability 1 - (1 - k/E)^B
        touched = 1 - (1 - active) ** num_seqs
        param_bytes = param_bytes - expert_bytes + expert_bytes * touched
        linear_bytes += expert_bytes * touched
    shape = ModelShape.from_config(config)
    attn_flops_per_key = 4 * shape.num_heads * shape.head_dim * shape.num_layers
    prefill_tokens = w.prompt_len * num_seqs // w.n
    prefill = max(2 * linear_params * prefill_tokens / flops, param_bytes / bw)
    bandwidth = roofline = prefill
    for j in range(1, new_tokens):  # decode step j attends to prompt + j tokens
        keys = num_seqs * (w.prompt_len + j)
        bandwidth += (param_bytes + keys * kv_per_token) / bw
        roofline += max(2 * linear_params * num_seqs / flops, linear_bytes / bw)
        roofline += max(attn_flops_per_key * keys / flops, keys * kv_per_token / bw)
    return bandwidth, roofline, param_bytes, kv_per_token


def random_prompts(config, w: Workload) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, config.vocab_size, (w.num_prompts, w.prompt_len), generator=generator)
    return ids.tolist()


def run_reinforge(
    model,
    config,
    w: Workload,
    prompts,
    profile: bool,
    lora_generation: str = "auto",
    record_routes: bool = False,
    profile_tokens: int = 33,
) -> dict:
    tokenizer = NullTokenizer(config.eos_token_id)
    num_seqs = w.num_prompts * w.n
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    engine = PagedEngine(
        model,
        tokenizer,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=8192,
        lora_generation=lora_generation,
        record_routes=record_routes,
    )
    init_seconds = time.perf_counter() - t
    params = SamplingParams(
        max_new_tokens=w.new_tokens, temperature=1.0, n=w.n, seed=0, ignore_eos=True
    )
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(**{**params.__dict__, "max_new_tokens": 8}))
    torch.cuda.synchronize()
    warmup_seconds = time.perf_counter() - t
    log(
        f"  reinforge: pool {engine.num_blocks} pages, warm-up (graph capture) {warmup_seconds:.1f}s"
    )

    torch.cuda.synchronize()
    t = time.perf_counter()
    outputs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    num_tokens = sum(len(c.token_ids) for g in outputs for c in g)
    assert num_tokens == num_seqs * w.new_tokens, num_tokens
    stats = dict(engine.stats.extra)
    result = {
        "tokens": num_tokens,
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kv_pool_gib": engine.runner.kv_cache.numel() * 2 / 2**30,
        "kv_peak_used_gib": stats["kv_blocks_peak"] * kv_bytes_per_block(model, 16) / 2**30,
        "init_seconds": init_seconds,
        "warmup_seconds": warmup_seconds,
        "lora_generation": engine.lora_generation,
        "stats": stats,
    }
    if record_routes:  # routing replay: the experts of every position, on the host
        result["routes_gib"] = sum(c.routes.nbytes for g in outputs for c in g) / 2**30
        log(f"  recorded routes: {result['routes_gib']:.3f} GiB on the host")
    steps = max(1.0, stats["num_decode_steps"])
    result["decode_step_ms"] = {
        phase: 1e3 * stats.get(f"seconds_decode_{phase}", 0.0) / steps
        for phase in ("launch", "wait", "commit")
    }
    log(f"  reinforge: {num_tokens} tokens in {seconds:.2f}s = {num_tokens / seconds:,.0f} tok/s")
    log(f"  decode step host phases (ms): {result['decode_step_ms']}")
    if profile:
        result["profile"] = profile_decode(engine, prompts, params, profile_tokens)
    del engine, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return result


KERNEL_CLASSES = (
    ("attention", ("paged_decode", "combine_splits", "flash", "fmha", "attention")),
    ("rope+kv write", ("rope_write",)),
    ("norm+silu", ("rms_norm", "silu")),
    ("sampler", ("gumbel", "icdf")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "cublas", "matmul", "splitk")),
)


def classify(name: str) -> str:
    lower = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(k in lower for k in keys):
            return label
    return "other"


def kernel_times(engine, prompts, params) -> tuple[dict[str, float], dict[str, tuple], float]:
    """Device ms by kernel class, (ms, calls) by kernel name, and the decode steps run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    kernels: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0.0) or getattr(
            event, "self_cuda_time_total", 0.0
        )
        if us > 0:
            label = classify(event.key)
            totals[label] = totals.get(label, 0.0) + us / 1e3
            ms, calls = kernels.get(event.key, (0.0, 0))
            kernels[event.key] = (ms + us / 1e3, calls + event.count)
    return totals, kernels, engine.stats.extra["num_decode_steps"]


def profile_decode(engine, prompts, params, tokens: int = 33) -> dict:
    """Device time per decode step by kernel class and by kernel (the top ones, with their calls
    per step and time per call): the decode is run eagerly (no graph) under torch.profiler twice,
    with 1 and with `tokens` new tokens, and the difference taken (it removes the prefill). With
    33 the steps attend to ~150 keys (E1); with the workload's own length + 1, the mean over
    the whole generation, where attention's share is larger."""
    graphs = engine.runner.graphs
    engine.runner.graphs = None
    try:
        short, short_k, _ = kernel_times(
            engine, prompts, SamplingParams(**{**params.__dict__, "max_new_tokens": 1})
        )
        long, long_k, steps = kernel_times(
            engine, prompts, SamplingParams(**{**params.__dict__, "max_new_tokens": tokens})
        )
    finally:
        engine.runner.graphs = graphs
    per_step = {k: (long.get(k, 0.0) - short.get(k, 0.0)) / steps for k in long}
    total = sum(per_step.values())
    log("  eager decode step, device ms by kernel class:")
    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1]):
        log(f"    {k:14s} {v:7.3f} ms  {100 * v / total:5.1f}%")
    by_kernel = {}
    for name, (ms, calls) in long_k.items():
        short_ms, short_calls = short_k.get(name, (0.0, 0))
        if calls > short_calls:
            step_ms, step_calls = (ms - short_ms) / steps, (calls - short_calls) / steps
            by_kernel[name] = {
                "ms": step_ms,
                "calls": step_calls,
                "us_each": 1e3 * step_ms / step_calls,
            }
    log("  eager decode step, top kernels (ms a step, calls a step, us a call):")
    for name, k in sorted(by_kernel.items(), key=lambda kv: -kv[1]["ms"])[:14]:
        log(f"    {k['ms']:6.3f} ms {k['calls']:6.1f} x {k['us_each']:6.1f} us  {name[:70]}")
    return {
        "eager_decode_step_device_ms": per_step,
        "eager_decode_step_device_ms_total": total,
        "eager_decode_step_kernels": by_kernel,
    }


def run_hf(model, config, w: Workload, prompts) -> dict:
    new_tokens = w.hf_new_tokens or w.new_tokens
    seqs = [p for p in prompts for _ in range(w.n)]
    batches = [seqs[i : i + w.hf_batch] for i in range(0, len(seqs), w.hf_batch)]
    if w.hf_batches is not None:
        batches = batches[: w.hf_batches]
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=config.eos_token_id,
        eos_token_id=config.eos_token_id,
    )
    warm = torch.tensor(batches[0][:4], device="cuda")
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    num_tokens = 0
    t = time.perf_counter()
    for batch in batches:
        ids = torch.tensor(batch, device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            **kwargs,
        )
        num_tokens += out[:, ids.shape[1] :].numel()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    log(f"  HF generate: {num_tokens} tokens in {seconds:.2f}s = {num_tokens / seconds:,.0f} tok/s")
    return {
        "tokens": num_tokens,
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "new_tokens": new_tokens,
        "num_sequences": sum(map(len, batches)),
        "batch": w.hf_batch,
    }


def median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


# (tile, warps, stages) x splits tried by --kernels
DECODE_CONFIGS = [(32, 2, 3), (32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2)]
DECODE_SPLITS = (1, 2, 4)


def graph_ms(fn) -> float:
    """Median device time of `fn` replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def decode_inputs(B: int, H: int, K: int, D: int, ctx: int, bs: int) -> tuple:
    """(k_cache, v_cache, tables, lens, q) for B sequences of `ctx` keys on `bs`-token pages
    scattered at random, bf16."""
    pages = B * (ctx // bs)
    k_cache = torch.randn(pages, bs, K, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(B, ctx // bs)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.long)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    return k_cache, v_cache, tables, lens, q


def bench_decode_kernel(name: str, B: int, H: int, K: int, D: int, ctx: int) -> dict:
    """The decode attention kernel alone at one shape over configurations and split counts;
    bandwidth is K/V bytes read over time."""
    import functools

    from reinforge.engine import triton_attention as ta

    bs = 16
    k_cache, v_cache, tables, lens, q = decode_inputs(B, H, K, D, ctx, bs)
    kv_bytes = 2 * B * ctx * K * D * 2
    default = dict(ta.DECODE_CONFIG)
    default_splits = ta.num_decode_splits(B, K, q.device)
    rows = []
    for tile, warps, stages in DECODE_CONFIGS:
        ta.DECODE_CONFIG.update(tile=tile, num_warps=warps, num_stages=stages)
        for splits in DECODE_SPLITS:
            run = functools.partial(
                ta.paged_decode, q, k_cache, v_cache, tables, lens, D**-0.5, splits
            )
            try:
                rows.append((graph_ms(run), tile, warps, stages, splits))
            except Exception as error:  # a configuration that does not compile
                log(f"    {name} {tile}/{warps}/{stages}/{splits}: {error!r:.80}")
    ta.DECODE_CONFIG.update(default)
    ms_default = graph_ms(
        functools.partial(ta.paged_decode, q, k_cache, v_cache, tables, lens, D**-0.5)
    )
    rows.sort()
    best = rows[0]
    tb_s = lambda ms: kv_bytes / (ms / 1e3) / 1e12  # noqa: E731
    log(
        f"  decode kernel {name} {dict(B=B, H=H, K=K, D=D, ctx=ctx)}: default "
        f"({default_splits} splits) {ms_default * 1e3:.1f} us ({tb_s(ms_default):.2f} TB/s); best "
        f"{best[0] * 1e3:.1f} us tile={best[1]} warps={best[2]} stages={best[3]} "
        f"splits={best[4]} ({tb_s(best[0]):.2f} TB/s)"
    )
    log("    " + ", ".join(f"{r[1]}/{r[2]}/{r[3]}/{r[4]}: {r[0] * 1e3:.0f}" for r in rows))
    return {
        "shape": dict(B=B, H=H, K=K, D=D, ctx=ctx),
        "default_us": ms_default * 1e3,
        "default_splits": default_splits,
        "default_tb_s": tb_s(ms_default),
        "best": dict(us=best[0] * 1e3, tile=best[1], warps=best[2], stages=best[3], splits=best[4]),
        "best_tb_s": tb_s(best[0]),
        "all": [dict(us=r[0] * 1e3, tile=r[1], warps=r[2], stages=r[3], splits=r[4]) for r in rows],
    }


def bench_rope_kernel(name: str, B: int, H: int, K: int, D: int, ctx: int) -> dict:
    """The decode step's RoPE + K/V write then attention (two kernels) against
    `paged_decode_rope` (one), at the default configuration, graph replay."""
    import functools

    from reinforge.engine import triton_attention as ta

    bs = 16
    k_cache, v_cache, tables, lens, q = decode_inputs(B, H, K, D, ctx, bs)
    k_new = torch.randn(B, K, D, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    angles = torch.rand(B, D // 2, device="cuda") * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16()
    sin = torch.cat([angles.sin(), angles.sin()], -1).bfloat16()
    slots = (tables[:, -1].long() * bs + bs - 1).contiguous()

    def two_kernels():
        ta.rope_write_kv(q, k_new, v_new, cos, sin, k_cache, v_cache, slots)
        return ta.paged_decode(q, k_cache, v_cache, tables, lens, D**-0.5)

    ms_two = graph_ms(two_kernels)
    ms_one = graph_ms(
        functools.partial(
            ta.paged_decode_rope, q, k_new, v_new, cos, sin, k_cache, v_cache, tables, lens,
            slots, D**-0.5,
        )
    )  # fmt: skip
    log(
        f"  decode kernel {name}: RoPE + K/V write + attention as two kernels {ms_two * 1e3:.1f} "
        f"us, as one (paged_decode_rope) {ms_one * 1e3:.1f} us"
    )
    return {"two_kernels_us": ms_two * 1e3, "one_kernel_us": ms_one * 1e3}


def bench_sampler(B: int, V: int) -> dict:
    import functools

    from reinforge.engine import triton_sampling

    logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16)
    seeds = torch.arange(B, device="cuda")
    out = {}
    for name, fn in (
        ("gumbel", triton_sampling.sample_gumbel),
        ("inverse_cdf", triton_sampling.sample_inverse_cdf),
    ):
        ms = graph_ms(functools.partial(fn, logits, 1.0, seeds, seeds))
        tb_s = logits.numel() * 2 / (ms / 1e3) / 1e12
        log(f"  sampler {name} {B}x{V}: {ms * 1e3:.1f} us ({tb_s:.2f} TB/s of logits)")
        out[name] = {"us": ms * 1e3, "tb_s": tb_s}
    return out


def rope_kernels() -> dict:
    return {
        "rope_E1": bench_rope_kernel("E1", 256, 14, 2, 64, 384),
        "rope_E2": bench_rope_kernel("E2", 512, 28, 4, 128, 768),
    }


def kernel_bench() -> dict:
    results = {
        "decode_E1": bench_decode_kernel("E1", 256, 14, 2, 64, 384),
        "decode_E2": bench_decode_kernel("E2", 512, 28, 4, 128, 768),
    }
    results.update(rope_kernels())
    for B, V in ((256, 151936), (512, 152064)):
        results[f"sampler_{B}x{V}"] = bench_sampler(B, V)
    return results


def run_lora(model, config, w: Workload, prompts, rank: int) -> dict:
    """The same workload with a random rank-`rank` LoRA adapter on every linear layer (PEFT,
    float32 A/B as the trainer makes them; B drawn non-zero), decoded both ways: A/B applied at
    every step, and from the merged generation copy (`engine.lora_merge`). The adapter is removed
    afterwards."""
    from reinforge.train.policy.lora import apply_lora

    peft_model, report = apply_lora(model, rank=rank, alpha=2.0 * rank)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 1e-3)
    log(f"  LoRA r={rank}: {report.summary()}")
    runs = {}
    for mode in ("adapters", "merged"):
        log(f"  reinforge, LoRA {mode}:")
        runs[mode] = run_reinforge(peft_model.eval(), config, w, prompts, False, mode)
        assert runs[mode]["lora_generation"] == mode
    peft_model.unload()  # the base model's own linear layers back in place
    return {"rank": rank, **runs}


def run_workload(name: str, args, bw: float, flops: float) -> dict:
    w = WORKLOADS[name]
    if args.hf_new_tokens is not None:
        w = Workload(**{**w.__dict__, "hf_new_tokens": args.hf_new_tokens})
    if args.hf_batches is not None:
        w = Workload(**{**w.__dict__, "hf_batches": args.hf_batches})
    log(f"{name}: {w}")
    t = time.perf_counter()
    model, config = build_model(w.shape)
    log(f"  model built in {time.perf_counter() - t:.1f}s")
    prompts = random_prompts(config, w)
    num_seqs = w.num_prompts * w.n
    unfused = None
    if args.unfused_too:  # the projections one by one first, in the same process
        unfused = run_reinforge(model, config, w, prompts, False)
    # as the trainer loads a model (`load_model`): q/k/v and gate/up back to back
    log(f"  fused projection groups: {fuse_projections(model)}")
    ours = run_reinforge(
        model, config, w, prompts, args.profile, profile_tokens=args.profile_tokens
    )
    if args.rope_ab:  # the decode step's RoPE in the attention kernel, or in its own
        ours["rope_ab"] = rope_ab(model, config, w, prompts, args.rope_ab)
    if args.sampler_ab:  # the sampler inside the decode graph, or launched after it
        ours["sampler_ab"] = sampler_ab(model, config, w, prompts, args.sampler_ab)
    if unfused is not None:
        ours["unfused"] = unfused
        ours["fused_speedup"] = ours["tokens_per_s"] / unfused["tokens_per_s"]
        log(f"  fused / unfused projections: {ours['fused_speedup']:.3f}x tokens/s")
    floor, roofline, param_bytes, kv_per_token = floor_seconds(
        model, config, w, w.new_tokens, num_seqs, bw, flops
    )
    ours["floor_seconds"], ours["roofline_seconds"] = floor, roofline
    ours["fraction_of_floor"] = floor / ours["seconds"]
    ours["fraction_of_roofline"] = roofline / ours["seconds"]
    result = {
        "workload": name,
        "spec": w.__dict__,
        "param_bytes": param_bytes,
        "kv_bytes_per_token": kv_per_token,
        "reinforge": ours,
    }
    if args.record_routes:  # the same workload recording every token's experts
        routes = run_reinforge(model, config, w, prompts, False, record_routes=True)
        result["reinforge_routes"] = routes
        result["routes_slowdown"] = routes["seconds"] / ours["seconds"]
        log(f"  recording routes: {result['routes_slowdown']:.3f}x the time without")
    if args.lora:
        result["lora"] = run_lora(model, config, w, prompts, args.lora)
        for mode in ("adapters", "merged"):
            ratio = result["lora"][mode]["tokens_per_s"] / ours["tokens_per_s"]
            result["lora"][f"{mode}_vs_plain"] = ratio
            log(f"  LoRA {mode} / plain weights: {ratio:.2f}x")
    if not args.skip_hf:
        hf = run_hf(model, config, w, prompts)
        hf_floor, hf_roofline, _, _ = floor_seconds(
            model, config, w, hf["new_tokens"], hf["num_sequences"], bw, flops
        )
        hf["floor_seconds"], hf["roofline_seconds"] = hf_floor, hf_roofline
        hf["fraction_of_floor"] = hf_floor / hf["seconds"]
        hf["fraction_of_roofline"] = hf_roofline / hf["seconds"]
        result["hf"] = hf
        result["ratio"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        log(f"  ratio reinforge / HF: {result['ratio']:.1f}x")
        if hf["num_sequences"] != num_seqs or hf["new_tokens"] != w.new_tokens:
            # HF ran a shorter workload: time reinforge on exactly that one too
            short = Workload(
                w.shape, hf["num_sequences"] // w.n, w.n, w.prompt_len, hf["new_tokens"]
            )
            log(f"  matched to HF: {short}")
            matched = run_reinforge(model, config, short, prompts[: short.num_prompts], False)
            result["reinforge_matched"] = matched
            result["ratio_matched"] = matched["tokens_per_s"] / hf["tokens_per_s"]
            log(f"  ratio reinforge / HF on HF's workload: {result['ratio_matched']:.1f}x")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def alternated(model, config, w: Workload, prompts, rounds: int, variants, what: str) -> dict:
    """tokens/s of each variant `(label, set_up)` (`set_up()` switches to it), alternated
    `rounds` times in one process; the first variant is the new one, the second the old."""
    runs: dict[str, list[float]] = {label: [] for label, _ in variants}
    for _ in range(rounds):
        for label, set_up in reversed(variants):
            set_up()
            runs[label].append(run_reinforge(model, config, w, prompts, False)["tokens_per_s"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    (new, _), (old, _) = variants
    log(
        f"  {what}: {new} {med[new]:,.0f} tokens/s, {old} {med[old]:,.0f} "
        f"({med[new] / med[old]:.3f}x; {rounds} rounds alternated)"
    )
    return {"runs": runs, "median": med, "speedup": med[new] / med[old]}


def rope_ab(model, config, w: Workload, prompts, rounds: int) -> dict:
    """tokens/s with the decode step's RoPE + K/V write inside the attention kernel
    (`paged_decode_rope`, the default) and as a kernel of its own, alternated `rounds` times."""
    import dataclasses

    from reinforge.engine import model_runner, triton_attention

    fused = triton_attention.TRITON_BACKEND
    apart = dataclasses.replace(fused, decode_rope=None)
    select = model_runner.select_attention_backend

    def use(backend):
        model_runner.select_attention_backend = lambda device: backend

    variants = [("one kernel", lambda: use(fused)), ("two kernels", lambda: use(apart))]
    try:
        return alternated(
            model, config, w, prompts, rounds, variants, "RoPE in the attention kernel"
        )
    finally:
        model_runner.select_attention_backend = select


def sampler_ab(model, config, w: Workload, prompts, rounds: int) -> dict:
    """tokens/s with the sampler captured in the decode graphs (the default) and launched after
    each replay (the graphs asked for logits only), alternated `rounds` times in one process."""
    from reinforge.engine.cuda_graphs import DecodeGraphs

    run = DecodeGraphs.run

    def logits_only(self, seqs, prev_ids=None, grown_rows=None, temperature=None):
        return run(self, seqs, prev_ids, grown_rows, None)

    def use(method):
        DecodeGraphs.run = method

    variants = [("in the graph", lambda: use(run)), ("launched after", lambda: use(logits_only))]
    try:
        return alternated(model, config, w, prompts, rounds, variants, "the sampler")
    finally:
        DecodeGraphs.run = run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--unfused-too",
        action="store_true",
        help="also time the engine with q/k/v and gate/up as separate products (before fusing)",
    )
    parser.add_argument("--hf-new-tokens", type=int, help="HF: time this many new tokens")
    parser.add_argument("--hf-batches", type=int, help="HF: time this many batches of 256")
    parser.add_argument("--profile", action="store_true", help="device time by kernel class")
    parser.add_argument(
        "--profile-tokens",
        type=int,
        default=33,
        help="new tokens of the profiled decode (the workload's + 1: its whole generation)",
    )
    parser.add_argument("--kernels", action="store_true", help="decode kernel / sampler bench")
    parser.add_argument("--rope-kernels", action="store_true", help="only the RoPE A/B kernels")
    parser.add_argument(
        "--decode-config",
        action="append",
        default=[],
        help="KEY=INT over triton_attention.DECODE_CONFIG for the runs (e.g. programs_per_sm=8)",
    )
    parser.add_argument(
        "--rope-ab", type=int, default=0, help="rounds of RoPE in / beside the attention kernel"
    )
    parser.add_argument(
        "--sampler-ab", type=int, default=0, help="rounds of the sampler in / after the graph"
    )
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="also time a random LoRA adapter, both ways",
    )
    parser.add_argument(
        "--record-routes", action="store_true", help="also time it recording routes (MoE)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import transformers

    props = torch.cuda.get_device_properties(0)
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": props.name,
        "gpu_memory_gib": props.total_memory / 2**30,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    bw, flops = measure_bandwidth(), measure_matmul_flops()
    env["copy_bandwidth_tb_s"], env["bf16_matmul_tflops"] = bw / 1e12, flops / 1e12
    log(f"environment: {env}")
    report = {"environment": env, "results": []}
    if args.decode_config:
        from reinforge.engine import triton_attention

        for item in args.decode_config:
            key, value = item.split("=")
            assert key in triton_attention.DECODE_CONFIG, f"--decode-config {key}: no such key"
            triton_attention.DECODE_CONFIG[key] = int(value)
        log(f"  decode config: {triton_attention.DECODE_CONFIG}")
    if args.kernels:
        report["kernels"] = kernel_bench()
    elif args.rope_kernels:
        report["kernels"] = rope_kernels()
    for name in args.workload or []:
        report["results"].append(run_workload(name, args, bw, flops))
        (out / "engine_bench.json").write_text(json.dumps(report, indent=1))
    (out / "engine_bench.json").write_text(json.dumps(report, indent=1))

    log(
        f"\n{env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"copy {bw / 1e12:.2f} TB/s"
    )
    log("| workload | engine | tokens/s | vs HF | of BW floor | of roofline | peak GiB | seconds |")
    log("|---|---|---|---|---|---|---|---|")
    for r in report["results"]:
        ours = r["reinforge"]
        log(
            f"| {r['workload']} | reinforge | {ours['tokens_per_s']:,.0f} | "
            f"{r.get('ratio', float('nan')):.1f}x | {ours['fraction_of_floor']:.2f} | "
            f"{ours['fraction_of_roofline']:.2f} | {ours['peak_memory_gib']:.1f} "
            f"(KV pool {ours['kv_pool_gib']:.0f}, used {ours['kv_peak_used_gib']:.1f}) | "
            f"{ours['seconds']:.1f} |"
        )
        for mode in ("adapters", "merged"):
            if "lora" not in r:
                break
            run = r["lora"][mode]
            log(
                f"| {r['workload']} | reinforge, LoRA r={r['lora']['rank']} {mode} | "
                f"{run['tokens_per_s']:,.0f} | {r['lora'][f'{mode}_vs_plain']:.2f}x plain | | | "
                f"{run['peak_memory_gib']:.1f} (KV pool {run['kv_pool_gib']:.0f}) | "
                f"{run['seconds']:.1f} |"
            )
        if "reinforge_matched" in r:
            m, hf = r["reinforge_matched"], r["hf"]
            log(
                f"| {r['workload']} | reinforge ({hf['num_sequences']} seqs x "
                f"{hf['new_tokens']} new) | {m['tokens_per_s']:,.0f} | "
                f"{r['ratio_matched']:.1f}x | | | {m['peak_memory_gib']:.1f} | "
                f"{m['seconds']:.1f} |"
            )
        if "hf" in r:
            hf = r["hf"]
            note = (
                ""
                if hf["new_tokens"] == r["spec"]["new_tokens"]
                else f" ({hf['num_sequences']} seqs x {hf['new_tokens']} new)"
            )
            log(
                f"| {r['workload']} | HF generate{note} | {hf['tokens_per_s']:,.0f} | 1.0x | "
                f"{hf['fraction_of_floor']:.3f} | {hf['fraction_of_roofline']:.3f} | "
                f"{hf['peak_memory_gib']:.1f} | {hf['seconds']:.1f} |"
            )


if __name__ == "__main__":
    main()
