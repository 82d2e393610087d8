"""The paged engine's CUDA path (Triton kernels, CUDA graphs, on-device sampler) against
transformers on the GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .conftest import FAMILIES, build_model

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7], list(range(10, 18)), list(range(20, 37)), list(range(40, 73))]
CUDA = torch.device("cuda")


def hf_greedy_cuda(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=CUDA)
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


def greedy(engine, prompts, max_new_tokens=16, n=2):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=n)
    return [[c.token_ids for c in group] for group in engine.generate(prompts, params)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_float32_matches_hf_generate_with_graphs(micro_dir, tokenizer, family):
    model = build_model(family, micro_dir, tokenizer).to(CUDA)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=256)
    assert engine.runner.backend.name == "triton-paged" and engine.runner.graphs is not None
    outputs = greedy(engine, PROMPTS, 16, n=3)
    assert engine.stats.extra["num_decode_steps"] > 0
    for prompt, group in zip(PROMPTS, outputs):
        assert group == [hf_greedy_cuda(model, prompt, 16)] * 3
    eager = PagedEngine(model, tokenizer, block_size=4, num_blocks=256, use_cuda_graphs=False)
    assert greedy(eager, PROMPTS, 16, n=3) == outputs


def test_many_sequences_across_buckets_match_eager(micro_dir, tokenizer, monkeypatch):
    """Batches that shrink through several graph buckets as sequences stop at stop ids; with and
    without running a step ahead (the device sampler does not depend on the batch)."""
    from .test_paged_engine import common_tokens

    model = build_model("qwen2", micro_dir, tokenizer).to(CUDA)
    prompts = [list(range(3 + i, 9 + 2 * i)) for i in range(45)]
    graphs = PagedEngine(model, tokenizer, block_size=4, num_blocks=2048)
    eager = PagedEngine(model, tokenizer, block_size=4, num_blocks=2048, use_cuda_graphs=False)
    free_run = graphs.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    stops = common_tokens(free_run, 3)
    for temperature in (0.0, 0.8):
        params = SamplingParams(
            max_new_tokens=24, temperature=temperature, n=3, stop_token_ids=stops, seed=1
        )
        got = graphs.generate(prompts, params)
        assert graphs.stats.extra["num_overlapped_steps"] > 0
        expected = eager.generate(prompts, params)
        monkeypatch.setattr(PagedEngine, "overlap", False)
        in_step = graphs.generate(prompts, params)
        monkeypatch.setattr(PagedEngine, "overlap", True)
        token_ids = lambda out: [[c.token_ids for c in g] for g in out]  # noqa: E731
        assert token_ids(got) == token_ids(expected) == token_ids(in_step)
        lengths = {len(c.token_ids) for g in got for c in g}
        assert len(lengths) > 1, "some sequences should stop early"


def test_graph_replay_sees_in_place_weight_updates(micro_dir, tokenizer):
    model = build_model("qwen2", micro_dir, tokenizer, seed=1).to(CUDA)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=256)
    before = greedy(engine, PROMPTS, 12, n=1)
    assert engine.runner.graphs.graphs, "decode should have run from captured graphs"

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([PROMPTS[2] + before[2][0]], device=CUDA)
    model(ids, labels=ids).loss.neg().backward()  # push away from what it generated
    optimizer.step()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.bias.mul_(3.0)
    graphs = dict(engine.runner.graphs.graphs)

    after = greedy(engine, PROMPTS, 12, n=1)
    assert engine.runner.graphs.graphs == graphs, "in-place updates need no recapture"
    assert after != before
    for prompt, group in zip(PROMPTS, after):
        assert group[0] == hf_greedy_cuda(model, prompt, 12)

    # a parameter replaced by a new tensor: the graphs are captured again
    layer = model.model.layers[1].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * -1.0)
    replaced = greedy(engine, PROMPTS, 12, n=1)
    assert engine.runner.graphs.graphs != graphs
    for prompt, group in zip(PROMPTS, replaced):
        assert group[0] == hf_greedy_cuda(model, prompt, 12)


def logprobs_on_device(model, prompt: list[int], completion: list[int], temperature: float):
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logprobs.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu()


def test_bf16_sampled_logprobs_match_teacher_forcing(micro_dir, tokenizer):
    """bf16: the engine's logprobs are about as close to float32 transformers as bf16
    transformers' own."""
    model32 = build_model("qwen2", micro_dir, tokenizer).to(CUDA)
    model16 = build_model("qwen2", micro_dir, tokenizer).to(CUDA, torch.bfloat16)
    engine = PagedEngine(model16, tokenizer, block_size=16, num_blocks=512)
    params = SamplingParams(max_new_tokens=24, temperature=0.9, n=4, seed=5, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    ours, theirs = [], []
    for prompt, group in zip(PROMPTS, outputs):
        assert len({tuple(c.token_ids) for c in group}) > 1, "samples of a group should differ"
        for completion in group:
            ref = logprobs_on_device(model32, prompt, completion.token_ids, 0.9)
            hf16 = logprobs_on_device(model16, prompt, completion.token_ids, 0.9)
            ours.append((torch.tensor(completion.logprobs) - ref).abs())
            theirs.append((hf16 - ref).abs())
    ours_err, bf16_err = torch.cat(ours).mean().item(), torch.cat(theirs).mean().item()
    print(
        f"\nmean |logprob - float32 logprob|: engine {ours_err:.4f}, transformers bf16 {bf16_err:.4f}"
    )
    assert ours_err < 2 * bf16_err + 0.01


def test_default_pool_takes_free_memory_less_the_reserve(micro_dir, tokenizer):
    from reinforge.engine.pool_size import kv_bytes_per_block

    model = build_model("qwen2", micro_dir, tokenizer).to(CUDA, torch.bfloat16)
    free_before, _ = torch.cuda.mem_get_info()
    engine = PagedEngine(model, tokenizer, block_size=16)
    pool_bytes = engine.num_blocks * kv_bytes_per_block(model, 16)
    assert 0.5 * free_before < pool_bytes < free_before
    assert engine.runner.kv_cache.numel() * 2 == pool_bytes
    explicit = PagedEngine(model, tokenizer, block_size=16, kv_cache_bytes=64 * 2**20)
    assert explicit.num_blocks == 64 * 2**20 // kv_bytes_per_block(model, 16)
    del engine, explicit
    torch.cuda.empty_cache()


def test_release_frees_the_pool_and_graphs_and_the_next_generate_is_unchanged(micro_dir, tokenizer):
    """The trainer's update gets the KV pool's memory and the graphs' private pool back; the
    next generate allocates them again, recaptures the buckets it uses, and decodes the same."""
    model = build_model("qwen2", micro_dir, tokenizer).to(CUDA, torch.bfloat16)
    engine = PagedEngine(model, tokenizer, block_size=16, kv_cache_bytes=256 * 2**20)
    prompts = [list(range(5, 5 + k)) for k in range(1, 40)]
    first = greedy(engine, prompts, n=2)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    engine.release_memory()
    torch.cuda.synchronize()
    freed = held - torch.cuda.memory_allocated()
    assert freed >= 256 * 2**20 * 0.95, freed  # at least the pool
    assert greedy(engine, prompts, n=2) == first
    assert engine.runner.graphs.graphs  # captured again, over the new pool
    assert engine.stats.extra["seconds_graph_capture"] > 0


def test_a_shared_mempool_takes_turns_and_keeps_the_decode_graphs(micro_dir, tokenizer):
    """`share_memory`: the KV pool lives in a `torch.cuda.MemPool` that a trainer's captured
    update uses while it is released. Here a graph captured into the same mempool stands for the
    update: it is captured over the released pool's memory (the mempool does not grow) and its
    replay writes NaN all over it; the next generate finds the pool at its address, keeps its
    decode graphs (no capture) and decodes exactly as before."""
    from reinforge.engine.cuda_graphs import capture

    model = build_model("qwen2", micro_dir, tokenizer).to(CUDA, torch.bfloat16)
    prompts = [list(range(5, 5 + k)) for k in range(1, 40)]
    plain = PagedEngine(model, tokenizer, block_size=16, kv_cache_bytes=64 * 2**20)
    expected = greedy(plain, prompts, n=2)
    del plain
    engine = PagedEngine(model, tokenizer, block_size=16, kv_cache_bytes=64 * 2**20)
    mempool = torch.cuda.MemPool()
    engine.runner.share_memory(mempool)
    first = greedy(engine, prompts, n=2)
    assert first == expected  # prefills in the mempool, logits rows beside the pool: the same
    address = engine.runner.kv_cache.data_ptr()
    decode = engine.runner.graphs
    assert decode is not None and decode.graphs
    # the decode graphs write their logits beside the KV pool, in the mempool's one block
    area = engine.runner.logits_area
    assert decode._logits is None and area is not None and area.shape[0] == decode.max_batch_size
    assert area.data_ptr() == address + engine.runner.kv_cache.numel() * 2
    del area  # (a view keeps the whole block alive)

    def reserved(allocated: bool = False) -> int:
        return sum(
            s["allocated_size" if allocated else "total_size"]
            for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", ())) == tuple(mempool.id)
        )

    engine.release_memory()
    assert reserved(allocated=True) == 0  # the pool, its logits rows, the prefills': all free
    assert engine.runner.logits_area is None
    before = reserved()
    size = 48 * 2**20 // 4  # float32 elements: most of the released pool
    graph = torch.cuda.CUDAGraph()
    capture(graph, lambda: torch.full((size,), float("nan"), device=CUDA).sum(), mempool.id)
    graph.replay()
    torch.cuda.synchronize()
    assert reserved() - before <= 2 * 2**20  # carved out of the released KV pool (the sum: 2 MiB)
    totals = dict(engine.totals)
    assert greedy(engine, prompts, n=2) == first
    assert engine.runner.kv_cache.data_ptr() == address
    assert engine.runner.graphs is decode and decode.graphs  # kept, not captured again
    assert engine.totals["gen_graph_capture_s"] == totals["gen_graph_capture_s"]
    graph.replay()  # the update again, the pool released or not: the next generate is the same
    engine.release_memory()
    graph.replay()
    assert greedy(engine, prompts, n=2) == first


def test_a_prefill_in_the_shared_mempool_is_counted_once(micro_dir, tokenizer):
    """With the KV pool in a shared mempool, a prefill's activations are allocated there too
    (G1: in the update's memory, free while the engine generates), and the peak it sets is
    recorded: `peak_outside_prefills` gives the allocator's peak without it, since the
    mempool's reserved bytes already count that memory (`graphs.held_bytes`)."""
    model = build_model("qwen2", micro_dir, tokenizer).to(CUDA, torch.bfloat16)
    engine = PagedEngine(model, tokenizer, block_size=16, kv_cache_bytes=64 * 2**20)
    mempool = torch.cuda.MemPool()
    runner = engine.runner
    runner.share_memory(mempool)
    prompts = [list(range(5 + i, 205 + i)) for i in range(40)]  # one long prefill, short decode
    greedy(engine, prompts, max_new_tokens=4, n=1)  # captures its decode graphs
    runner.peak_outside_prefills(0)  # (forgets the first generate's)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    greedy(engine, prompts, max_new_tokens=4, n=1)
    peak = torch.cuda.max_memory_allocated()
    reserved = sum(
        s["total_size"]
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", ())) == tuple(mempool.id)
    )
    assert reserved > runner.kv_bytes_in_mempool  # the prefill's activations are the mempool's
    assert peak > start + 2**20  # the prefill set this generate's peak ...
    outside = runner.peak_outside_prefills(peak)
    assert start <= outside < peak - 2**20  # ... and it is taken out of the peak once
    assert runner.peak_outside_prefills(peak) == peak  # forgotten after the read


def test_a_prefill_that_runs_out_of_memory_in_the_mempool_runs_again(micro_dir, tokenizer):
    """The mempool grows only from memory no pool caches: a prefill there that runs out of
    memory hands the default pool's cached blocks back and runs once more (the same K/V)."""
    model = build_model("qwen2", micro_dir, tokenizer).to(CUDA, torch.bfloat16)
    engine = PagedEngine(model, tokenizer, block_size=16, kv_cache_bytes=64 * 2**20)
    runner = engine.runner
    runner.share_memory(torch.cuda.MemPool())
    calls = []

    def prefill() -> torch.Tensor:
        calls.append(torch.cuda.current_stream())
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return torch.ones(4, 8, device=CUDA)

    out = runner.prefills.run(runner.kv_mempool, CUDA, prefill)
    assert len(calls) == 2 and all(s == calls[0] for s in calls)  # both on the capture stream
    assert calls[0] != torch.cuda.current_stream()
    assert out.sum().item() == 32
    with pytest.raises(torch.OutOfMemoryError):  # twice: the error stands
        runner.prefills.run(
            runner.kv_mempool, CUDA, lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("again"))
        )


def test_a_capture_leaves_no_blas_workspace_in_its_pool():
    """cuBLAS makes a workspace per stream at the stream's first matrix product and keeps it
    for the process's life: made inside a capture into a shared mempool, it would stay there as
    a live block splitting the memory that the KV pool and the update take in turn (session 21:
    a 32 MiB block 540 MiB into G1's mempool grew it from 1.6 to 2.1 GiB). The capture stream
    makes its workspaces when it is created, and autograd's thread's before the first capture of
    a backward (`warm_blas`), outside any pool, so after capturing
    products of each kind, forward and backward (autograd's own thread has its own cuBLAS
    handle), the mempool holds only the graph's outputs."""
    from reinforge.engine import cuda_graphs

    cuda_graphs._CAPTURE_STREAMS.clear()  # a fresh stream, as in a new process
    cuda_graphs._BACKWARD_WARMED.clear()
    with torch.inference_mode():  # made where the engine first captures (s21d: it raised)
        cuda_graphs.capture_stream()
    mempool = torch.cuda.MemPool()
    a = torch.randn(256, 256, device=CUDA, dtype=torch.bfloat16)
    b = a.float()
    w = torch.randn(256, 256, device=CUDA, requires_grad=True)
    w.grad = torch.zeros_like(w)  # (outside the pool: the backward adds into it)

    def products():
        out = torch.mm(a, a) + torch.addmm(a[0], a, a.t())
        out = out.float() + torch.nn.functional.linear(b, b, b[0]) + b.t() @ b
        (b @ w).square().sum().backward()
        return out

    graph = torch.cuda.CUDAGraph()
    out = cuda_graphs.capture(graph, products, mempool.id, backward=True)
    graph.replay()
    torch.cuda.synchronize()
    allocated = sum(
        s["allocated_size"]
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", ())) == tuple(mempool.id)
    )
    assert out.numel() * out.element_size() <= allocated <= 2**20, allocated
    grad = w.grad.clone()
    w.grad.zero_()
    torch.testing.assert_close(out, products(), rtol=1e-2, atol=1e-1)
    torch.testing.assert_close(w.grad, grad, rtol=1e-3, atol=1e-2)  # the replay's backward ran
