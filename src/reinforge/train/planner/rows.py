"""The rows of a memory plan's table (`Plan.rows`, printed by `--dry-run`): each item the
planner counted, its bytes, and a note saying how it was sized, then the two phases' peaks and
the headroom left.
"""

from __future__ import annotations

from reinforge.train.planner.graph import KeptGraph
from reinforge.train.planner.sizes import (
    LORA_BYTES_PER_PARAM,
    OPTIMIZER_STATE_BYTES,
    RESERVE_FRACTION,
    PlanInputs,
    Sizes,
    activation_bytes_per_token,
    format_bytes,
    lora_trainable_params,
    training_peak,
)


def report_rows(
    x: PlanInputs,
    s: Sizes,
    checkpointing: bool,
    tokens: int,
    pages: int,
    unsharded: bool,
    lora_generation_note: str = "",
    graph: KeptGraph | None = None,
):
    m, d = x.model, x.model.dtype_bytes
    per_token = activation_bytes_per_token(x, checkpointing)
    kv = pages * s.page_bytes(x.page_size)
    total_seqs = x.prompts_per_step * x.samples_per_prompt
    seqs_held = min(total_seqs, pages * total_seqs // s.kv_want_pages)
    peak_training = training_peak(x, s, checkpointing, tokens, pages)
    if unsharded:
        peak_training += s.unsharded_accumulation
    generation_peak = s.generation_fixed + kv
    if graph is not None:  # what a kept update graph holds beyond each phase's own
        peak_training += graph.held_training
        generation_peak += graph.held_generating
    shards = x.num_shards
    per = f" / {shards} processes (FSDP shard)" if shards > 1 else ""
    if x.replicas > 1:
        per = f" (whole, on each of {x.replicas} processes)"
    rows = [
        ("free device memory", x.free_bytes, ""),
        ("reserve", s.reserve, f"{RESERVE_FRACTION:.0%} of free: fragmentation, allocator"),
        ("weights", s.weights, f"{m.num_params:,} params x {d} B{per}"),
    ]
    if shards > 1:
        rows += [
            ("gathered weights, generation", s.gathered_generation, "the other shards, gathered"),
            ("gathered weights, training", s.gathered_training, "two layers + embeddings"),
            (
                "unsharded accumulation",
                s.unsharded_accumulation if unsharded else 0,
                "all layers gathered + float32 gradient sums for the step: "
                + (
                    "on"
                    if unsharded
                    else f"off (would need {format_bytes(s.unsharded_accumulation)})"
                ),
            ),
        ]
    if x.replicas > 1:
        rows.append(
            (
                "gradient all-reduce bucket",
                s.reduce_bucket,
                "float32, gradients averaged over the processes once per step",
            )
        )
    if x.lora_rank is None:
        state_bytes = OPTIMIZER_STATE_BYTES[x.optimizer]
        rows += [
            ("gradients", s.grads, f"{m.num_params:,} x {d} B{per} (training phase only)"),
            ("optimizer states", s.optimizer, f"{x.optimizer}: {state_bytes} B/param{per}"),
            ("LM head grad buffer", s.head_grad, "[V, H] in the weights' dtype (FSDP only)"),
        ]
    else:
        trainable = x.lora_trainable_params or lora_trainable_params(m, x.lora_rank)
        rows.append(
            (
                "LoRA adapter + grads + AdamW",
                s.lora_state,
                f"rank {x.lora_rank}: {trainable:,} float32 params x {LORA_BYTES_PER_PARAM} B{per}",
            )
        )
    mode = "checkpointing on" if checkpointing else "checkpointing off"
    rows += [
        (
            "logits chunk",
            s.logits_chunk,
            f"{x.logits_chunk_tokens} tokens x {m.vocab_size:,} x {d + 8} B",
        ),
        (
            "activations",
            tokens * per_token,
            f"{tokens:,} tokens/micro-batch x {per_token:,} B ({mode})",
        ),
        (
            "KV cache",
            kv,
            f"{pages:,} pages x {x.page_size} tokens x {s.kv_per_token:,} B; "
            f"about {seqs_held} of {total_seqs} sequences at once"
            + ("; freed for the update" if x.kv_released_in_training else ""),
        ),
        ("generation working set", s.generation, "sampling logits + one prefill chunk"),
        *(
            [("LoRA generation copy", s.lora_copy_held, lora_generation_note)]
            if x.lora_rank is not None
            else []
        ),
        *([("kept update graph", graph.held_generating, graph.note)] if graph else []),
        ("peak, training phase", peak_training, ""),
        ("peak, generation phase", generation_peak, ""),
        ("headroom", s.usable - max(peak_training, generation_peak), "unused after the reserve"),
    ]
    return tuple(rows)
