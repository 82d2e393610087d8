"""The on-device samplers of the CUDA path (Triton): one token per row of logits and its logprob,
drawn by keys, so a sequence samples the same tokens whatever batch it runs in.

`sample_gumbel` draws each row's token as argmax(logits / T + Gumbel noise): exact sampling from
softmax(logits / T) in one pass over the vocabulary, with no sort and no probability tensor; the
same pass accumulates the log-sum-exp, so the sampled token's logprob under the temperature comes
with it. The noise is Philox keyed by (row seed, output position, vocabulary index), four draws
per Philox call (the cipher dominated the kernel's time with one): a sequence's draws depend on
its seed and position only, not on the batch it ran in. The engine takes it for greedy decoding
(its argmax) only.

`sample_inverse_cdf` is the engine's sampler at a temperature: each row's token is where its
cumulative distribution reaches one uniform keyed by (row seed, output position), the draw the
torch sampler (`sampling.sample_keyed`) makes, so both paths sample the same tokens. It needs one
exp per logit and no random bits per logit: E1's eager decode step spent 0.150 ms of 1.53 in the
Gumbel sampler (H100, session 22), whose Philox cipher and two logarithms per logit bound it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _gumbel_lanes(
    logits_row,
    first,  # vocabulary index of the block's first entry
    local,  # arange over the block
    bits,  # uint32 random bits, one per entry
    V,
    inv_t,
    m,  # per-lane running max of x
    s,  # per-lane running sum of exp2(x - m)
    best,  # per-lane best Gumbel score
    best_x,  # x at it
    best_idx,  # its vocabulary index
    GREEDY: tl.constexpr,
):
    """Fold one block into per-lane running state, elementwise: no cross-thread reduction (and
    no barrier) inside the vocabulary loop. Base 2 throughout (x = logits / T * log2(e)): exp2
    and log2 are single instructions."""
    offs = first + local
    mask = offs < V
    x = tl.load(logits_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
    m_new = tl.maximum(m, x)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only padding
    s = s * tl.exp2(m - m_safe) + tl.exp2(x - m_safe)
    if GREEDY:
        score = x
    else:
        # Gumbel noise -ln(E), E = -ln(u) ~ Exp(1), scaled by log2(e) like x: -log2(E)
        u = tl.uint_to_uniform_float(bits)
        score = tl.where(mask, x - tl.log2(-tl.log2(u) * 0.6931471805599453), float("-inf"))
    take = score > best  # strictly: a lane keeps its earliest (lowest) index on ties
    best = tl.where(take, score, best)
    best_x = tl.where(take, x, best_x)
    best_idx = tl.where(take, offs, best_idx)
    return m_new, s, best, best_x, best_idx


@triton.jit
def _gumbel_partial_kernel(
    logits_ptr,  # [B, V]
    seeds_ptr,  # [B] int64 Philox key of each row
    positions_ptr,  # [B] int64 output position of each row (the counter's high word)
    part_ptr,  # [B, NUM_CHUNKS, 4] float32, base 2: max, sum-exp2, best score, logit at best
    part_idx_ptr,  # [B, NUM_CHUNKS] int64
    stride_l,
    V,
    inv_t,  # log2(e) / temperature
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,  # four sub-blocks of QUARTER: one Philox call gives 4 x 32 bits
    NUM_CHUNKS: tl.constexpr,
    GREEDY: tl.constexpr,
):
    QUARTER: tl.constexpr = BLOCK_V // 4
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row).to(tl.int64)
    logits_row = logits_ptr + row * stride_l
    m = tl.full([QUARTER], float("-inf"), tl.float32)
    s = tl.zeros([QUARTER], tl.float32)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_x = tl.zeros([QUARTER], tl.float32)
    best_idx = tl.full([QUARTER], -1, tl.int32)
    lo = chunk * CHUNK
    quarter = tl.arange(0, QUARTER)
    for start in range(lo, lo + CHUNK, BLOCK_V):
        # counter: (output position, index of the quarter-block entry); unique per draw
        counter = (position << 32) + (start // 4 + quarter).to(tl.int64)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        m, s, best, best_x, best_idx = _gumbel_lanes(
            logits_row, start, quarter, r0, V, inv_t, m, s, best, best_x, best_idx, GREEDY
        )
        first = start + QUARTER
        m, s, best, best_x, best_idx = _gumbel_lanes(
            logits_row, first, quarter, r1, V, inv_t, m, s, best, best_x, best_idx, GREEDY
        )
        first = start + 2 * QUARTER
        m, s, best, best_x, best_idx = _gumbel_lanes(
            logits_row, first, quarter, r2, V, inv_t, m, s, best, best_x, best_idx, GREEDY
        )
        first = start + 3 * QUARTER
        m, s, best, best_x, best_idx = _gumbel_lanes(
            logits_row, first, quarter, r3, V, inv_t, m, s, best, best_x, best_idx, GREEDY
        )
    # across lanes, once per chunk
    m_all = tl.max(m, 0)
    m_safe = tl.where(m == float("-inf"), m_all, m)
    s_all = tl.sum(s * tl.exp2(m_safe - m_all), 0)
    best_all = tl.max(best, 0)
    winner = tl.min(tl.where(best == best_all, best_idx, 2147483647), 0)  # lowest index on ties
    x_at = tl.max(tl.where(best_idx == winner, best_x, float("-inf")), 0)
    base = (row * NUM_CHUNKS + chunk) * 4
    tl.store(part_ptr + base, m_all)
    tl.store(part_ptr + base + 1, s_all)
    tl.store(part_ptr + base + 2, best_all)
    tl.store(part_ptr + base + 3, x_at)
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, winner.to(tl.int64))


@triton.jit
def _gumbel_combine_kernel(
    part_ptr,
    part_idx_ptr,
    ids_ptr,  # [B] int64
    logprobs_ptr,  # [B] float32
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < NUM_CHUNKS
    base = (row * NUM_CHUNKS + offs) * 4
    m = tl.load(part_ptr + base, mask=mask, other=float("-inf"))
    s = tl.load(part_ptr + base + 1, mask=mask, other=0.0)
    best = tl.load(part_ptr + base + 2, mask=mask, other=float("-inf"))
    best_x = tl.load(part_ptr + base + 3, mask=mask, other=0.0)
    idx = tl.load(part_idx_ptr + row * NUM_CHUNKS + offs, mask=mask, other=0)
    m_all = tl.max(m, 0)
    total = tl.sum(tl.where(mask, s * tl.exp2(m - m_all), 0.0), 0)
    lse2 = m_all + tl.log2(total)
    winner = tl.argmax(best, 0)
    chosen = offs == winner
    tl.store(ids_ptr + row, tl.sum(tl.where(chosen, idx, 0), 0))
    logprob2 = tl.sum(tl.where(chosen, best_x, 0.0), 0) - lse2
    tl.store(logprobs_ptr + row, logprob2 * 0.6931471805599453)  # base 2 to natural


@functools.lru_cache(maxsize=64)  # (called every decode step with the same sizes)
def _vocab_chunks(V: int, num_chunks: int) -> tuple[int, int, int]:
    """(block, chunk, count): a sampler's programs per row cover `count` chunks of `chunk`
    vocabulary entries (whole blocks of `block`), about `num_chunks` of them."""
    block = max(64, min(2048, triton.next_power_of_2(V)))
    chunk = triton.cdiv(triton.cdiv(V, num_chunks), block) * block
    return block, chunk, triton.cdiv(V, chunk)


def sample_gumbel(
    logits_BV: torch.Tensor,
    temperature: float,
    seeds_B: torch.Tensor,
    positions_B: torch.Tensor,
    ids_out: torch.Tensor | None = None,
    logprobs_out: torch.Tensor | None = None,
    num_chunks: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_B, logprobs_B): a draw from softmax(logits / T) (argmax when T == 0) and its logprob
    under log_softmax(logits / T) (under log_softmax(logits) when T == 0)."""
    B, V = logits_BV.shape
    assert logits_BV.stride(-1) == 1
    device = logits_BV.device
    ids = ids_out if ids_out is not None else torch.empty(B, dtype=torch.long, device=device)
    lps = logprobs_out if logprobs_out is not None else torch.empty(B, device=device)
    if B == 0:
        return ids, lps
    BLOCK_V, chunk, num_chunks = _vocab_chunks(V, num_chunks)
    part = torch.empty((B, num_chunks, 4), dtype=torch.float32, device=device)
    part_idx = torch.empty((B, num_chunks), dtype=torch.long, device=device)
    greedy = temperature == 0.0
    _gumbel_partial_kernel[(B, num_chunks)](
        logits_BV,
        seeds_B,
        positions_B,
        part,
        part_idx,
        logits_BV.stride(0),
        V,
        LOG2E if greedy else LOG2E / temperature,
        CHUNK=chunk,
        BLOCK_V=BLOCK_V,
        NUM_CHUNKS=num_chunks,
        GREEDY=greedy,
        num_warps=4,
    )
    _gumbel_combine_kernel[(B,)](
        part,
        part_idx,
        ids,
        lps,
        NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        num_warps=1,
    )
    return ids, lps


# ---------------------------------------------------------------------------------------------
# Sampling by inverting each row's cumulative distribution at one keyed uniform


@triton.jit
def _row_uniform(seed, position):
    """`sampling.row_uniform` on the device, bit for bit: splitmix64 of (key, position + 1), 53
    bits, in (0, 1), as float64."""
    z = seed.to(tl.uint64) * 0x9E3779B97F4A7C15 + (position + 1).to(tl.uint64) * 0xD1B54A32D192ED03
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return ((z >> 11).to(tl.float64) + 0.5) / 9007199254740992.0


@triton.jit
def _icdf_partial_kernel(
    logits_ptr,  # [B, V]
    part_ptr,  # [B, NUM_CHUNKS, 3] float32, base 2: chunk max m, sum of exp2(x - m), and (STATS)
    # the sum of exp2(x - m) * (x - m), for the row's entropy
    stride_l,
    V,
    inv_t,  # log2(e) / temperature
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    STATS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    logits_row = logits_ptr + row * stride_l
    lanes = tl.arange(0, BLOCK_V)
    m = -float("inf")  # the chunk's running max so far (a scalar: one exp2 per element)
    s = tl.zeros([BLOCK_V], tl.float32)
    t = tl.zeros([BLOCK_V], tl.float32)
    lo = chunk * CHUNK
    for start in range(lo, lo + CHUNK, BLOCK_V):
        offs = start + lanes
        x = tl.load(logits_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of padding only
        alpha = tl.exp2(m - m_safe)
        e = tl.exp2(x - m_safe)
        if STATS:  # sum e * (x - m), moved to the new max: alpha * (t + (m_old - m_new) * s)
            shift = tl.where(m == float("-inf"), 0.0, m - m_safe)
            t = alpha * (t + shift * s) + tl.where(e > 0.0, e * (x - m_safe), 0.0)
        s = s * alpha + e
        m = m_new
    base = (row * NUM_CHUNKS + chunk) * 3
    tl.store(part_ptr + base, m)
    tl.store(part_ptr + base + 1, tl.sum(s, 0))
    if STATS:
        tl.store(part_ptr + base + 2, tl.sum(t, 0))


@triton.jit
def _icdf_pick_kernel(
    logits_ptr,
    part_ptr,
    seeds_ptr,  # [B] int64 key of each row (`Sequence.sample_seed`)
    positions_ptr,  # [B] int64 output position of each row
    ids_ptr,  # [B] int64
    logprobs_ptr,  # [B] float32
    stats_ptr,  # [B, 2] float32 (STATS): the row's log-sum-exp and entropy, natural units
    stride_l,
    V,
    inv_t,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    STATS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_l
    chunks = tl.arange(0, CHUNKS_PAD)
    inside = chunks < NUM_CHUNKS
    m_c = tl.load(part_ptr + (row * NUM_CHUNKS + chunks) * 3, mask=inside, other=float("-inf"))
    s_c = tl.load(part_ptr + (row * NUM_CHUNKS + chunks) * 3 + 1, mask=inside, other=0.0)
    top = tl.max(m_c, 0)
    mass = tl.where(inside & (s_c > 0), s_c * tl.exp2(m_c - top), 0.0).to(tl.float64)
    total = tl.sum(mass, 0)
    if STATS:
        # H = ln 2 * (log2(total) - sum p * (x - top)): two non-negative terms, no cancellation
        t_c = tl.load(part_ptr + (row * NUM_CHUNKS + chunks) * 3 + 2, mask=inside, other=0.0)
        shift = tl.where(inside & (s_c > 0), m_c - top, 0.0)
        scale = tl.where(inside & (s_c > 0), tl.exp2(m_c - top), 0.0)
        moment = tl.sum((scale * (t_c + shift * s_c)).to(tl.float64), 0)
        log2_total = tl.log2(total.to(tl.float32))
        entropy2 = log2_total - (moment / total).to(tl.float32)
        tl.store(stats_ptr + row * 2, (top + log2_total) * 0.6931471805599453)
        tl.store(stats_ptr + row * 2 + 1, entropy2 * 0.6931471805599453)
    cum = tl.cumsum(mass, 0)
    target = _row_uniform(tl.load(seeds_ptr + row), tl.load(positions_ptr + row)) * total
    # the first chunk whose cumulative mass reaches the target (the last with mass when rounding
    # leaves the target above the sum)
    last_chunk = tl.max(tl.where(mass > 0, chunks, 0), 0)
    chunk = tl.min(tl.where((cum >= target) & (mass > 0), chunks, last_chunk), 0)
    rest = target - tl.sum(tl.where(chunks < chunk, mass, 0.0), 0)
    # within it, the first token whose cumulative mass reaches the rest (never one of mass 0)
    lanes = tl.arange(0, BLOCK_V)
    acc = tl.zeros([1], tl.float64)
    found = tl.full([1], V, tl.int64)
    last = tl.full([1], -1, tl.int64)
    lo = chunk.to(tl.int64) * CHUNK
    for start in range(lo, lo + CHUNK, BLOCK_V):
        offs = start + lanes
        x = tl.load(logits_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        e = tl.exp2(x - top).to(tl.float64)
        cum_e = tl.cumsum(e, 0) + tl.sum(acc, 0)
        positive = e > 0
        hit = tl.min(tl.where(positive & (cum_e >= rest), offs, V), 0)
        found = tl.minimum(found, hit)
        last = tl.maximum(last, tl.max(tl.where(positive, offs, -1), 0))
        acc += tl.sum(e, 0)
    # a row with no positive mass (NaN logits) still gets an id in range; its logprob is NaN,
    # which the trainer's non-finite checks report
    token = tl.maximum(tl.sum(tl.where(found < V, found, last), 0), 0)
    x_token = tl.load(logits_row + token).to(tl.float32) * inv_t
    tl.store(ids_ptr + row, token)
    logprob2 = x_token - top - tl.log2(total.to(tl.float32))
    tl.store(logprobs_ptr + row, logprob2 * 0.6931471805599453)  # base 2 to natural


def sample_inverse_cdf(
    logits_BV: torch.Tensor,
    temperature: float,
    seeds_B: torch.Tensor,
    positions_B: torch.Tensor,
    num_chunks: int = 16,
    stats_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_B, logprobs_B): row b's token is the first whose cumulative probability under
    softmax(logits / T) reaches u * total, u = `sampling.row_uniform(seeds_B[b], positions_B[b])`
    (computed here, bit for bit): the draw `sampling.sample_keyed` makes on any device, so the
    CPU and CUDA paths sample the same tokens but where u falls within rounding of a boundary.
    Two passes: per (row, chunk) the max and the sum of exp (every logit read once, one exp
    each), then per row the chunk the draw falls in, read again and scanned. Against
    `sample_gumbel` it needs no random bits per logit (the Philox cipher and two logarithms per
    logit were its cost). Temperature > 0 only. `stats_out` ([B, 2] float32): each row's
    log-sum-exp and entropy of softmax(logits / T) written there too (`sampling.row_stats`; the
    first pass sums one more product per logit)."""
    assert temperature > 0.0, "greedy decoding takes sample_gumbel's argmax"
    B, V = logits_BV.shape
    assert logits_BV.stride(-1) == 1
    device = logits_BV.device
    ids = torch.empty(B, dtype=torch.long, device=device)
    lps = torch.empty(B, device=device)
    if B == 0:
        return ids, lps
    stats = stats_out is not None
    if stats:
        assert stats_out.shape == (B, 2) and stats_out.dtype == torch.float32
        assert stats_out.is_contiguous()
    BLOCK_V, chunk, num_chunks = _vocab_chunks(V, num_chunks)
    part = torch.empty((B, num_chunks, 3), dtype=torch.float32, device=device)
    inv_t = LOG2E / temperature
    common = dict(CHUNK=chunk, BLOCK_V=BLOCK_V, NUM_CHUNKS=num_chunks, STATS=stats)
    _icdf_partial_kernel[(B, num_chunks)](
        logits_BV, part, logits_BV.stride(0), V, inv_t, **common, num_warps=4
    )
    _icdf_pick_kernel[(B,)](
        logits_BV,
        part,
        seeds_B,
        positions_B,
        ids,
        lps,
        stats_out if stats else lps,
        logits_BV.stride(0),
        V,
        inv_t,
        **common,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        num_warps=4,
    )
    return ids, lps
