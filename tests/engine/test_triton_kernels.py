"""The Triton kernels of the CUDA path against the torch reference ops.

On a machine with CUDA they run natively, in bf16 and float32. Without CUDA they run in Triton's
interpreter on the CPU (float32 only: the interpreter's bf16 dot is wrong), when triton is
installed; otherwise the module is skipped.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not HAS_CUDA and not INTERPRETED:
    # Triton reads TRITON_INTERPRET when it is first imported, and torch may import it before
    # this module: run this file again in a child process with the interpreter on.
    def test_kernels_in_the_triton_interpreter():
        repo = Path(__file__).resolve().parents[2]
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            cwd=repo,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

elif INTERPRETED:
    # Triton 3.6's interpreter turns 1-element arrays into ints with int(array), which numpy 2
    # refuses; loop bounds loaded from memory need it
    import triton.runtime.interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_with_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_with_index

from reinforge.engine import (  # noqa: E402
    sampling,
    triton_attention,
    triton_ops,
    triton_sampling,
)
from reinforge.engine.attention import (  # noqa: E402
    AttentionMetadata,
    decode_sdpa,
    write_kv_index_copy,
)
from reinforge.engine.qwen_forward import add_rms_norm, apply_rope  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
runs_here = pytest.mark.skipif(
    not HAS_CUDA and not INTERPRETED, reason="runs in the Triton interpreter child process"
)
DTYPES = [torch.bfloat16, torch.float32] if HAS_CUDA else [torch.float32]


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return ((got - ref).norm() / ref.norm()).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


def random_pool(lengths, num_kv_heads, head_dim, block_size, dtype, generator):
    """A pool with each sequence's pages scattered and the unused pages full of noise."""
    num_pages = sum(math.ceil(n / block_size) for n in lengths) + 3
    k_cache = torch.randn(num_pages, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_pages, block_size, num_kv_heads, head_dim, generator=generator)
    order = torch.randperm(num_pages, generator=generator).tolist()
    tables = [[order.pop() for _ in range(math.ceil(n / block_size))] for n in lengths]
    width = max(map(len, tables)) + 2  # wider than needed, padded with a real page
    padded = [t + [order[0]] * (width - len(t)) for t in tables]
    return k_cache.to(dtype), v_cache.to(dtype), torch.tensor(padded, dtype=torch.int32)


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(4, 2, 16, 4), (14, 2, 64, 16), (28, 4, 128, 16), (8, 8, 32, 16)],
)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_paged_decode_matches_sdpa(
    num_heads, num_kv_heads, head_dim, block_size, num_splits, dtype
):
    if not HAS_CUDA and head_dim > 64:
        pytest.skip("large shapes are slow in the interpreter")
    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim + (num_splits or 0))
    lengths = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 77]
    k_cache, v_cache, tables = random_pool(
        lengths, num_kv_heads, head_dim, block_size, dtype, generator
    )
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_tables=tables.long(),
        context_lens=torch.tensor(lengths),
        query_lens=[1] * len(lengths),
        context_lens_host=lengths,
    )
    expected = decode_sdpa(q.double(), k_cache.double(), v_cache.double(), meta, scale)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    got = triton_attention.paged_decode(
        q.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        tables.to(DEVICE),
        torch.tensor(lengths, device=DEVICE),
        scale,
        num_splits=num_splits,
    )
    assert not got.isnan().any() and out.isnan().all()
    assert got.dtype == dtype and got.shape == q.shape
    assert rel_error(got, expected) < tolerance(dtype)


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_matches_torch(dtype):
    generator = torch.Generator().manual_seed(1)
    T, H, K, D, pages, block_size = 5, 6, 2, 32, 4, 4
    q = torch.randn(T, H, D, generator=generator).to(dtype)
    k = torch.randn(T, K, D, generator=generator).to(dtype)
    v = torch.randn(T, K, D, generator=generator).to(dtype)
    angles = torch.rand(T, D // 2, generator=generator) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.tensor([3, 9, -1, 0, 15])
    k_cache = torch.randn(pages, block_size, K, D, generator=generator).to(dtype)
    v_cache = torch.randn(pages, block_size, K, D, generator=generator).to(dtype)

    ref_q = apply_rope(q.double(), cos.double(), sin.double())
    ref_k = apply_rope(k.double(), cos.double(), sin.double())
    ref_k_cache, ref_v_cache = k_cache.double(), v_cache.double()
    keep = slots >= 0
    write_kv_index_copy(ref_k_cache, ref_v_cache, ref_k[keep], v.double()[keep], slots[keep])

    got_q, got_k, got_v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    got_k_cache, got_v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    triton_attention.rope_write_kv(
        got_q,
        got_k,
        got_v,
        cos.to(DEVICE),
        sin.to(DEVICE),
        got_k_cache,
        got_v_cache,
        slots.to(DEVICE),
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert rel_error(got_q, ref_q) < tol and rel_error(got_k, ref_k) < tol
    assert rel_error(got_k_cache, ref_k_cache) < tol
    assert torch.equal(got_v_cache.cpu(), ref_v_cache.to(dtype))  # a plain copy


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size", [(14, 2, 64, 16), (4, 4, 32, 4)]
)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_paged_decode_rope_matches_the_two_kernels(
    num_heads, num_kv_heads, head_dim, block_size, num_splits, dtype
):
    """RoPE, the new K/V's write and attention in one kernel: the same output as
    `rope_write_kv` then `paged_decode` (the new key read from registers, not the pool), the
    same pool afterwards (nothing written for slot -1), and q / k left unrotated."""
    generator = torch.Generator().manual_seed(head_dim + (num_splits or 0))
    lengths = [1, block_size, block_size + 1, 5 * block_size + 3, 40]
    B, D = len(lengths), head_dim
    k_cache, v_cache, tables = random_pool(
        lengths, num_kv_heads, head_dim, block_size, dtype, generator
    )
    # each sequence's new token goes to its last position; the second one's is not written
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for i, n in enumerate(lengths)]  # fmt: skip
    slots[1] = -1
    qkv = torch.randn(B, (num_heads + 2 * num_kv_heads) * D, generator=generator).to(dtype)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k, v = q.view(B, num_heads, D), k.view(B, num_kv_heads, D), v.view(B, num_kv_heads, D)
    angles = torch.rand(B, D // 2, generator=generator) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    args = dict(device=DEVICE)
    lens = torch.tensor(lengths, **args)
    slots_t = torch.tensor(slots, **args)

    ref_q, ref_k, ref_v = (x.clone().to(DEVICE) for x in (q, k, v))
    ref_k_cache, ref_v_cache = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    pos_k = ref_k_cache.clone()  # where the skipped token's key must still be read from
    triton_attention.rope_write_kv(
        ref_q, ref_k, ref_v, cos.to(DEVICE), sin.to(DEVICE), ref_k_cache, ref_v_cache, slots_t
    )
    # the unwritten token: the two-kernel path reads whatever the pool holds there, the fused
    # one its new key; give the reference the new key too, then put the pool back
    n1 = lengths[1] - 1
    page = int(tables[1, n1 // block_size])
    ref_k_cache[page, n1 % block_size] = ref_k[1]
    ref_v_cache[page, n1 % block_size] = ref_v[1]
    expected = triton_attention.paged_decode(
        ref_q, ref_k_cache, ref_v_cache, tables.to(DEVICE), lens, D**-0.5, num_splits
    )
    ref_k_cache[page, n1 % block_size] = pos_k[page, n1 % block_size]
    ref_v_cache[page, n1 % block_size] = v_cache.to(DEVICE)[page, n1 % block_size]

    got_q, got_k, got_v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    got_k_cache, got_v_cache = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    got = triton_attention.paged_decode_rope(
        got_q, got_k, got_v, cos.to(DEVICE), sin.to(DEVICE), got_k_cache, got_v_cache,
        tables.to(DEVICE), lens, slots_t, D**-0.5, num_splits,
    )  # fmt: skip
    assert got.shape == q.shape and got.dtype == dtype and not got.isnan().any()
    assert rel_error(got, expected) < tolerance(dtype)
    # the rotation may round a key differently by one ulp (fused multiply-adds); values copy
    assert rel_error(got_k_cache, ref_k_cache) < tolerance(dtype) / 10
    untouched = torch.ones(got_k_cache.shape[:2], dtype=torch.bool)
    for slot in slots:
        if slot >= 0:
            untouched[slot // block_size, slot % block_size] = False
    assert torch.equal(got_k_cache.cpu()[untouched], k_cache[untouched])
    assert torch.equal(got_v_cache.cpu(), ref_v_cache.cpu())
    assert torch.equal(got_q.cpu(), q) and torch.equal(got_k.cpu(), k)  # not rotated in place


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_and_silu_mul_match_torch(dtype, with_delta):
    generator = torch.Generator().manual_seed(2)
    T, E = 7, 896
    hidden = torch.randn(T, E, generator=generator).to(dtype)
    delta = torch.randn(T, E, generator=generator).to(dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(E, generator=generator)).to(dtype)
    ref_x, ref_hidden = add_rms_norm(hidden, delta, weight, 1e-6)

    got_hidden = hidden.to(DEVICE, copy=True)  # (updated in place)
    got_x, got_hidden_out = triton_ops.add_rms_norm(
        got_hidden, None if delta is None else delta.to(DEVICE), weight.to(DEVICE), 1e-6
    )
    assert got_hidden_out.data_ptr() == got_hidden.data_ptr()  # updated in place
    # same roundings as transformers: at most one bf16 ulp apart (rsqrt differs in last bits)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got_hidden.cpu(), ref_hidden, atol=atol, rtol=1e-2)
    torch.testing.assert_close(got_x.cpu(), ref_x, atol=atol, rtol=1e-2)
    # the sum into a separate, strided residual (a column of the engine's records,
    # `engine.records`): `hidden` untouched
    records = torch.zeros(T, 3, E, dtype=dtype, device=DEVICE)
    fresh = hidden.to(DEVICE, copy=True)
    rec_x, rec_hidden = triton_ops.add_rms_norm(
        fresh, None if delta is None else delta.to(DEVICE), weight.to(DEVICE), 1e-6, records[:, 1]
    )
    assert rec_hidden.data_ptr() == records[:, 1].data_ptr()
    torch.testing.assert_close(fresh.cpu(), hidden, atol=0, rtol=0)
    torch.testing.assert_close(records[:, 1].cpu(), ref_hidden, atol=atol, rtol=1e-2)
    assert not records[:, 0].any() and not records[:, 2].any()
    torch.testing.assert_close(rec_x.cpu(), got_x.cpu(), atol=0, rtol=0)

    gate = torch.randn(T, 3000, generator=generator).to(dtype)
    up = torch.randn(T, 3000, generator=generator).to(dtype)
    got = triton_ops.silu_mul(gate.to(DEVICE), up.to(DEVICE))
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got.cpu(), ref, atol=atol, rtol=1e-2)
    # the halves of one fused gate/up product: strided rows (`engine.layout`)
    halves = torch.cat([gate, up], dim=1).to(DEVICE).chunk(2, dim=1)
    assert not halves[0].is_contiguous()
    torch.testing.assert_close(triton_ops.silu_mul(*halves).cpu(), got.cpu(), atol=0, rtol=0)


@runs_here
def test_gumbel_sampler_greedy_and_logprobs():
    generator = torch.Generator().manual_seed(3)
    B, V = 5, 3000
    logits = (torch.randn(B, V, generator=generator) * 3).to(DTYPES[0])
    seeds = torch.arange(B, dtype=torch.long)
    positions = torch.zeros(B, dtype=torch.long)
    args = (seeds.to(DEVICE), positions.to(DEVICE))
    ids, lps = triton_sampling.sample_gumbel(logits.to(DEVICE), 0.0, *args)
    ref_lp = torch.log_softmax(logits.float(), -1)
    assert ids.cpu().tolist() == logits.float().argmax(-1).tolist()
    torch.testing.assert_close(lps.cpu(), ref_lp.gather(-1, ids.cpu()[:, None])[:, 0])

    ids, lps = triton_sampling.sample_gumbel(logits.to(DEVICE), 0.7, *args)
    ref_lp = torch.log_softmax(logits.float() / 0.7, -1)
    torch.testing.assert_close(lps.cpu(), ref_lp.gather(-1, ids.cpu()[:, None])[:, 0])
    again, _ = triton_sampling.sample_gumbel(logits.to(DEVICE), 0.7, *args)
    assert torch.equal(ids, again)  # a function of (seed, position) alone
    moved, _ = triton_sampling.sample_gumbel(logits.to(DEVICE), 0.7, seeds.to(DEVICE), args[1] + 1)
    assert not torch.equal(ids, moved)


@runs_here
def test_gumbel_sampler_follows_the_distribution():
    B, temperature = 20000 if HAS_CUDA else 300, 0.8  # the interpreter is slow per program
    logits_V = torch.tensor([1.0, 0.6, 0.2, -0.2, -0.6, 0.0])
    V = logits_V.numel()
    logits = logits_V.expand(B, V).contiguous().to(DEVICE)
    seeds = torch.arange(B, device=DEVICE) * 7919 + 11
    positions = torch.full((B,), 5, device=DEVICE)
    ids, _ = triton_sampling.sample_gumbel(logits, temperature, seeds, positions)
    observed = torch.bincount(ids.cpu(), minlength=V).double()
    expected = torch.softmax(logits_V.double() / temperature, -1) * B
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    df = V - 1  # Wilson-Hilferty upper critical value at p = 0.001
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert statistic < critical, (observed, expected)


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_inverse_cdf_sampler_draws_what_the_torch_sampler_draws(dtype):
    """The same keyed uniform (splitmix64 of seed and position, made on the device bit for bit)
    and the same inversion as `sample_keyed`: the same tokens, but where the uniform falls
    within float32 rounding of a boundary between two tokens, and the same logprobs."""
    generator = torch.Generator().manual_seed(5)
    B, V = (256, 151_936) if HAS_CUDA else (12, 3000)
    logits = (torch.randn(B, V, generator=generator) * 2).to(dtype)
    seeds = torch.randint(0, 2**63 - 1, (B,), generator=generator)
    seeds[:3] = torch.tensor([0, 1, 2**63 - 1])
    positions = torch.randint(0, 4096, (B,), generator=generator)
    uniforms = [sampling.row_uniform(int(k), int(p)) for k, p in zip(seeds, positions)]
    for temperature in (1.0, 0.6):
        ids, lps = triton_sampling.sample_inverse_cdf(
            logits.to(DEVICE), temperature, seeds.to(DEVICE), positions.to(DEVICE)
        )
        ref_ids, ref_lps = sampling.sample_keyed(logits, temperature, 1.0, 0, 0.0, uniforms)
        same = (ids.cpu() == ref_ids).float().mean().item()
        assert same >= (0.99 if HAS_CUDA else 1.0), same
        ref_lp = torch.log_softmax(logits.float() / temperature, -1)
        torch.testing.assert_close(
            lps.cpu(), ref_lp.gather(-1, ids.cpu()[:, None])[:, 0], atol=1e-4, rtol=1e-4
        )
        assert torch.allclose(
            lps.cpu()[ids.cpu() == ref_ids], ref_lps[ids.cpu() == ref_ids], atol=1e-4
        )
    moved, _ = triton_sampling.sample_inverse_cdf(
        logits.to(DEVICE), 1.0, seeds.to(DEVICE), positions.to(DEVICE) + 1
    )
    assert not torch.equal(moved.cpu(), ids.cpu())  # a new position, a new draw


@runs_here
def test_inverse_cdf_sampler_also_gives_each_rows_log_sum_exp_and_entropy():
    """`stats_out`: `sampling.row_stats` of each row at the temperature (the records' statistics
    for the trainer's LM head), from the first pass's sums; the same draws as without. Rows
    with a large spread, a near one-hot row, and -inf entries (zero mass) included."""
    generator = torch.Generator().manual_seed(8)
    B, V = (64, 151_936) if HAS_CUDA else (6, 3000)
    logits = torch.randn(B, V, generator=generator) * torch.linspace(0.1, 8.0, B)[:, None]
    logits[0, 5] = 60.0  # nearly all mass on one token
    logits[1, : V // 2] = -float("inf")
    seeds = torch.randint(0, 2**63 - 1, (B,), generator=generator).to(DEVICE)
    positions = torch.randint(0, 4096, (B,), generator=generator).to(DEVICE)
    for temperature in (1.0, 0.6):
        x = logits.to(torch.bfloat16).to(DEVICE)
        stats = torch.empty(B, 2, device=DEVICE)
        ids, lps = triton_sampling.sample_inverse_cdf(
            x, temperature, seeds, positions, num_chunks=5, stats_out=stats
        )
        plain_ids, plain_lps = triton_sampling.sample_inverse_cdf(
            x, temperature, seeds, positions, num_chunks=5
        )
        assert torch.equal(ids, plain_ids) and torch.equal(lps, plain_lps)
        want = sampling.row_stats(x.cpu(), temperature)
        torch.testing.assert_close(stats.cpu(), want, atol=2e-4, rtol=1e-4)
        assert stats[0, 1].item() < 1e-3  # (the near one-hot row)


def test_inverse_cdf_sampler_follows_the_distribution_and_skips_zero_mass():
    B, temperature = 20000 if HAS_CUDA else 300, 0.8
    logits_V = torch.tensor([1.0, 0.6, 0.2, -0.2, -0.6, 0.0, -float("inf"), 0.3])
    V = logits_V.numel()
    logits = logits_V.expand(B, V).contiguous().to(DEVICE)
    seeds = torch.arange(B, device=DEVICE) * 7919 + 11
    positions = torch.full((B,), 5, device=DEVICE)
    ids, lps = triton_sampling.sample_inverse_cdf(
        logits, temperature, seeds, positions, num_chunks=3
    )
    observed = torch.bincount(ids.cpu(), minlength=V).double()
    assert observed[6] == 0  # probability 0: never drawn
    expected = torch.softmax(logits_V.double() / temperature, -1) * B
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    df = int(keep.sum()) - 1  # Wilson-Hilferty upper critical value at p = 0.001
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert statistic < critical, (observed, expected)
    assert torch.isfinite(lps).all()
    nan_rows = logits[:4].clone()
    nan_rows[0] = float("nan")  # a broken row: an id in range, a NaN logprob; the others intact
    ids, lps = triton_sampling.sample_inverse_cdf(nan_rows, temperature, seeds[:4], positions[:4])
    assert 0 <= int(ids[0]) < V and torch.isnan(lps[0]) and torch.isfinite(lps[1:]).all()


@runs_here
def test_engine_on_the_triton_path_matches_hf_greedy(models, tokenizer, monkeypatch):
    """The whole fast path but the graphs (fused ops, RoPE + K/V write, paged decode, on-device
    sampler) against transformers, float32."""
    from reinforge.engine import model_runner
    from reinforge.engine.base import SamplingParams
    from reinforge.engine.paged import PagedEngine

    from .conftest import hf_greedy

    fused = model_runner.ForwardOps(
        add_rms_norm=triton_ops.add_rms_norm, silu_mul=triton_ops.silu_mul
    )
    monkeypatch.setattr(model_runner, "select_attention_backend", lambda device: BACKEND)
    monkeypatch.setattr(model_runner, "select_ops", lambda device: fused)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .conftest import scramble

    # heads of 32: the decode step's RoPE, K/V write and attention run as one kernel
    # (`paged_decode_rope`); the shared models' heads of 16 take the two-kernel path
    torch.manual_seed(3)
    wide = Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    wide_model = scramble(Qwen3ForCausalLM(wide), 3)
    wide_model.generation_config.eos_token_id = tokenizer.eos_token_id
    wide_model.generation_config.pad_token_id = tokenizer.pad_token_id
    prompts = [[5, 6, 7], list(range(20, 37))]
    for model in (models["qwen2"], models["qwen3"], wide_model):
        model = model.to(DEVICE)
        engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64, use_cuda_graphs=False)
        assert engine.runner.is_fast_path
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, n=2))
        for prompt, group in zip(prompts, outputs):
            expected = hf_greedy(model.cpu(), prompt, 6)
            model.to(DEVICE)
            assert [c.token_ids for c in group] == [expected, expected]
        model.cpu()


BACKEND = triton_attention.TRITON_BACKEND


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctas", [1, 32])
def test_gather_host_rows_reads_one_layer_of_rows_from_pinned_chunks(dtype, ctas, monkeypatch):
    """`triton_ops.gather_host_rows` (the update's read of the engine's records,
    `engine.records`): rows spread over three host chunks, read by the device straight from
    pinned memory, in any order, one layer's slice each; row 0 of the first chunk is zeros; one
    CTA looping over the row blocks, or several."""
    generator = torch.Generator().manual_seed(5)
    chunk_rows, layers, E = 5, 3, 896
    pin = DEVICE.type == "cuda"
    chunks = [
        torch.randn(chunk_rows, layers, E, generator=generator).to(dtype).pin_memory()
        if pin
        else torch.randn(chunk_rows, layers, E, generator=generator).to(dtype)
        for _ in range(3)
    ]
    chunks[0][0].zero_()
    table = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([7, 0, 14, 3, 3, 11, 5], dtype=torch.int64)
    whole = torch.cat(chunks)
    monkeypatch.setattr(triton_ops, "GATHER_CTAS", ctas)  # 1: a CTA loops over row blocks
    for layer in range(layers):
        out = torch.full((len(rows), E), 9.0, dtype=dtype, device=DEVICE)
        triton_ops.gather_host_rows(table, rows.to(DEVICE), chunk_rows, (layers, E), layer, out)
        torch.testing.assert_close(out.cpu(), whole[rows, layer], atol=0, rtol=0)


@runs_here
def test_decode_rows_slots_and_advance_kernels_match_the_host_rows():
    """A sampling decode graph's two row kernels against `graph_rows`: `row_slots` gives every
    live row the slot `decode_rows` gives it (from its position and page table) and keeps the
    padding's -1; `advance_rows_on_device` puts the sampled ids in and moves each live row's
    position, context length and output position one on, padding rows unchanged."""
    import numpy as np

    from reinforge.engine.base import SamplingParams
    from reinforge.engine.block_manager import BlockManager
    from reinforge.engine.graph_rows import (
        CONTEXT_LENS,
        IDS,
        NUM_ROW_FIELDS,
        OUTPUT_POSITIONS,
        PAD_ROW,
        POSITIONS,
        SEEDS,
        SLOTS,
        decode_rows,
    )
    from reinforge.engine.sequence import Sequence

    block_size, width, bucket = 4, 8, 320  # more rows than one block of the kernels
    manager = BlockManager(4096, block_size)
    rng = np.random.default_rng(0)
    seqs = []
    for k in range(300):
        seq = Sequence(list(range(1, 2 + int(rng.integers(0, 9)))), SamplingParams(), seq_id=k)
        seq.output_ids = [7] * int(rng.integers(0, 12))
        manager.allocate(seq)
        seqs.append(seq)
    host = np.empty((NUM_ROW_FIELDS, bucket), dtype=np.int64)
    decode_rows(seqs, block_size, host)
    host[:, len(seqs) :] = np.array(PAD_ROW)[:, None]
    tables = torch.zeros((bucket, width), dtype=torch.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
    rows = torch.from_numpy(host.copy()).to(DEVICE)
    rows[SLOTS, : len(seqs)] = 0  # any valid slot: the kernel recomputes it
    triton_ops.row_slots(rows, tables.to(DEVICE), bucket, block_size, (POSITIONS, SLOTS))
    assert rows.cpu().numpy().tolist() == host.tolist()

    ids = torch.arange(1000, 1000 + bucket, dtype=torch.long, device=DEVICE)
    fields = (IDS, SLOTS, POSITIONS, CONTEXT_LENS, OUTPUT_POSITIONS)
    triton_ops.advance_rows_on_device(rows, ids, bucket, fields)
    got = rows.cpu().numpy()
    live = host[SLOTS] >= 0
    assert live.sum() == len(seqs)
    np.testing.assert_array_equal(got[IDS], ids.cpu().numpy())
    for field in (POSITIONS, CONTEXT_LENS, OUTPUT_POSITIONS):
        np.testing.assert_array_equal(got[field], host[field] + live)
    np.testing.assert_array_equal(got[SEEDS], host[SEEDS])
    np.testing.assert_array_equal(got[SLOTS], host[SLOTS])
