"""Packing: bin assignment, the packed layout, and packed == padded on the micro model (values,
gradients, and gradient accumulation under every loss aggregation)."""

from __future__ import annotations

import random

import pytest
import torch

from reinforge.algorithms.losses import AGGREGATIONS, LossInputs, PPOClipSettings, ppo_clip_loss
from reinforge.errors import ConfigError
from reinforge.models.tiny import builtin_path
from reinforge.train.packing import PackSequence, pack, unpack
from reinforge.train.packing.attention import (
    VARLEN,
    VARLEN_PADDED,
    VARLEN_REFERENCE,
    padded_varlen_kernel,
    plain_segments,
    reference_varlen_kernel,
    segment_mask,
    select_packed_attention,
)
from reinforge.train.packing.forward import batch_segments, packed_logprobs
from reinforge.train.packing.plan import plan_micro_batches, plan_shared_micro_batches
from tests.padded_reference import pad_batch, token_logprobs

TEMPERATURE = 0.7


def load_micro(attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        builtin_path("micro", 0), dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.train()  # dropout-free model: train mode only matters for grad paths
    return model


def random_sequences(num: int, seed: int = 0, with_mask: bool = True) -> list[PackSequence]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(num):
        num_prompt = int(torch.randint(2, 12, (1,), generator=gen))
        num_completion = int(torch.randint(1, 14, (1,), generator=gen))
        mask = [1.0] * num_completion
        if with_mask and i % 3 == 1 and num_completion > 2:
            mask[1] = 0.0  # an environment token inside a multi-turn completion
        seqs.append(
            PackSequence(
                prompt_ids=torch.randint(3, 300, (num_prompt,), generator=gen).tolist(),
                completion_ids=torch.randint(3, 300, (num_completion,), generator=gen).tolist(),
                loss_mask=mask,
                token_values={
                    # near the random-init model's own (about -ln 320), so the PPO clip is
                    # active on some tokens and not on others
                    "sampler_logprobs": (
                        -5.77 + 0.3 * torch.randn(num_completion, generator=gen)
                    ).tolist()
                },
                seq_values={"advantage": float(torch.randn(1, generator=gen))},
            )
        )
    return seqs


def grouped_sequences(groups: int, per_group: int, seed: int = 0) -> list[PackSequence]:
    """GRPO-like: `groups` prompts with `per_group` completions each (one group's members apart
    in the list, as after a shuffle), plus two sequences of their own."""
    singles = random_sequences(groups + 2, seed=seed)
    seqs = [
        PackSequence(
            singles[g].prompt_ids,
            other.completion_ids,
            other.loss_mask,
            other.token_values,
            other.seq_values,
        )
        for m in range(per_group)
        for g, other in enumerate(random_sequences(groups, seed=seed * 100 + m + 1))
    ]
    return [*seqs, *singles[groups:]]


def padded_reference(model, seqs: list[PackSequence]):
    """The existing path: pad_batch + token_logprobs, plus the loss mask and sampler logprobs in
    its [B, L-1] layout."""
    batch = pad_batch(
        [list(s.prompt_ids) for s in seqs], [list(s.completion_ids) for s in seqs], 0, "cpu"
    )
    logprobs_BT, entropy_BT = token_logprobs(model, batch, TEMPERATURE, with_entropy=True)
    mask_BT = torch.zeros_like(batch.mask_BT)
    sampler_BT = torch.zeros_like(batch.mask_BT)
    for b, s in enumerate(seqs):
        start, end = len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.completion_ids)
        mask_BT[b, start:end] = torch.tensor(s.loss_mask)
        sampler_BT[b, start:end] = torch.tensor(s.token_values["sampler_logprobs"])
    return logprobs_BT, entropy_BT, mask_BT, sampler_BT


def completion_slice(x_BT: torch.Tensor, seqs, i: int) -> torch.Tensor:
    start = len(seqs[i].prompt_ids) - 1
    return x_BT[i, start : start + len(seqs[i].completion_ids)]


# ---------------------------------------------------------------------------------------------
# Assignment


def test_plan_respects_budget_uses_minimal_count_and_balances():
    lengths = [9, 8, 7, 6, 5, 4, 3, 2]
    bins = plan_micro_batches(lengths, max_tokens=16)
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(bins) == 3  # ceil(44 / 16): the lower bound
    assert loads == [13, 15, 16]
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(b == sorted(b) for b in bins)


def test_plan_random_lengths_never_worse_than_first_fit_decreasing():
    from reinforge.train.packing.plan import _first_fit_decreasing

    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        lengths = torch.randint(
            1, 200, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen
        ).tolist()
        bins = plan_micro_batches(lengths, max_tokens=256)
        loads = [sum(lengths[i] for i in b) for b in bins]
        assert max(loads) <= 256
        assert len(bins) <= len(_first_fit_decreasing(lengths, 256))
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))


def test_plan_min_micro_batches_and_empty():
    assert plan_micro_batches([], 10) == []
    assert len(plan_micro_batches([3, 3, 3, 3], 100, min_micro_batches=2)) == 2
    assert len(plan_micro_batches([3, 3], 100, min_micro_batches=5)) == 2  # one sequence each


def test_shared_plan_keeps_a_group_together_and_counts_its_prompt_once():
    prompts = [[1] * 10, [2] * 10, [1] * 10, [2] * 10, [1] * 10, [3] * 4]
    completions = [5, 5, 5, 5, 5, 20]
    bins = plan_shared_micro_batches(prompts, completions, max_tokens=34)
    assert sorted(map(tuple, bins)) == [(0, 2, 4), (1, 3), (5,)]  # group 1: 10 + 3 * 5 tokens
    # a group that cannot fit one micro-batch is split, each part carrying the prompt
    bins = plan_shared_micro_batches(prompts, completions, max_tokens=24)
    group_1 = [b for b in bins if 0 in b or 2 in b or 4 in b]
    assert len(group_1) == 2 and sorted(i for b in group_1 for i in b) == [0, 2, 4]
    # without sharing: the sequences one by one
    lengths = [len(p) + c for p, c in zip(prompts, completions)]
    assert plan_shared_micro_batches(prompts, completions, 40, share_prompts=False) == (
        plan_micro_batches(lengths, 40)
    )


def test_large_groups_are_split_to_fill_micro_batches():
    """G1's shape: 32 prompts of 128 tokens x 8 samples of 512 in 16,384-token micro-batches.
    Whole groups (4,224 tokens) fit three to a micro-batch: 11. Split to fill: 9, the fewest
    their tokens allow, each part carrying its prompt; every micro-batch within the budget, and
    of about equal size."""
    prompts = [[p] * 128 for p in range(32) for _ in range(8)]
    bins = plan_shared_micro_batches(prompts, [512] * 256, max_tokens=16_384)
    assert len(bins) == 9
    assert sorted(i for b in bins for i in b) == list(range(256))
    sizes = [128 * len({prompts[i][0] for i in b}) + 512 * len(b) for b in bins]
    assert max(sizes) <= 16_384
    # about equal, not eight full ones and a small ninth (a CUDA graph replays similar sizes)
    assert min(sizes) >= 0.9 * max(sizes), sizes
    unshared = plan_shared_micro_batches(prompts, [512] * 256, 16_384, share_prompts=False)
    assert len(unshared) == 11  # 25 whole sequences of 640 tokens each


@pytest.mark.parametrize("budget", [8_192, 10_240, 11_264, 12_288])
def test_split_groups_are_spread_evenly_when_the_sequences_do_not_divide_the_count(budget):
    """At 10,240 tokens G1's 256 completions need 14 micro-batches; next fit at the smallest
    budget that gives 14 filled 13 with 19 completions and left 9 for the last (6,912 tokens:
    under the kept graph's 70%, so it ran launched, its activations beside the graph's pool,
    +0.12 s and +0.44 GiB on an H100). Each micro-batch now takes its share of what is left."""
    prompts = [[p] * 128 for p in range(32) for _ in range(8)]
    bins = plan_shared_micro_batches(prompts, [512] * 256, max_tokens=budget)
    sizes = [128 * len({prompts[i][0] for i in b}) + 512 * len(b) for b in bins]
    assert sorted(i for b in bins for i in b) == list(range(256))
    assert max(sizes) <= budget
    assert len(bins) == {8_192: 18, 10_240: 14, 11_264: 13, 12_288: 12}[budget]  # no more
    assert min(sizes) >= 0.9 * max(sizes), sizes


def test_spread_micro_batches_stay_within_the_budget_on_random_groups():
    rng = random.Random(0)
    for _ in range(300):
        prompts, completions = [], []
        for group in range(rng.randint(1, 30)):
            prompt_len = rng.randint(1, 300)
            for _ in range(rng.randint(1, 12)):
                prompts.append([group] * prompt_len)
                completions.append(rng.randint(1, 1500))
        longest = max(len(p) + c for p, c in zip(prompts, completions))
        budget = rng.randint(longest, 20_000)
        bins = plan_shared_micro_batches(prompts, completions, max_tokens=budget)
        assert sorted(i for b in bins for i in b) == list(range(len(completions)))
        for b in bins:
            size = sum(completions[i] for i in b) + sum(
                len(p) for p in {tuple(prompts[i]) for i in b}
            )
            assert size <= budget


def test_sequence_longer_than_budget_names_the_setting():
    with pytest.raises(ConfigError, match=r"train\.micro_batch_tokens = 10 .* >= 12"):
        plan_micro_batches([5, 12], max_tokens=10)


# ---------------------------------------------------------------------------------------------
# Layout


def test_layout_positions_boundaries_targets_and_extras():
    seqs = [
        PackSequence(
            [10, 11, 12], [20, 21], token_values={"v": [0.5, 0.25]}, seq_values={"a": 1.0}
        ),
        PackSequence(
            [30],
            [40, 41, 42],
            loss_mask=[1, 0, 1],
            token_values={"v": [1, 2, 3]},
            seq_values={"a": -2.0},
        ),
    ]
    [batch] = pack(seqs, max_tokens=100)
    assert batch.input_ids_L.tolist() == [10, 11, 12, 20, 21, 30, 40, 41, 42]
    assert batch.position_ids_L.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert batch.cu_segments_G1.tolist() == [0, 5, 9]
    assert batch.cu_segments_G1.dtype == torch.int32
    assert batch.max_segment == batch.max_keys == 5
    assert batch.key_index_J is None  # no prompt shared: each segment's keys are its own tokens
    # token 20 is predicted from position 2 (token 12); token 40 from position 5 (token 30)
    assert batch.target_positions_K.tolist() == [2, 3, 5, 6, 7]
    assert batch.targets_K.tolist() == [20, 21, 40, 41, 42]
    assert batch.mask_K.tolist() == [1, 1, 1, 0, 1]
    assert batch.values_K["v"].tolist() == [0.5, 0.25, 1, 2, 3]
    assert batch.seq_values_S["a"].tolist() == [1.0, -2.0]
    assert batch.rows(batch.values_K["v"]).tolist() == [[0.5, 0.25, 0], [1, 2, 3]]
    assert batch.mask_ST.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert [x.tolist() for x in unpack(batch.values_K["v"], batch)] == [[0.5, 0.25], [1, 2, 3]]


def test_shared_prompt_layout_targets_keys_and_mask():
    seqs = [
        PackSequence([10, 11], [20, 21]),
        PackSequence([5], [6, 7]),
        PackSequence([10, 11], [30]),
        PackSequence([10, 11], []),  # an empty completion: nothing to predict, no segment
    ]
    [batch] = pack(seqs, max_tokens=100)
    # the shared prompt once, then each completion; positions continue the prompt's
    assert batch.input_ids_L.tolist() == [10, 11, 20, 21, 30, 5, 6, 7]
    assert batch.position_ids_L.tolist() == [0, 1, 2, 3, 2, 0, 1, 2]
    assert batch.cu_segments_G1.tolist() == [0, 2, 4, 5, 8]
    assert batch.key_index_J.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 7]
    assert batch.cu_keys_G1.tolist() == [0, 2, 6, 9, 12]
    assert (batch.max_segment, batch.max_keys) == (3, 4)
    # each row position's first entry in the key stream, and the entries repeating one
    assert batch.key_first_L.tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    assert batch.key_extra_E.tolist() == [2, 3, 6, 7]
    # K layout in the given order: the first token of 20 21 and of 30 comes from position 1
    assert batch.target_positions_K.tolist() == [1, 2, 5, 6, 1]
    assert batch.targets_K.tolist() == [20, 21, 6, 7, 30]
    assert batch.num_completion_tokens == (2, 2, 1, 0)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(segment_mask(batch_segments(batch), 8, "cpu"), expected)
    [unshared] = pack(seqs, max_tokens=100, share_prompts=False)
    assert unshared.key_index_J is None and unshared.num_tokens == 12
    assert unshared.targets_K.tolist() == [20, 21, 6, 7, 30]


def test_block_causal_mask():
    mask = segment_mask(plain_segments(torch.tensor([0, 2, 5], dtype=torch.int32)), 5, "cpu")
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


# ---------------------------------------------------------------------------------------------
# Packed == padded on the micro model


@pytest.mark.parametrize("attention", ["sdpa", "eager", "reference", "padded"])
def test_packed_matches_padded_values_and_gradients(attention):
    seqs = random_sequences(6, seed=1)
    weights = [
        torch.randn(len(s.completion_ids), generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(seqs)
    ]

    padded = load_micro()
    logprobs_BT, entropy_BT, _, _ = padded_reference(padded, seqs)
    loss = sum((completion_slice(logprobs_BT, seqs, i) * w).sum() for i, w in enumerate(weights))
    loss.backward()

    packed = load_micro("eager" if attention == "eager" else "sdpa")
    if attention in ("reference", "padded"):
        name = {"reference": VARLEN_REFERENCE, "padded": VARLEN_PADDED}[attention]
        assert select_packed_attention(packed, attention) == name
    batches = pack(seqs, max_tokens=48)
    assert len(batches) >= 2
    total = 0.0
    for batch in batches:
        _, logprobs_K, entropy_K = packed_logprobs(packed, batch, TEMPERATURE, chunk_size=5)
        for (i, lp), ent in zip(
            zip(batch.indices, unpack(logprobs_K, batch)), unpack(entropy_K, batch)
        ):
            torch.testing.assert_close(
                lp, completion_slice(logprobs_BT, seqs, i), atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                ent, completion_slice(entropy_BT, seqs, i), atol=1e-5, rtol=1e-5
            )
            total = total + (lp * weights[i]).sum()
    total.backward()
    for (name, p_ref), p in zip(padded.named_parameters(), packed.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "reference", "padded"])
def test_shared_prompts_give_each_sequence_its_own_values_and_gradients(attention):
    """A group's prompt runs once for all its completions: logprobs, entropies and the
    gradients of any weighted sum equal those of the sequences run one by one."""
    seqs = grouped_sequences(groups=3, per_group=4, seed=7)
    weights = [
        torch.randn(len(s.completion_ids), generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(seqs)
    ]
    separate = load_micro()
    logprobs_BT, entropy_BT, _, _ = padded_reference(separate, seqs)
    sum(
        (completion_slice(logprobs_BT, seqs, i) * w).sum() for i, w in enumerate(weights)
    ).backward()

    shared = load_micro("eager" if attention == "eager" else "sdpa")
    if attention in ("reference", "padded"):
        select_packed_attention(shared, attention)
    batches = pack(seqs, max_tokens=60)
    assert len(batches) >= 2 and all(b.num_tokens <= 60 for b in batches)
    assert sum(b.num_tokens for b in batches) < sum(s.num_tokens for s in seqs) - 2 * 3 * 3
    assert all(b.key_index_J is not None for b in batches)
    total = 0.0
    for batch in batches:
        _, logprobs_K, entropy_K = packed_logprobs(shared, batch, TEMPERATURE, chunk_size=5)
        for i, lp, ent in zip(batch.indices, unpack(logprobs_K, batch), unpack(entropy_K, batch)):
            expected = completion_slice(logprobs_BT, seqs, i)
            torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)
            expected = completion_slice(entropy_BT, seqs, i)
            torch.testing.assert_close(ent, expected, atol=1e-5, rtol=1e-5)
            total = total + (lp * weights[i]).sum()
    total.backward()
    for (name, p_ref), p in zip(separate.named_parameters(), shared.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_without_the_mask_sequences_would_see_each_other():
    """The comparison above is sensitive: with the same restarting positions but a plain causal
    mask (an all-ones 2D mask stops transformers from inferring boundaries), later sequences
    attend to earlier ones and their logprobs change; the first sequence's do not."""
    seqs = random_sequences(3, seed=2)
    model = load_micro()
    [batch] = pack(seqs, max_tokens=100)
    with torch.no_grad():
        _, isolated_K, _ = packed_logprobs(model, batch, TEMPERATURE)
        logits = model(
            batch.input_ids_L[None],
            attention_mask=torch.ones(1, batch.num_tokens, dtype=torch.long),
            position_ids=batch.position_ids_L[None],
        ).logits[0]
    leaked = torch.log_softmax(logits.float() / TEMPERATURE, -1)[batch.target_positions_K]
    leaked_K = leaked.gather(1, batch.targets_K[:, None])[:, 0]
    first = batch.num_completion_tokens[0]
    torch.testing.assert_close(leaked_K[:first], isolated_K[:first], atol=1e-5, rtol=1e-5)
    assert (leaked_K[first:] - isolated_K[first:]).abs().max() > 1e-3


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_gradient_accumulation_over_packed_micro_batches_equals_one_batch(aggregation):
    seqs = random_sequences(8, seed=4)
    settings = PPOClipSettings(clip_low=0.2, clip_high=0.28, aggregation=aggregation)
    num_tokens = float(sum(sum(s.loss_mask) for s in seqs))
    num_seqs = float(len(seqs))

    whole = load_micro()
    logprobs_BT, _, mask_BT, sampler_BT = padded_reference(whole, seqs)
    loss_whole, metrics = ppo_clip_loss(
        LossInputs(
            logprobs_BT=logprobs_BT,
            old_logprobs_BT=sampler_BT,
            advantages_B=torch.tensor([s.seq_values["advantage"] for s in seqs]),
            mask_BT=mask_BT,
            num_tokens_total=num_tokens,
            num_seqs_total=num_seqs,
            token_sum_norm=16.0,
        ),
        settings,
    )
    loss_whole.backward()
    assert 0.05 < float(metrics["clip_frac"]) < 0.95

    accumulated = load_micro()
    batches = pack(seqs, max_tokens=40)
    assert len(batches) >= 3
    loss_sum = 0.0
    for batch in batches:
        _, logprobs_K, _ = packed_logprobs(accumulated, batch, TEMPERATURE)
        loss, _ = ppo_clip_loss(
            LossInputs(
                logprobs_BT=batch.rows(logprobs_K),
                old_logprobs_BT=batch.rows(batch.values_K["sampler_logprobs"]),
                advantages_B=batch.seq_values_S["advantage"],
                mask_BT=batch.mask_ST,
                num_tokens_total=num_tokens,
                num_seqs_total=num_seqs,
                token_sum_norm=16.0,
            ),
            settings,
        )
        loss.backward()
        loss_sum += float(loss.detach())
    # relative too: token_sum's loss is unnormalised (about 5 here), float32 sums differ by ulps
    assert loss_sum == pytest.approx(float(loss_whole.detach()), abs=1e-6, rel=1e-6)
    for (name, p_ref), p in zip(whole.named_parameters(), accumulated.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_unsupported_attention_implementation_is_a_config_error():
    model = load_micro()
    model.config._attn_implementation_internal = "flex_attention"
    [batch] = pack(random_sequences(2), max_tokens=100)
    with pytest.raises(ConfigError, match="attn_implementation='sdpa'"):
        packed_logprobs(model, batch)


def test_auto_picks_padded_varlen_on_cpu_and_an_eager_model_keeps_its_mask():
    assert select_packed_attention(load_micro(), "auto") == VARLEN_PADDED
    assert select_packed_attention(load_micro("eager"), "auto") == "eager"
    model = load_micro()
    select_packed_attention(model, "auto")
    assert select_packed_attention(model, "mask") == "sdpa"


@pytest.mark.parametrize(
    "lengths",
    [
        [5, 1, 9, 3, 9, 2],  # padded rows: S*T^2 = 486 <= L^2 = 841
        [40, 1, 2, 1, 3, 1, 2, 1],  # one long sequence: padding would cost more, the mask is used
        [7],
    ],
)
def test_padded_kernel_matches_the_per_sequence_reference_with_grouped_heads(lengths):
    gen = torch.Generator().manual_seed(len(lengths))
    length = sum(lengths)
    cu_S1 = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = [torch.randn(length, heads, 8, generator=gen) for heads in (4, 2, 2)]
    results = []
    for kernel in (padded_varlen_kernel, reference_varlen_kernel):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        out = kernel(q, k, v, plain_segments(cu_S1), 0.3)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert results[0][0].shape == (length, 4, 8)
    for padded, reference in zip(*results):
        torch.testing.assert_close(padded, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("long_single", [False, True])
def test_padded_kernel_matches_the_reference_with_shared_prompts(long_single):
    """Shared-prompt segments (more keys than queries), padded rows or, with one long sequence
    beside many short segments, the dense mask over the key stream."""
    seqs = grouped_sequences(groups=2, per_group=3, seed=11)
    if long_single:
        seqs = [PackSequence(s.prompt_ids, s.completion_ids) for s in seqs]
        seqs.append(PackSequence(list(range(3, 60)), list(range(3, 40))))
    [batch] = pack(seqs, max_tokens=1000)
    seg = batch_segments(batch)
    length = batch.num_tokens
    dense = seg.num_segments * seg.max_q * seg.max_k > length * seg.key_index_J.numel()
    assert dense == long_single
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(length, heads, 8, generator=gen) for heads in (4, 2, 2)]
    results = []
    for kernel in (padded_varlen_kernel, reference_varlen_kernel):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        out = kernel(q, k, v, seg, 0.3)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for padded, reference in zip(*results):
        torch.testing.assert_close(padded, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_varlen_kernel_matches_reference_on_cuda(shared):
    """torch's flash varlen against the per-segment reference; with shared prompts a segment has
    more keys than queries, and the causal diagonal must sit at the last key."""
    from reinforge.engine.varlen import torch_varlen_attn

    if torch_varlen_attn() is None:
        pytest.skip("torch has no torch.nn.attention.varlen")
    seqs = grouped_sequences(groups=3, per_group=4, seed=5) if shared else random_sequences(6, 5)
    [batch] = pack(seqs, max_tokens=1000)
    assert (batch.key_index_J is not None) == shared
    batch = batch.to("cuda")
    results = []
    for prefer in ("auto", "reference"):
        model = load_micro().to("cuda", torch.bfloat16)
        assert select_packed_attention(model, prefer) == (
            VARLEN if prefer == "auto" else VARLEN_REFERENCE
        )
        _, logprobs_K, _ = packed_logprobs(model, batch)
        logprobs_K.sum().backward()
        results.append((logprobs_K.detach(), model.model.layers[0].self_attn.q_proj.weight.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[0][1], results[1][1], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("attention", ["sdpa", "reference", "padded"])
@pytest.mark.parametrize("shared", [False, True])
def test_gradient_checkpointing_keeps_values_and_gradients(attention, shared):
    """The boundaries (mask or cu_seq_lens kwargs, the key index) reach recomputed layers."""
    seqs = grouped_sequences(2, 3, seed=6) if shared else random_sequences(4, seed=6)
    [batch] = pack(seqs, max_tokens=200)
    results = []
    for checkpointing in (False, True):
        model = load_micro()
        if attention != "sdpa":
            select_packed_attention(model, attention)
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        _, logprobs_K, _ = packed_logprobs(model, batch)
        logprobs_K.sum().backward()
        results.append((logprobs_K.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for plain, recomputed in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(plain, recomputed, atol=1e-6, rtol=1e-5)


def traceable_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
    """A CPU stand-in for torch's flash varlen kernel, with its contract (causal within each
    segment, the diagonal aligned to the segment's last key) in tensor ops that torch.compile
    traces: segment ids by searchsorted, one masked SDPA."""
    cu_q, cu_k = cu_seq_q.long(), cu_seq_k.long()
    pos_q = torch.arange(query.shape[0])
    pos_k = torch.arange(key.shape[0])
    seg_q = torch.searchsorted(cu_q[1:], pos_q, right=True)
    seg_k = torch.searchsorted(cu_k[1:], pos_k, right=True)
    reach_q = pos_q - cu_q[seg_q] + cu_k.diff()[seg_q] - cu_q.diff()[seg_q]
    allowed = (seg_q[:, None] == seg_k[None, :]) & (
        (pos_k - cu_k[seg_k])[None, :] <= reach_q[:, None]
    )
    assert options.get("window_size", (-1, 0)) == (-1, 0) and options.get("is_causal", True)
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=options.get("scale"), enable_gqa=True
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("shared", [False, True])
def test_compiled_layers_take_the_varlen_kernel_without_a_graph_break(monkeypatch, shared):
    """The trainer compiles each decoder layer; attention reads the varlen kernel and its keyword
    names inside that compiled code. Each layer must trace as one graph (fullgraph=True raises at
    any break): in s18f a functools.cache lookup and inspect.signature there split every layer in
    three, each piece with its own host work per micro-batch. Values and gradients as the
    reference kernel's, with gradient checkpointing as G1 runs it."""
    import reinforge.engine.varlen as varlen
    from reinforge.train.packing.attention import register_varlen_attention

    monkeypatch.setattr(varlen, "_VARLEN_ATTN", traceable_varlen)
    seqs = grouped_sequences(2, 3, seed=7) if shared else random_sequences(4, seed=7)
    [batch] = pack(seqs, max_tokens=200)
    results = []
    for implementation in (VARLEN_REFERENCE, VARLEN):
        torch._dynamo.reset()
        model = load_micro()
        register_varlen_attention()
        model.set_attn_implementation(implementation)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if implementation == VARLEN:
            for layer in model.get_decoder().layers:
                layer.compile(fullgraph=True, dynamic=True, backend="eager")
        _, logprobs_K, _ = packed_logprobs(model, batch)
        logprobs_K.sum().backward()
        results.append((logprobs_K.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for reference, compiled in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(reference, compiled, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_the_key_streams_backward_without_atomics_equals_index_selects(padded):
    """The key stream's gradient, summed back to the row by first entry plus the repeats
    (`attention._GatherKeys`), equals torch's index_select backward: shared prompts (each key
    repeated once per sample) and, padded to a graph's shape, the pad tokens and spare keys."""
    from dataclasses import replace

    from reinforge.train.packing.static import common_shape, pad_packed

    [batch] = pack(grouped_sequences(3, 4, seed=3), max_tokens=1000)
    if padded:
        shape = common_shape([batch], tokens=batch.num_tokens + 5, room=1.5)
        batch = pad_packed(batch, shape)
        assert batch.key_index_J.numel() > batch.num_tokens + 5  # spare keys
    seg = batch_segments(batch)
    assert seg.key_first_L is not None
    x = torch.randn(batch.num_tokens, 2, 4, dtype=torch.float64, requires_grad=True)
    grad_J = torch.randn(batch.key_index_J.numel(), 2, 4, dtype=torch.float64)
    keys = seg.keys(x)
    torch.testing.assert_close(keys, x.index_select(0, batch.key_index_J))
    (ours,) = torch.autograd.grad(keys, x, grad_J)
    plain = replace(seg, key_first_L=None, key_extra_E=None)
    (theirs,) = torch.autograd.grad(plain.keys(x), x, grad_J)
    torch.testing.assert_close(ours, theirs)
    assert batch.key_extra_E.numel() == batch.key_index_J.numel() - batch.num_tokens
