"""Memory planner decisions on the Qwen2.5 0.5B and 7B shapes (numbers copied from their HF
configs) and on a tiny CPU budget; overrides win when they fit and are refused when not."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from reinforge.errors import ConfigError
from reinforge.train.planner import (
    GRAPH_MICRO_TOKENS,
    MAX_MICRO_TOKENS,
    GiB,
    MiB,
    ModelShape,
    PlanInputs,
    activation_bytes_per_token,
    free_device_memory,
    lora_trainable_params,
    plan_memory,
)

QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
MICRO = {  # reinforge's built-in micro model, float32 on a CPU
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "tie_word_embeddings": True,
}
FREE_80GB = 79 * GiB  # what an 80 GB card reports free with the CUDA context up

M05 = ModelShape.from_hf_config(QWEN25_05B)
M7 = ModelShape.from_hf_config(QWEN25_7B)
# BENCHMARKS.md G1 and G2
G1 = dict(prompt_len=128, response_len=512, samples_per_prompt=8, prompts_per_step=32)
G2 = dict(prompt_len=256, response_len=1024, samples_per_prompt=8, prompts_per_step=32)


def test_shapes_count_parameters_and_kv_bytes():
    assert M05.num_params == 494_032_768  # Qwen2.5-0.5B: 0.49B
    assert M7.num_params == 7_615_616_512  # Qwen2.5-7B: 7.61B
    assert M05.kv_bytes_per_token == 12 * 1024  # 2 * 24 layers * 2 kv heads * 64 * 2 B
    assert M7.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert lora_trainable_params(M7, 32) == 32 * 28 * (7 * 3584 + 2 * 3584 + 2 * 512 + 3 * 18944)


def test_05b_full_finetune_on_80gb_fits_without_checkpointing():
    plan = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, **G1))
    assert not plan.gradient_checkpointing
    assert plan.micro_batch_tokens == GRAPH_MICRO_TOKENS  # replayed: the kept graph's size
    # a KV pool for all 256 sequences at full length: 32 groups x (8 shared prompt pages + 8 x 32)
    assert plan.kv_pages == 32 * (8 + 8 * 32)
    assert plan.kv_cache_bytes == plan.kv_pages * 16 * M05.kv_bytes_per_token
    table = plan.table()
    for item in ("weights", "optimizer states", "activations", "KV cache", "headroom"):
        assert item in table


def test_7b_full_finetune_adamw_on_80gb_is_refused_with_lora_suggested():
    with pytest.raises(ConfigError) as err:
        plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M7, optimizer="adamw_fp32", **G2))
    message = str(err.value)
    assert "full fine-tuning" in message
    assert "use LoRA (model.lora.rank = 16)" in message
    assert "2 GPUs" in message


def test_7b_lora_r32_on_80gb_trains_without_checkpointing():
    # G2 on an H100: the adapters add only their rank-r intermediates per token (session 17; the
    # float32 input copies the estimate counted before made it choose checkpointing here)
    plan = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M7, lora_rank=32, **G2))
    assert not plan.gradient_checkpointing
    assert 8192 <= plan.micro_batch_tokens < MAX_MICRO_TOKENS
    assert plan.kv_pages == 32 * (16 + 8 * 64)  # the whole step's rollout at once
    # 40 GB: checkpointing rather than micro-batches under 8,192 tokens
    smaller = plan_memory(PlanInputs(free_bytes=40 * GiB, model=M7, lora_rank=32, **G2))
    assert smaller.gradient_checkpointing
    assert smaller.micro_batch_tokens == MAX_MICRO_TOKENS


def _saved_bytes_per_token(lora_rank: int, tokens: int = 512) -> tuple[float, int]:
    """(bytes autograd saves per token in one bf16 Qwen2 decoder layer, the planner's estimate
    for one layer): the saved tensors' storages, parameters excluded."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reinforge.train.policy.lora import adapters_in_base_dtype, apply_lora

    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in MICRO.items() if k != "model_type"})
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if lora_rank:
        model, _ = apply_lora(model, rank=lora_rank)
        assert adapters_in_base_dtype(model) == 14
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
    storages: dict[int, int] = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t)
    layer.register_forward_pre_hook(lambda *_: hooks.__enter__())
    layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    model(input_ids=torch.randint(0, MICRO["vocab_size"], (1, tokens)))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)
    shape = ModelShape.from_hf_config(config.to_dict())
    x = PlanInputs(free_bytes=GiB, model=shape, lora_rank=lora_rank or None, **G1)
    ends = 4 * shape.dtype_bytes * shape.hidden_size
    per_layer = (activation_bytes_per_token(x, False) - ends) // (shape.num_layers + 1)
    return saved / tokens, per_layer


@pytest.mark.parametrize("lora_rank", [0, 32])
def test_activation_estimate_bounds_what_a_layer_saves(lora_rank):
    saved, estimate = _saved_bytes_per_token(lora_rank)
    # an upper bound, and not a loose one (the LoRA estimate before session 17 was 2.1x)
    assert saved <= estimate <= 1.3 * saved, (saved, estimate)


def test_a_kept_update_graph_is_planned_where_it_fits_beside_generation():
    """`train.cuda_graphs = "auto"` keeps the update's CUDA graph across steps only where one
    micro-batch's activations (the graph's memory) fit beside generation's KV pool and working
    set: G1 on 80 GB, not a 7B LoRA run whose pool was shrunk to fit 24 GB."""
    g1 = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, **G1))
    assert g1.keeps_update_graph
    rows = {item: (size, note) for item, size, note in g1.rows}
    held, note = rows["kept update graph"]
    # the KV pool released for the update: one pool for both, the update's part (gradients and
    # activations) beyond the KV pool held while generating (`graphs.share_memory`)
    kv, working = rows["KV cache"][0], rows["generation working set"][0]
    grads, activations = rows["gradients"][0], rows["activations"][0]
    assert held == max(0, grads + activations - kv) and "held while generating" in note
    assert "in one pool with the KV pool" in note
    # generation's peak counts what the kept graph holds
    assert rows["peak, generation phase"][0] >= held + kv + working + rows["weights"][0]
    # with checkpointing the update's part is smaller: the pool is then as large as the update
    # part or the KV pool, whichever is larger, in both phases
    lean = plan_memory(
        PlanInputs(free_bytes=FREE_80GB, model=M05, gradient_checkpointing=True, **G1)
    )
    rows = {item: size for item, size, _ in lean.rows}
    pool = max(rows["KV cache"], rows["gradients"] + rows["activations"])
    assert rows["kept update graph"] == pool - rows["KV cache"]
    assert rows["peak, generation phase"] == (
        rows["weights"] + rows["optimizer states"] + rows["generation working set"] + pool
    )
    # a graph kept in a pool of its own (the KV pool kept through the update): its activations
    own = plan_memory(
        PlanInputs(free_bytes=FREE_80GB, model=M05, kv_released_in_training=False, **G1)
    )
    own_rows = {item: size for item, size, _ in own.rows}
    assert own.keeps_update_graph and own_rows["kept update graph"] == own_rows["activations"]
    # an update part smaller than the KV pool: the update's phase holds the rest of the pool
    small = PlanInputs(
        free_bytes=FREE_80GB,
        model=M05,
        gradient_checkpointing=True,
        micro_batch_tokens=1024,
        **G1,
    )
    rows = {item: size for item, size, _ in plan_memory(small).rows}
    region = rows["gradients"] + rows["activations"]
    assert rows["kept update graph"] == 0 < rows["KV cache"] - region
    launched = {
        item: size for item, size, _ in plan_memory(replace(small, update_graph="off")).rows
    }
    assert rows["peak, training phase"] == (
        launched["peak, training phase"] + rows["KV cache"] - region
    )
    off = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, update_graph="off", **G1))
    assert not off.keeps_update_graph
    assert dict((i, n) for i, _, n in off.rows)["kept update graph"].endswith("not kept")
    tight = plan_memory(PlanInputs(free_bytes=24 * GiB, model=M7, lora_rank=32, **G2))
    assert not tight.keeps_update_graph
    size, note = {i: (b, n) for i, b, n in tight.rows}["kept update graph"]
    assert size == 0 and "no room beside the KV pool" in note


def test_a_replayed_update_takes_smaller_micro_batches():
    """Where the update replays a kept graph (one process, a dense model), micro-batches cost no
    host work, so the planner packs `GRAPH_MICRO_TOKENS` instead of `MAX_MICRO_TOKENS` (same
    speed, less memory: s21d); launched, or set by the user, they stay as they were."""
    kept = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, **G1))
    assert kept.keeps_update_graph and kept.micro_batch_tokens == GRAPH_MICRO_TOKENS
    note = {i: n for i, _, n in kept.rows}["kept update graph"]
    assert f"{GRAPH_MICRO_TOKENS:,} tokens: replayed" in note
    off = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, update_graph="off", **G1))
    assert off.micro_batch_tokens == MAX_MICRO_TOKENS > GRAPH_MICRO_TOKENS
    shards = plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, num_shards=2, **G1))
    assert shards.micro_batch_tokens > GRAPH_MICRO_TOKENS  # FSDP: launched, host-bound below
    chosen = PlanInputs(free_bytes=FREE_80GB, model=M05, micro_batch_tokens=16384, **G1)
    assert plan_memory(chosen).micro_batch_tokens == 16384


def test_7b_lora_on_24gb_shrinks_the_kv_pool():
    plan = plan_memory(PlanInputs(free_bytes=24 * GiB, model=M7, lora_rank=32, **G2))
    assert plan.gradient_checkpointing
    assert 80 <= plan.kv_pages < 32 * (16 + 8 * 64)
    # the pool is freed for the update, so training gets the memory generation used
    assert plan.micro_batch_tokens > 4 * (256 + 1024)
    rows = dict((item, size) for item, size, _ in plan.rows)
    assert rows["peak, training phase"] < rows["peak, generation phase"] + rows["activations"]
    # an engine that kept its pool through the update would leave room for one sequence only
    kept = PlanInputs(
        free_bytes=24 * GiB, model=M7, lora_rank=32, kv_released_in_training=False, **G2
    )
    plan_kept = plan_memory(kept)
    assert plan_kept.micro_batch_tokens == 256 + 1024
    assert 80 <= plan_kept.kv_pages < plan.kv_pages


def test_long_responses_that_cannot_fit_suggest_a_shorter_max_new_tokens():
    setup = dict(G2, response_len=32768)
    with pytest.raises(ConfigError, match=r"reduce rollout\.max_new_tokens to (\d+)") as err:
        plan_memory(PlanInputs(free_bytes=19 * GiB, model=M7, lora_rank=32, **setup))
    suggested = int(re.search(r"max_new_tokens to (\d+)", str(err.value)).group(1))
    fits = PlanInputs(
        free_bytes=19 * GiB, model=M7, lora_rank=32, **dict(G2, response_len=suggested)
    )
    assert plan_memory(fits).gradient_checkpointing
    too_long = PlanInputs(
        free_bytes=19 * GiB, model=M7, lora_rank=32, **dict(G2, response_len=suggested + 1)
    )
    with pytest.raises(ConfigError):
        plan_memory(too_long)


def test_tiny_cpu_budget():
    micro = ModelShape.from_hf_config(MICRO, dtype_bytes=4)
    setup = dict(prompt_len=32, response_len=16, samples_per_prompt=4, prompts_per_step=4)
    plan = plan_memory(PlanInputs(free_bytes=256 * MiB, model=micro, **setup))
    assert not plan.gradient_checkpointing
    assert plan.micro_batch_tokens == 16 * 48  # the whole step in one micro-batch
    with pytest.raises(ConfigError, match="is free"):
        plan_memory(PlanInputs(free_bytes=32 * MiB, model=micro, **setup))


def test_overrides_win_when_they_fit():
    plan = plan_memory(
        PlanInputs(
            free_bytes=FREE_80GB,
            model=M05,
            micro_batch_tokens=2048,
            gradient_checkpointing=True,
            kv_cache_bytes=GiB,
            **G1,
        )
    )
    assert plan.micro_batch_tokens == 2048
    assert plan.gradient_checkpointing
    assert plan.kv_pages == GiB // (16 * M05.kv_bytes_per_token)
    no_checkpointing = plan_memory(
        PlanInputs(free_bytes=40 * GiB, model=M7, lora_rank=32, gradient_checkpointing=False, **G2)
    )
    assert not no_checkpointing.gradient_checkpointing
    assert 1280 <= no_checkpointing.micro_batch_tokens < 8192


def test_override_that_cannot_fit_is_refused_with_what_fits():
    x = PlanInputs(
        free_bytes=FREE_80GB,
        model=M05,
        micro_batch_tokens=60000,
        gradient_checkpointing=False,
        **G1,
    )
    with pytest.raises(ConfigError) as err:
        plan_memory(x)
    message = str(err.value)
    assert "train.micro_batch_tokens = 60000" in message
    assert "at most train.micro_batch_tokens = " in message
    most = int(message.split("at most train.micro_batch_tokens = ")[1].split(" ")[0].rstrip(","))
    ok = plan_memory(PlanInputs(**{**x.__dict__, "micro_batch_tokens": most}))
    assert ok.micro_batch_tokens == most
    with pytest.raises(ConfigError):
        plan_memory(PlanInputs(**{**x.__dict__, "micro_batch_tokens": most + 1}))


def test_overrides_below_one_sequence_are_refused():
    with pytest.raises(ConfigError, match=r"train\.micro_batch_tokens = 100 .* >= 640"):
        plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, micro_batch_tokens=100, **G1))
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_bytes = 1000 cannot hold"):
        plan_memory(PlanInputs(free_bytes=FREE_80GB, model=M05, kv_cache_bytes=1000, **G1))


def test_checkpointing_cuts_activations_per_token():
    x = PlanInputs(free_bytes=FREE_80GB, model=M7, lora_rank=32, **G2)
    assert activation_bytes_per_token(x, True) * 8 < activation_bytes_per_token(x, False)


def test_free_device_memory_is_none_off_cuda():
    assert free_device_memory("cpu") is None
